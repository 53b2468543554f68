"""NumPy fused kernels vs independent torch CPU references (forward ops and torch autograd).

Tolerances: float64 ~1e-10 relative, float32 ~1e-5 relative (both scaled by the largest
reference magnitude); bfloat16/float16 results must be within 2x the error of the same op run
by torch in that dtype (both measured against a float64 torch reference) plus a small atol.
"""
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuelgraph.backends.numpy import helpers, linear, loss, norm, rope
from fuelgraph.errors import FuelGraphError

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
DTYPES = list(NP)
HALF = ("bfloat16", "float16")


@pytest.fixture(scope="module", autouse=True)
def _torch_single_thread():
    """torch's OpenMP pool costs ~30 ms per tiny op on a loaded 2-core box; one thread is exact
    and fast here."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["default", "tiny"])
def chunking(request, monkeypatch):
    """'tiny' forces many chunks and the thread pool even for small arrays."""
    if request.param == "tiny":
        monkeypatch.setattr(helpers, "CHUNK_ELEMS", 96)
        monkeypatch.setattr(helpers, "PARALLEL_MIN_ELEMS", 0)
    return request.param


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


# ----------------------------------------------------------------------------- fused_linear
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("ash,bsh", [((4, 8), (8, 3)), ((1, 1), (1, 1)), ((2, 3, 5, 8), (8, 4)),
                                     ((2, 1, 5, 8), (3, 8, 4)), ((5, 8), (2, 8, 4)),
                                     ((2, 3, 5, 8), (2, 3, 8, 4)), ((3, 0), (0, 2)),
                                     ((2, 3, 4), (4, 0))])
def test_fused_linear(dt, ash, bsh, chunking):
    rng = np.random.default_rng(1)
    a, b, bias = rand(rng, ash, dt), rand(rng, bsh, dt), rand(rng, bsh[-1:], dt)
    out = linear.fused_linear(a, b, bias)
    ref = t64(a) @ t64(b) + t64(bias)
    same = torch.matmul(tdt(a, dt), tdt(b, dt)) + tdt(bias, dt)
    check(out, ref, dt, same, rtol=1e-5 if dt == "float32" else None)


def test_fused_linear_large_magnitude():
    rng = np.random.default_rng(2)
    a, b, bias = rand(rng, (64, 96), "float32", 1e3), rand(rng, (96, 33), "float32", 1e3), \
        rand(rng, (33,), "float32", 1e6)
    check(linear.fused_linear(a, b, bias), t64(a) @ t64(b) + t64(bias), "float32", rtol=1e-5)


@pytest.mark.parametrize("ash,bsh,bias_n,msg", [((4, 8), (7, 3), 3, "'b'"),
                                                ((4, 8), (8, 3), 4, "'bias'"),
                                                ((4, 4, 8), (2, 8, 3), 3, "batch"),
                                                ((8,), (8, 3), 3, "'a'")])
def test_fused_linear_errors(ash, bsh, bias_n, msg):
    with pytest.raises(FuelGraphError, match=msg):
        linear.fused_linear(np.ones(ash, np.float32), np.ones(bsh, np.float32),
                            np.ones(bias_n, np.float32))
    with pytest.raises(FuelGraphError, match="dtype"):
        linear.fused_linear(np.ones((2, 3), np.float32), np.ones((3, 2), np.float64),
                            np.ones(2, np.float32))


# ----------------------------------------------------------------------------- norms
NORM_CASES = [((7,), 1.0, 0.0), ((1, 1), 1.0, 0.0), ((3, 5, 64), 1.0, 0.0), ((2, 1, 300), 1.0, 0.0),
              ((33, 1024), 1e4, 0.0), ((9, 100), 0.01, 100.0)]


def _torch_norm(kind, x, n, eps):
    return F.rms_norm(x, (n,), eps=eps) if kind == "rms" else F.layer_norm(x, (n,), eps=eps)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape,scale,offset", NORM_CASES)
def test_norm_forward(dt, kind, shape, scale, offset, chunking):
    rng = np.random.default_rng(3)
    x, n, eps = rand(rng, shape, dt, scale, offset), shape[-1], 1e-5
    fn = norm.rms_norm_last_dim if kind == "rms" else norm.layer_norm_last_dim
    out = fn(x, eps=eps)
    check(out, _torch_norm(kind, t64(x), n, eps), dt, _torch_norm(kind, tdt(x, dt), n, eps),
          cond=kind == "ln" and offset > 100 * scale)      # mean >> spread: f32 mean limits


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "ln"])
@pytest.mark.parametrize("shape,scale,offset", NORM_CASES)
def test_norm_backward(dt, kind, shape, scale, offset, chunking):
    rng = np.random.default_rng(4)
    x, g, n, eps = rand(rng, shape, dt, scale, offset), rand(rng, shape, dt), shape[-1], 1e-6
    fn = norm.rms_norm_last_dim_backward if kind == "rms" else norm.layer_norm_last_dim_backward
    out = fn(x, g, eps=eps)
    xr = t64(x, grad=True)
    ref, = torch.autograd.grad(_torch_norm(kind, xr, n, eps), xr, t64(g))
    xs = tdt(x, dt, grad=True)
    same, = torch.autograd.grad(_torch_norm(kind, xs, n, eps), xs, tdt(g, dt))
    x64 = x.astype(np.float64)
    spread = x64 if kind == "rms" else x64 - x64.mean(-1, keepdims=True)
    r = 1 / np.sqrt((spread ** 2).mean(-1, keepdims=True) + eps)
    # dx = r*g - (correction): the natural scale is |g| * r even where the two terms cancel
    check(out, ref, dt, same, scale=float(np.abs(g.astype(np.float64) * r).max()),
          cond=kind == "ln" and offset > 100 * scale)


def test_norm_edge_cases():
    z = np.zeros((2, 4), np.float32)
    assert np.isnan(norm.rms_norm_last_dim(z, eps=0.0)).all()      # 0 * inf, as specified
    np.testing.assert_array_equal(norm.layer_norm_last_dim(z, eps=1e-5), z)
    with pytest.raises(FuelGraphError, match="'x'"):
        norm.rms_norm_last_dim(np.zeros((3, 0), np.float32), eps=1e-5)
    with pytest.raises(FuelGraphError, match="'grad'"):
        norm.layer_norm_last_dim_backward(z, np.zeros((2, 3), np.float32), eps=1e-5)


# ----------------------------------------------------------------------------- rope
def _torch_rope(x, cos, sin, interleaved):
    if not interleaved:
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin
    xe, xo = x[..., 0::2], x[..., 1::2]
    ye = xe * cos[..., 0::2] - xo * sin[..., 0::2]
    yo = xo * cos[..., 1::2] + xe * sin[..., 1::2]
    return torch.stack([ye, yo], -1).flatten(-2)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(1, 2), (5, 8), (2, 3, 5, 8), (1, 2, 7, 64), (3, 40, 6)])
def test_rope(dt, interleaved, shape, chunking):
    rng = np.random.default_rng(5)
    x = rand(rng, shape, dt, 3.0)
    cos, sin = rand(rng, shape[-2:], dt), rand(rng, shape[-2:], dt)   # general tables
    out = rope.rope(x, cos, sin, interleaved=interleaved)
    ref = _torch_rope(t64(x), t64(cos), t64(sin), interleaved)
    same = _torch_rope(tdt(x, dt), tdt(cos, dt), tdt(sin, dt), interleaved)
    check(out, ref, dt, same)


def test_rope_errors_and_empty():
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(FuelGraphError, match="even"):
        rope.rope(np.ones((3, 5), np.float32), np.ones((3, 5), np.float32),
                  np.ones((3, 5), np.float32), interleaved=False)
    with pytest.raises(FuelGraphError, match="'sin'"):
        rope.rope(x, np.ones((3, 4), np.float32), np.ones((2, 4), np.float32), interleaved=True)
    assert rope.rope(np.ones((0, 3, 4), np.float32), np.ones((3, 4), np.float32),
                     np.ones((3, 4), np.float32), interleaved=False).shape == (0, 3, 4)


# ----------------------------------------------------------------------------- cross-entropy
CE_SHAPES = [(11,), (5, 7), (2, 3, 11), (1, 1), (64, 300)]


def _targets(rng, shape, v, ignore_index):
    t = rng.integers(0, v, shape[:-1]).astype(np.int64)
    if ignore_index is not None and t.size > 1:
        t.reshape(-1)[::3] = ignore_index
    return t


def _torch_ce(x, t, reduction, ignore_index):
    v = x.shape[-1]
    out = F.cross_entropy(x.reshape(-1, v), torch.from_numpy(t).reshape(-1), reduction=reduction,
                          ignore_index=-100 if ignore_index is None else ignore_index)
    return out.reshape(t.shape) if reduction == "none" else out


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("reduction,ignore_index,scale", [
    ("mean", -100, 1.0), ("sum", None, 1.0), ("none", 2, 30.0), ("mean", 2, 30.0),
    ("none", None, 1.0)])
def test_cross_entropy(dt, shape, reduction, ignore_index, scale, chunking):
    rng = np.random.default_rng(6)
    x = rand(rng, shape, dt, scale)
    t = _targets(rng, shape, shape[-1], ignore_index)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    out_dt = "float64" if dt == "float64" else "float32"
    assert out.shape == (t.shape if reduction == "none" else ())
    ref = _torch_ce(t64(x), t, reduction, ignore_index)
    check(out, ref, dt, _torch_ce(tdt(x, dt), t, reduction, ignore_index), out_dt=out_dt)
    # backward vs torch autograd
    g = np.asarray(rng.standard_normal(t.shape if reduction == "none" else ()), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction,
                                                   ignore_index=ignore_index)
    xr, xs = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(_torch_ce(xr, t, reduction, ignore_index), xr, t64(g))
    same, = torch.autograd.grad(_torch_ce(xs, t, reduction, ignore_index), xs,
                                torch.from_numpy(g).to(xs.dtype))
    check(dx, ref, dt, same)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_all_ignored(reduction):
    x = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
    t = np.full(4, -100, np.int64)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=-100)
    assert out.dtype == np.float32 and not out.any()              # mean: 0, not 0/0
    g = np.ones(4 if reduction == "none" else (), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction, ignore_index=-100)
    assert dx.dtype == np.float32 and dx.shape == x.shape and not dx.any()


def test_cross_entropy_empty_class_axis():
    x = np.zeros((3, 0), np.float32)
    out = loss.fused_softmax_cross_entropy(x, np.full(3, -100), reduction="none", ignore_index=-100)
    assert out.shape == (3,) and not out.any()
    with pytest.raises(FuelGraphError, match="'targets'"):
        loss.fused_softmax_cross_entropy(x, np.zeros(3, np.int64), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("t,ignore_index,bad", [([0, 7, 1], -100, 7), ([0, -1, 1], -100, -1),
                                                ([0, -100, 1], None, -100), ([0, 2, 9], 2, 9)])
def test_cross_entropy_bad_target(t, ignore_index, bad):
    x, t = np.zeros((3, 7), np.float32), np.array(t, np.int64)
    for fn, args in ((loss.fused_softmax_cross_entropy, ()),
                     (loss.fused_softmax_cross_entropy_backward, (np.float32(1),))):
        with pytest.raises(FuelGraphError,
                           match=rf"fused_softmax_cross_entropy.*'targets'.*(?<![\d-]){bad}(?!\d)"):
            fn(x, t, *args, reduction="mean", ignore_index=ignore_index)


# ----------------------------------------------------------------------------- reduce_max backward
RMAX_CASES = [((4, 6), (4, 1)), ((4, 6), (1, 6)), ((2, 3, 4), (2, 1, 1)), ((2, 3, 4), (1, 3, 1)),
              ((5,), (1,)), ((3, 1, 4), (3, 1, 1)), ((2, 50, 40), (2, 50, 1))]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("xs,gs", RMAX_CASES)
@pytest.mark.parametrize("ties", [True, False])
def test_reduce_max_backward(dt, xs, gs, ties, chunking):
    rng = np.random.default_rng(8)
    x = (rng.integers(0, 3, xs) if ties else rng.standard_normal(xs) * 1e3).astype(NP[dt])
    g = rand(rng, gs, dt)
    axes = tuple(i for i, (a, b) in enumerate(zip(gs, xs)) if a == 1 and b != 1)
    out = helpers.reduce_max_to_backward(x, g)
    xr, xh = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(torch.amax(xr, dim=axes, keepdim=True), xr, t64(g))
    same, = torch.autograd.grad(torch.amax(xh, dim=axes, keepdim=True), xh, tdt(g, dt))
    check(out, ref, dt, same)


@pytest.mark.parametrize("dt", DTYPES)
def test_reduce_max_backward_nan_inf(dt):
    x = np.array([[1, np.nan, 3], [2, 2, 1], [-np.inf, -np.inf, -np.inf], [np.inf, 0, np.inf]],
                 NP[dt])
    g = np.array([[5], [0], [3], [2]], NP[dt])
    out = helpers.reduce_max_to_backward(x, g)
    xr = t64(x, grad=True)
    ref, = torch.autograd.grad(torch.amax(xr, dim=1, keepdim=True), xr, t64(g))
    assert np.isnan(as64(out)[0]).all()                        # NaN window -> NaN, like torch
    np.testing.assert_array_equal(as64(out), ref.numpy())


def test_reduce_max_backward_bad_grad():
    with pytest.raises(FuelGraphError, match="'grad'"):
        helpers.reduce_max_to_backward(np.ones((3, 4), np.float32), np.ones((3, 2), np.float32))


# ----------------------------------------------------------------------------- powi backward
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("exp", [-3, -1, 0, 1, 2, 5, 8])
def test_powi_backward(dt, exp, chunking):
    rng = np.random.default_rng(9)
    x = rand(rng, (3, 67), dt, 1.5)
    x.reshape(-1)[::10] = 0                                    # x = 0: 0, +-inf or g
    g = rand(rng, (3, 67), dt)
    out = helpers.powi_backward(x, g, exp=exp)
    xr, xh = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(xr ** exp, xr, t64(g))
    same, = torch.autograd.grad(xh ** exp, xh, tdt(g, dt))
    check(out, ref, dt, same)


def test_powi_backward_exact_and_zero():
    x = np.array([-3, -2, -1, 0, 1, 2, 3], np.float32)
    g = np.ones_like(x)
    np.testing.assert_array_equal(helpers.powi_backward(x, g, exp=4), 4 * x.astype(np.float64) ** 3)
    z = helpers.powi_backward(np.array([0, np.nan, np.inf], np.float32), np.ones(3, np.float32),
                              exp=0)
    assert z.dtype == np.float32 and not z.any()               # H.18: zeros, not NaN


# ----------------------------------------------------------------------------- inplace affine
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (), (5,), (3, 4, 5), (300, 1000)])
def test_inplace_affine(dt, shape, chunking):
    x = rand(np.random.default_rng(10), shape, dt, 4.0)
    mul, add = 1.37, -0.25
    t = torch.from_numpy(x.astype(np.float64)).to(torch.float64 if dt == "float64"
                                                  else torch.float32)
    expect = (t * mul + add).to(TORCH[dt])                     # acc-dtype mul, add, one store
    res = helpers.inplace_affine(x, mul=mul, add=add)
    assert res is x and x.dtype == np.dtype(NP[dt]) and x.shape == shape
    np.testing.assert_array_equal(as64(x), as64(expect))


def test_inplace_affine_rejects_readonly():
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    with pytest.raises(FuelGraphError, match="'x'"):
        helpers.inplace_affine(x, mul=2.0, add=1.0)


# ----------------------------------------------------------------------------- bit stability
@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_chunking_is_bit_stable_and_inputs_untouched(dt, monkeypatch):
    rng = np.random.default_rng(11)
    x, g = rand(rng, (37, 300), dt), rand(rng, (37, 300), dt)
    t = rng.integers(0, 300, 37)
    runs = [lambda: linear.fused_linear(x, g.T.copy(), g[0, :37].copy()),
            lambda: helpers.reduce_max_to_backward(x, g[:, :1].copy()),
            lambda: helpers.powi_backward(x, g, exp=-3),
            lambda: helpers.inplace_affine(x.copy(), mul=0.3, add=2.0),
            lambda: norm.rms_norm_last_dim(x, eps=1e-6),
            lambda: norm.layer_norm_last_dim(x, eps=1e-6),
            lambda: norm.layer_norm_last_dim_backward(x, g, eps=1e-6),
            lambda: norm.rms_norm_last_dim_backward(x, g, eps=1e-6),
            lambda: rope.rope(x.reshape(1, 37, 300), x[:, ::-1].copy(), g, interleaved=True),
            lambda: loss.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100),
            lambda: loss.fused_softmax_cross_entropy_backward(x, t, np.float32(2), reduction="sum",
                                                              ignore_index=-100)]
    x0, g0 = x.copy(), g.copy()
    base = [f() for f in runs]
    monkeypatch.setattr(helpers, "CHUNK_ELEMS", 700)
    monkeypatch.setattr(helpers, "PARALLEL_MIN_ELEMS", 0)
    for f, b in zip(runs, base):
        np.testing.assert_array_equal(f(), b)
    np.testing.assert_array_equal(x, x0)                       # inputs are never written
    np.testing.assert_array_equal(g, g0)


# ----------------------------------------------------------------------------- float16 casts
def test_float16_casts_match_numpy():
    """helpers' integer-op float16 <-> float32 casts are bit-identical to NumPy's."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    ref, got = h.astype(np.float32), helpers.to_acc(h, np.dtype(np.float32))
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    bits = np.random.default_rng(12).integers(0, 1 << 32, 1 << 18, dtype=np.uint64)
    edge = np.array([0.0, -0.0, 65504, 65519.99, 65520, 1e9, np.inf, -np.inf, 2.0 ** -24,
                     2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14 * (1 - 2.0 ** -11), -1e-8], np.float32)
    f = np.concatenate([bits.astype(np.uint32).view(np.float32), edge])
    with np.errstate(all="ignore"):
        ref = f.astype(np.float16)
    got = np.empty(f.shape, np.float16)
    helpers.store(got, f)
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint16), ref[~nan].view(np.uint16))
