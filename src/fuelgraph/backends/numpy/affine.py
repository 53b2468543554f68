"""NumPy kernel of INPLACE_AFFINE (id 16): `x <- mul * x + add` in x's own buffer."""
from __future__ import annotations

import numpy as np

from ...registry.core import FusedOps
from ..base import kernel, row_cost
from .common import acc_dtype, run_flat, store, to_acc


@kernel(FusedOps.INPLACE_AFFINE, "numpy", cost=row_cost(2))
def inplace_affine(x, *, mul, add, out=None):
    """INPLACE_AFFINE: `x <- mul * x + add` written INTO x; returns x (same object).
    With `out` (a fresh array shaped like x) the result goes there and x is only read: the
    runtime uses this when it may not overwrite x, instead of copying x first.

    x: any shape, C-contiguous and writable. mul/add are narrowed to float32 for
    float32/float16/bfloat16 inputs (float64 kept for float64). The product and the sum are
    rounded separately in the accumulation dtype (no FMA); halves are widened to float32 and
    rounded to nearest-even once on store.
    """
    dst = x if out is None else out
    acc = acc_dtype(x.dtype)
    mul_a, add_a = acc.type(mul), acc.type(add)
    src, flat = x.reshape(-1), dst.reshape(-1)
    native = x.dtype == acc

    def work(i0, i1):
        d = flat[i0:i1]
        t = d if native else to_acc(src[i0:i1], acc)
        np.multiply(src[i0:i1] if native else t, mul_a, out=t)
        np.add(t, add_a, out=t)
        if not native:
            store(d, t)

    with np.errstate(all="ignore"):
        run_flat(work, flat.size)
    return dst
