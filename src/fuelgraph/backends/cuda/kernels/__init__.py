"""Triton (and cuBLAS/cuDNN-through-torch) kernels of the CUDA backend, one module per op
family named like its registry module. Each kernel registers itself with
`@kernel(<op id>, "cuda", dtypes=..., supports=...)`; the backend imports every module here.
Kernels take and return torch tensors, with the op's params as keyword arguments."""
