"""Oracle helpers of the NumPy kernel tests: fused kernels vs independent torch CPU references
(forward ops and torch autograd).

Tolerances: float64 ~1e-10 relative, float32 ~1e-5 relative (both scaled by the largest
reference magnitude); bfloat16/float16 results must be within 2x the error of the same op run
by torch in that dtype (both measured against a float64 torch reference) plus a small atol.
"""
import ml_dtypes
import numpy as np
import torch

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
DTYPES = list(NP)


def rand(rng, shape, dt, scale=1.0, offset=0.0):
    return np.asarray(rng.standard_normal(shape) * scale + offset).astype(NP[dt])


def t64(a, grad=False):
    t = torch.from_numpy(np.asarray(a).astype(np.float64))
    return t.requires_grad_() if grad else t


def tdt(a, dt, grad=False):
    t = torch.from_numpy(np.asarray(a).astype(np.float64)).to(TORCH[dt])
    return t.requires_grad_() if grad else t


def as64(t):
    return t.detach().to(torch.float64).numpy() if isinstance(t, torch.Tensor) \
        else np.asarray(t).astype(np.float64)


def check(ours, ref, dt, same=None, out_dt=None, rtol=None, scale=None, cond=False):
    """Compare `ours` with the float64 reference `ref`; `same` = torch result in dtype dt.

    The reference is first rounded to the output dtype: where that overflows (or is NaN) ours
    must match exactly. `scale` (default max |ref|) sets the absolute tolerance. `cond=True`
    marks an ill-conditioned float32 case, judged like the halves (vs torch's own error).
    """
    odt = out_dt or dt
    assert ours.dtype == np.dtype(NP[odt])
    o, r = as64(ours), as64(ref)
    assert o.shape == r.shape
    with np.errstate(over="ignore"):
        r_dt = r.astype(NP[odt]).astype(np.float64)            # reference rounded to odt
    fin = np.isfinite(r_dt)
    np.testing.assert_array_equal(np.isfinite(o), fin)
    np.testing.assert_array_equal(o[~fin], r_dt[~fin])
    if not fin.any():
        return
    o, r = o[fin], r[fin]
    scale = scale or max(1e-30, float(np.abs(r).max()))
    if odt in ("float32", "float64") and not cond:
        rt = rtol or (1e-10 if odt == "float64" else 1e-5)
        np.testing.assert_allclose(o, r, rtol=rt, atol=rt * 0.1 * scale)
    else:
        s = as64(same)[fin]
        err_o = np.abs(o - r).max()
        err_t = np.where(np.isfinite(s), np.abs(s - r), np.inf).max()
        assert err_o <= 2 * err_t + 1e-6 * scale, (err_o, err_t)
