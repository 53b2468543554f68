"""Plans (schedule, kernels, buffer lifetimes, in-place aliasing), the plan cache, the executor."""
