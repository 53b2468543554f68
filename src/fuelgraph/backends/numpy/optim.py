"""NumPy kernels of the optimizer updates (registry/optim.py): each writes the new parameter
and state into the buffers it is given (the runtime hands it copies where it may not
overwrite), in chunks over the flat buffers, in the accumulation dtype with one rounding per
output, operation for operation as the recipe (and torch.optim's single-tensor update)."""
from __future__ import annotations

import numpy as np

from ...registry.optim import ADAMW_STEP, SGD_STEP
from ..base import kernel, row_cost
from .common import acc_dtype, row_spans, run_spans, store, to_acc

#: elements per chunk: a dozen passes over each chunk stay in the L2 cache (p, g, m, v and one
#: temporary: 1.25 MiB of float32). Measured on 2 cores (AdamW over the 11.5M parameters of the
#: benchmark Llama): 16K-element chunks run at 1.1-1.8x the time of 64K ones on two threads,
#: the ~1 us of GIL-holding Python per ufunc call serializing the threads; 128K is slower again
CHUNK = 1 << 16


def run_flat(fn, n):
    run_spans(fn, row_spans(n, 1, CHUNK), n)


@kernel(ADAMW_STEP, "numpy", cost=row_cost(12))
def adamw_step(p, g, m, v, decay, step_size, bc2_sqrt, *, beta1, beta2, eps):
    """(p, m, v) updated in place; returns them."""
    acc = acc_dtype(p.dtype)
    dec, ss, bc = (acc.type(np.asarray(s).item()) for s in (decay, step_size, bc2_sqrt))
    w1, b2, w2, e = acc.type(1.0 - beta1), acc.type(beta2), acc.type(1.0 - beta2), acc.type(eps)
    neg = acc.type(-ss)
    fp, fg, fm, fv = (a.reshape(-1) for a in (p, g, m, v))
    native = p.dtype == acc

    def work(i0, i1):
        # native dtype: to_acc returns views, so the updates land in p, m, v directly
        pa, ga, ma, va = (to_acc(a[i0:i1], acc) for a in (fp, fg, fm, fv))
        t = np.subtract(ga, ma)
        np.multiply(pa, dec, out=pa)
        np.multiply(t, w1, out=t)
        np.add(ma, t, out=ma)
        np.multiply(va, b2, out=va)
        np.multiply(ga, w2, out=t)
        np.multiply(t, ga, out=t)
        np.add(va, t, out=va)
        np.sqrt(va, out=t)
        np.divide(t, bc, out=t)
        np.add(t, e, out=t)
        np.divide(ma, t, out=t)
        np.multiply(t, neg, out=t)
        np.add(pa, t, out=pa)
        if not native:
            store(fp[i0:i1], pa)
            store(fm[i0:i1], ma)
            store(fv[i0:i1], va)

    with np.errstate(all="ignore"):
        run_flat(work, fp.size)
    return p, m, v


@kernel(SGD_STEP, "numpy", cost=row_cost(6))
def sgd_step(p, g, lr, *state, momentum, dampening, weight_decay, nesterov):
    """p (and buf) updated in place; returns p (or (p, buf))."""
    acc = acc_dtype(p.dtype)
    neg = acc.type(-np.asarray(lr).item())
    wd, mo, dm = acc.type(weight_decay), acc.type(momentum), acc.type(1.0 - dampening)
    fp, fg = p.reshape(-1), g.reshape(-1)
    fb = state[0].reshape(-1) if state else None
    first = bool(np.asarray(state[1]).item() > 0.5) if state else False
    native = p.dtype == acc

    def work(i0, i1):
        pa = to_acc(fp[i0:i1], acc)
        d = to_acc(fg[i0:i1], acc).astype(acc, copy=True)
        if weight_decay != 0.0:
            d += wd * pa
        if fb is not None:
            b = to_acc(fb[i0:i1], acc)
            if first:
                b[...] = d
            else:
                np.multiply(b, mo, out=b)
                b += dm * d
            d = d + mo * b if nesterov else b
            if not native:
                store(fb[i0:i1], b)
        pa += neg * d
        if not native:
            store(fp[i0:i1], pa)

    with np.errstate(all="ignore"):
        run_flat(work, fp.size)
    return (p, state[0]) if state else p
