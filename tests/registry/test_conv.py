"""CONV2D (6), CONV_TRANSPOSE2D (11), CAUSAL_CONV1D (18) and their backward helpers
(conv2d_backward_weight, causal_conv1d_backward) through the public API, against torch CPU:
forward over the four float dtypes and odd shapes (groups, dilation, asymmetric stride and
padding, "same" with even kernels, batch 1, L < W), gradients of every input, second order,
the backward emitting fused ops, recipe vs kernel, and every build-time validation error."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError
from fuelgraph.registry.conv import CAUSAL_CONV1D_BACKWARD, CONV2D_BACKWARD_WEIGHT
from fuelgraph.registry.core import BackwardKind, FusedOps
from oracle import assert_close_dtype, assert_flash_rule

pytestmark = pytest.mark.filterwarnings("ignore:Using padding=.same.:UserWarning")
DTYPES = [fg.float32, fg.float64, fg.bfloat16, fg.float16]
SLACK = {"bfloat16": 4e-3, "float16": 5e-4}


@pytest.fixture(scope="module", autouse=True)
def _torch_one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def data(shape, dt, seed):
    """Random values exactly representable in dt: (array in dt, the same values in float64)."""
    a = np.random.default_rng(seed).standard_normal(shape).astype(dt.np)
    return a, a.astype(np.float64)


def check(got, ref64, same, dt, f32_rtol=2e-5):
    """float64 / float32 relative to the largest reference magnitude; 16-bit by the flash rule
    against torch run in that dtype."""
    assert_close_dtype(np.asarray(got, np.float64), ref64,
                       None if same is None else np.asarray(same, np.float64), dt.name,
                       f32_rtol=f32_rtol, f64_rtol=1e-11, slack=SLACK.get(dt.name, 1e-6))


# (x shape, weight shape, bias?, stride, padding, dilation, groups)
CONV2D = [
    ((2, 4, 7, 6), (6, 4, 3, 3), True, 1, 1, 1, 1),
    ((1, 6, 9, 8), (4, 3, 3, 2), True, (2, 1), (1, 0), (1, 2), 2),     # asymmetric everything
    ((2, 3, 5, 5), (3, 1, 3, 3), False, 1, "same", 1, 3),              # depthwise
    ((1, 2, 6, 7), (4, 2, 4, 2), True, 1, "same", (1, 2), 1),          # even kernel "same"
    ((3, 4, 5, 5), (8, 2, 1, 1), True, 1, 0, 1, 2),                    # 1x1 grouped
    ((1, 3, 7, 8), (6, 1, 3, 3), True, 2, 1, 1, 3),                    # channel multiplier 2
    ((2, 2, 4, 3), (3, 2, 2, 3), False, (1, 3), "valid", 1, 1),
]
IDS = [f"conv{i}" for i in range(len(CONV2D))]


def _conv_args(case, dt, seed=0):
    xs, ws, has_b, stride, padding, dil, g = case
    x, x64 = data(xs, dt, seed)
    w, w64 = data(ws, dt, seed + 1)
    b, b64 = data((ws[0],), dt, seed + 2) if has_b else (None, None)
    return (x, w, b), (x64, w64, b64), (stride, padding, dil, g)


def _t(a, dtype=None, grad=False):
    if a is None:
        return None
    t = torch.tensor(a.astype(np.float32) if a.dtype.name == "bfloat16" else a)
    t = t.to(dtype) if dtype is not None else t
    return t.requires_grad_(grad)


def _fg(a, grad=False):
    return None if a is None else fg.tensor(a, requires_grad=grad)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONV2D, ids=IDS)
def test_conv2d_forward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), (s, p, d, g) = _conv_args(case, dt)
    y = F.conv2d(_fg(x), _fg(w), _fg(b), s, p, d, g)
    ref = TF.conv2d(_t(x64), _t(w64), _t(b64), s, p, d, g)
    assert y.shape == tuple(ref.shape) and y.dtype == dt
    same = None
    if dt.itemsize == 2:
        tt = dt.torch
        same = TF.conv2d(_t(x, tt), _t(w, tt), _t(b, tt), s, p, d, g).double().numpy()
    check(y.numpy(), ref.numpy(), same, dt)
    # the recipe agrees with the kernel
    check(fg.realize([y], lower_all=True)[0], ref.numpy(), same, dt, f32_rtol=5e-5)


def _grads_vs_torch(ours, ref, arrays, arrays64, dt, seed=9):
    """Gradients of sum(out * G) for every input, ours vs torch autograd."""
    ts = [_t(a, grad=True) for a in arrays64]
    out_t = ref(*ts)
    gr, gr64 = data(tuple(out_t.shape), dt, seed)
    out_t.backward(torch.tensor(gr64))
    xs = [_fg(a, grad=True) for a in arrays]
    out = ours(*xs)
    (out * fg.tensor(gr)).sum().backward()
    same = [None] * len(xs)
    if dt.itemsize == 2:
        tl = [_t(a, dt.torch, grad=True) for a in arrays]
        ref(*tl).backward(_t(gr, dt.torch))
        same = [t.grad.double().numpy() for t in tl]
    for x, t, sm in zip(xs, ts, same):
        assert x.grad.dtype == dt and x.grad.shape == tuple(t.shape)
        check(x.grad.numpy(), t.grad.numpy(), sm, dt, f32_rtol=5e-5)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONV2D, ids=IDS)
def test_conv2d_backward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), (s, p, d, g) = _conv_args(case, dt, seed=3)
    arrays = [a for a in (x, w, b) if a is not None]
    arrays64 = [a for a in (x64, w64, b64) if a is not None]
    _grads_vs_torch(lambda *t: F.conv2d(*t[:2], t[2] if len(t) > 2 else None, s, p, d, g),
                    lambda *t: TF.conv2d(*t[:2], t[2] if len(t) > 2 else None, s, p, d, g),
                    arrays, arrays64, dt)


# (x shape, weight shape, bias?, stride, padding, output_padding, dilation, groups)
CONVT = [
    ((2, 4, 5, 4), (4, 3, 3, 3), True, 1, 0, 0, 1, 1),
    ((1, 6, 4, 5), (6, 2, 3, 2), True, (2, 3), (1, 0), (1, 2), (2, 1), 2),
    ((2, 4, 3, 3), (4, 1, 4, 4), False, 2, 1, 0, 1, 4),                # depthwise, 4x4 s2
    ((1, 2, 2, 2), (2, 1, 1, 1), True, 4, 1, 0, 1, 1),                 # no tap inside: bias only
    ((1, 3, 3, 2), (3, 2, 2, 3), True, (1, 2), (0, 1), (0, 1), (3, 1), 1),  # op >= stride
]
TIDS = [f"convT{i}" for i in range(len(CONVT))]


def _convt_args(case, dt, seed=0):
    xs, ws, has_b, s, p, op, d, g = case
    x, x64 = data(xs, dt, seed)
    w, w64 = data(ws, dt, seed + 1)
    b, b64 = data((ws[1] * g,), dt, seed + 2) if has_b else (None, None)
    return (x, w, b), (x64, w64, b64), (s, p, op, d, g)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONVT, ids=TIDS)
def test_conv_transpose2d_forward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), (s, p, op, d, g) = _convt_args(case, dt)
    y = F.conv_transpose2d(_fg(x), _fg(w), _fg(b), s, p, op, d, g)
    ref = TF.conv_transpose2d(_t(x64), _t(w64), _t(b64), s, p, op, g, d)
    assert y.shape == tuple(ref.shape) and y.dtype == dt
    same = None
    if dt.itemsize == 2:
        tt = dt.torch
        same = TF.conv_transpose2d(_t(x, tt), _t(w, tt), _t(b, tt), s, p, op, g, d)
        same = same.double().numpy()
    check(y.numpy(), ref.numpy(), same, dt)
    check(fg.realize([y], lower_all=True)[0], ref.numpy(), same, dt, f32_rtol=5e-5)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CONVT, ids=TIDS)
def test_conv_transpose2d_backward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), (s, p, op, d, g) = _convt_args(case, dt, seed=4)
    arrays = [a for a in (x, w, b) if a is not None]
    arrays64 = [a for a in (x64, w64, b64) if a is not None]
    _grads_vs_torch(
        lambda *t: F.conv_transpose2d(*t[:2], t[2] if len(t) > 2 else None, s, p, op, d, g),
        lambda *t: TF.conv_transpose2d(*t[:2], t[2] if len(t) > 2 else None, s, p, op, g, d),
        arrays, arrays64, dt)


def test_backward_emits_the_fused_ops():
    x = fg.tensor(np.random.default_rng(0).standard_normal((2, 4, 6, 6)))
    w = fg.tensor(np.random.default_rng(1).standard_normal((4, 2, 3, 3)))
    gx, gw = fg.grad(F.conv2d(x, w, None, 2, 1, 1, 2).sum(), [x, w])
    assert fg.explain([gx, gw]).fused_ops == {"conv_transpose2d": 1, "conv2d_backward_weight": 1}
    wt = fg.tensor(np.random.default_rng(2).standard_normal((4, 3, 3, 3)))
    gx, gw = fg.grad(F.conv_transpose2d(x, wt, None, 2, 1).sum(), [x, wt])
    assert fg.explain([gx, gw]).fused_ops == {"conv2d": 1, "conv2d_backward_weight": 1}
    xc = fg.tensor(np.random.default_rng(3).standard_normal((2, 3, 7)))
    wc = fg.tensor(np.random.default_rng(4).standard_normal((3, 4)))
    assert fg.explain(fg.grad(F.causal_conv1d(xc, wc, None, True).sum(), [xc, wc])).fused_ops \
        == {"causal_conv1d_backward": 1}
    reg = fg.default_registry()
    assert reg.entry(FusedOps.CONV2D).backward == BackwardKind.fused(FusedOps.CONV_TRANSPOSE2D)
    assert reg.entry(FusedOps.CONV_TRANSPOSE2D).backward == BackwardKind.fused(FusedOps.CONV2D)
    assert reg.entry(FusedOps.CAUSAL_CONV1D).backward == BackwardKind.fused(CAUSAL_CONV1D_BACKWARD)


@pytest.mark.parametrize("kind", ["conv2d", "conv_transpose2d"])
def test_second_order_vs_torch(kind):
    rng = np.random.default_rng(5)
    if kind == "conv2d":
        x, w = rng.standard_normal((2, 4, 6, 5)), rng.standard_normal((6, 2, 3, 2))
        ours = lambda a, b: F.conv2d(a, b, None, (2, 1), (1, 0), (1, 2), 2)   # noqa: E731
        ref = lambda a, b: TF.conv2d(a, b, None, (2, 1), (1, 0), (1, 2), 2)   # noqa: E731
    else:
        x, w = rng.standard_normal((2, 4, 4, 3)), rng.standard_normal((4, 3, 3, 2))
        ours = lambda a, b: F.conv_transpose2d(a, b, None, 2, 1, 1, 1, 2)   # noqa: E731
        ref = lambda a, b: TF.conv_transpose2d(a, b, None, 2, 1, 1, 2, 1)   # noqa: E731
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    out = ref(xt, wt)
    gout = rng.standard_normal(tuple(out.shape))
    v1, v2 = rng.standard_normal(x.shape), rng.standard_normal(w.shape)
    tgx, tgw = torch.autograd.grad((out * torch.tensor(gout)).sum(), (xt, wt), create_graph=True)
    tgg = torch.autograd.grad((tgx * torch.tensor(v1)).sum() + (tgw * torch.tensor(v2)).sum(),
                              (xt, wt))
    xf, wf = fg.tensor(x), fg.tensor(w)
    gx, gw = fg.grad((ours(xf, wf) * fg.tensor(gout)).sum(), [xf, wf])
    ggx, ggw = fg.grad((gx * fg.tensor(v1)).sum() + (gw * fg.tensor(v2)).sum(), [xf, wf])
    assert set(fg.explain([ggx, ggw]).fused_ops) <= {"conv2d", "conv_transpose2d",
                                                       "conv2d_backward_weight"}
    for got, want in ((gx, tgx), (gw, tgw), (ggx, tgg[0]), (ggw, tgg[1])):
        np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(fg.realize([ggw], lower_all=True)[0], tgg[1].numpy(),
                               rtol=1e-10, atol=1e-11)


def test_conv2d_backward_weight_helper_vs_torch():
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((2, 4, 7, 6)), rng.standard_normal((2, 6, 4, 2))
    dw = F.conv2d_backward_weight(fg.tensor(x), fg.tensor(g), (3, 2), (2, 3), (1, 0), (1, 2), 2)
    want = torch.nn.grad.conv2d_weight(torch.tensor(x), (6, 2, 3, 2), torch.tensor(g), (2, 3),
                                       (1, 0), (1, 2), 2)
    np.testing.assert_allclose(dw.numpy(), want.numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(fg.realize([dw], lower_all=True)[0], want.numpy(), rtol=1e-11,
                               atol=1e-11)
    assert fg.default_registry().entry(CONV2D_BACKWARD_WEIGHT).name == "conv2d_backward_weight"


# ---- causal conv1d -------------------------------------------------------------------------------
# (x shape, W, weight as [C, 1, W]?, bias?, silu)
CAUSAL = [
    ((2, 3, 9), 4, False, True, False),
    ((2, 3, 9), 4, True, True, True),
    ((1, 2, 2), 4, False, True, True),          # L < W
    ((2, 5, 6), 1, False, False, True),         # W = 1
    ((3, 4, 17), 3, True, False, False),
    ((1, 8, 33), 2, False, True, True),
]
CIDS = [f"causal{i}" for i in range(len(CAUSAL))]


def _causal_ref(x, w, b, silu):
    k = w.shape[-1]
    y = TF.conv1d(TF.pad(x, (k - 1, 0)), w.reshape(w.shape[0], 1, k), b, groups=x.shape[1])
    return TF.silu(y) if silu else y


def _causal_args(case, dt, seed=0):
    xs, k, three_d, has_b, silu = case
    x, x64 = data(xs, dt, seed)
    w, w64 = data((xs[1], 1, k) if three_d else (xs[1], k), dt, seed + 1)
    b, b64 = data((xs[1],), dt, seed + 2) if has_b else (None, None)
    return (x, w, b), (x64, w64, b64), silu


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CAUSAL, ids=CIDS)
def test_causal_conv1d_forward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), silu = _causal_args(case, dt)
    y = F.causal_conv1d(_fg(x), _fg(w), _fg(b), silu)
    ref = _causal_ref(_t(x64), _t(w64), _t(b64), silu).numpy()
    assert y.shape == x.shape and y.dtype == dt
    same = None
    if dt.itemsize == 2:
        tt = dt.torch
        same = _causal_ref(_t(x, tt), _t(w, tt), _t(b, tt), silu).double().numpy()
    check(y.numpy(), ref, same, dt)
    check(fg.realize([y], lower_all=True)[0], ref, same, dt)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case", CAUSAL, ids=CIDS)
def test_causal_conv1d_backward_vs_torch(case, dt):
    (x, w, b), (x64, w64, b64), silu = _causal_args(case, dt, seed=7)
    arrays = [a for a in (x, w, b) if a is not None]
    arrays64 = [a for a in (x64, w64, b64) if a is not None]
    _grads_vs_torch(lambda *t: F.causal_conv1d(*t[:2], t[2] if len(t) > 2 else None, silu),
                    lambda *t: _causal_ref(*t[:2], t[2] if len(t) > 2 else None, silu),
                    arrays, arrays64, dt)


def test_causal_conv1d_backward_helper_and_second_order():
    rng = np.random.default_rng(8)
    x, w, b, g = (rng.standard_normal(s) for s in ((2, 3, 8), (3, 4), (3,), (2, 3, 8)))
    dx, dw, db = F.causal_conv1d_backward(fg.tensor(x), fg.tensor(w), fg.tensor(g),
                                          fg.tensor(b), True)
    ts = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    out = _causal_ref(*ts, True)
    want = torch.autograd.grad(out, ts, torch.tensor(g), create_graph=True)
    for got, t in zip((dx, dw, db), want):
        np.testing.assert_allclose(got.numpy(), t.detach().numpy(), rtol=1e-11, atol=1e-12)
    # second order goes through the helper's recipe
    v = rng.standard_normal(x.shape)
    xf, wf, bf = fg.tensor(x), fg.tensor(w), fg.tensor(b)
    gx, = fg.grad((F.causal_conv1d(xf, wf, bf, True) * fg.tensor(g)).sum(), [xf])
    ggw, = fg.grad((gx * fg.tensor(v)).sum(), [wf])
    tgg = torch.autograd.grad((want[0] * torch.tensor(v)).sum(), ts[1])[0]
    np.testing.assert_allclose(ggw.numpy(), tgg.numpy(), rtol=1e-10, atol=1e-11)


# ---- build-time validation ------------------------------------------------------------------
def _z(*shape, dtype=np.float32):
    return fg.tensor(np.zeros(shape, dtype))


X4, W4 = _z(1, 4, 6, 6), _z(4, 2, 3, 3)
CONV2D_ERRORS = [
    (lambda: F.conv2d(_z(4, 6, 6), W4), r"conv2d: x .*rank 4"),
    (lambda: F.conv2d(X4, _z(4, 2, 3)), r"conv2d: weight must be a rank-4"),
    (lambda: F.conv2d(X4, W4), r"conv2d: weight .*dim 1 is Cin/groups"),
    (lambda: F.conv2d(X4, _z(3, 2, 3, 3), groups=2), r"conv2d: groups 2 must divide .*Cout 3"),
    (lambda: F.conv2d(_z(1, 3, 6, 6), _z(4, 1, 3, 3), groups=2),
     r"conv2d: groups 2 must divide Cin"),
    (lambda: F.conv2d(X4, W4, _z(3), groups=2), r"conv2d: bias has shape \(3,\)"),
    (lambda: F.conv2d(X4, W4, stride=0, groups=2), r"conv2d: stride .*positive"),
    (lambda: F.conv2d(X4, W4, stride=(1, -2), groups=2), r"conv2d: stride .*positive"),
    (lambda: F.conv2d(X4, W4, dilation=0, groups=2), r"conv2d: dilation .*positive"),
    (lambda: F.conv2d(X4, W4, padding=-1, groups=2), r"conv2d: padding .*non-negative"),
    (lambda: F.conv2d(X4, W4, dilation=3, groups=2), r"conv2d: weight: the dilated kernel"),
    (lambda: F.conv2d(_z(1, 4, 2, 6), W4, groups=2), r"conv2d: weight: the dilated kernel height"),
    (lambda: F.conv2d(X4, W4, stride=2, padding="same", groups=2), r"conv2d: padding='same' "),
    (lambda: F.conv2d(X4, W4, padding="full", groups=2), r"conv2d: padding must be"),
    (lambda: F.conv2d(X4, W4, stride=(1, 2, 3), groups=2),
     r"conv2d: stride must be an int or a pair"),
    (lambda: F.conv2d(X4, _z(4, 2, 3, 3, dtype=np.float64), groups=2),
     r"conv2d: weight has dtype float64"),
    (lambda: F.conv2d(fg.tensor(np.zeros((1, 4, 6, 6), np.int32)), W4, groups=2),
     r"conv2d: x has dtype int32"),
    (lambda: F.conv2d(X4, W4, groups=0), r"conv2d: groups must be a positive int"),
    (lambda: F.conv2d(X4, W4, groups=2.0), r"conv2d: groups must be a positive int"),
    (lambda: F.conv2d(_z(1, 4, 0, 6), W4, groups=2), r"conv2d: x .*H, W >= 1"),
]
CONVT_ERRORS = [
    (lambda: F.conv_transpose2d(X4, _z(3, 2, 3, 3)), r"conv_transpose2d: weight .*dim 0 is Cin"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), groups=3),
     r"conv_transpose2d: groups 3 must divide Cin"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), stride=2, output_padding=2),
     r"conv_transpose2d: output_padding \(2, 2\) must be smaller"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), output_padding=(0, -1)),
     r"conv_transpose2d: output_padding .*non-negative"),
    (lambda: F.conv_transpose2d(_z(1, 4, 1, 1), _z(4, 2, 1, 1), padding=1),
     r"conv_transpose2d: padding .*empty output"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), _z(2), groups=2),
     r"conv_transpose2d: bias has shape \(2,\)"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), stride=0),
     r"conv_transpose2d: stride .*positive"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), padding=-1),
     r"conv_transpose2d: padding .*non-negative"),
    (lambda: F.conv_transpose2d(X4, _z(4, 2, 3, 3), dilation=(1, 0)),
     r"conv_transpose2d: dilation .*positive"),
]
CAUSAL_ERRORS = [
    (lambda: F.causal_conv1d(_z(3, 8), _z(3, 4)), r"causal_conv1d: x .*rank 3"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(4, 4)), r"causal_conv1d: weight has shape \(4, 4\)"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(3, 2, 4)),
     r"causal_conv1d: weight has shape \(3, 2, 4\)"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(3, 0)), r"causal_conv1d: weight .*W >= 1"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(3, 4), _z(4)),
     r"causal_conv1d: bias has shape \(4,\)"),
    (lambda: F.causal_conv1d(_z(2, 3, 0), _z(3, 4)), r"causal_conv1d: x .*L >= 1"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(3, 4), None, "yes"),
     r"causal_conv1d: use_silu must be a bool"),
    (lambda: F.causal_conv1d(_z(2, 3, 8), _z(3, 4, dtype=np.float16)),
     r"causal_conv1d: weight has dtype float16"),
]


@pytest.mark.parametrize("build,match", CONV2D_ERRORS + CONVT_ERRORS + CAUSAL_ERRORS)
def test_validation_errors_at_build_time(build, match):
    with pytest.raises(FuelGraphError, match=match):
        build()


def test_helper_validation_errors():
    with pytest.raises(FuelGraphError, match=r"conv2d_backward_weight: grad height 6 needs"):
        F.conv2d_backward_weight(_z(1, 4, 6, 6), _z(1, 4, 6, 4), 3)
    with pytest.raises(FuelGraphError, match=r"conv2d_backward_weight: grad has shape"):
        F.conv2d_backward_weight(_z(1, 4, 6, 6), _z(2, 4, 4, 4), 3)
    with pytest.raises(FuelGraphError, match=r"causal_conv1d_backward: grad has shape"):
        F.causal_conv1d_backward(_z(2, 3, 8), _z(3, 4), _z(2, 3, 7))


def test_same_padding_is_stored_per_side_like_torch():
    x, w = _z(1, 2, 6, 7), _z(3, 2, 4, 3)
    y = F.conv2d(x, w, None, 1, "same", (1, 2))
    assert y.shape == (1, 3, 6, 7)
    assert y.node.op.params.padding == (1, 2, 2, 2)     # odd total: the extra row at the bottom
    assert F.conv2d(x, w, None, 1, "valid").shape == (1, 3, 3, 5)


def test_empty_batch():
    """N = 0 (B = 0) is accepted, as in torch: empty outputs, zero weight/bias gradients."""
    x, w, b = _z(0, 4, 5, 5), fg.tensor(np.ones((6, 4, 3, 3))), fg.tensor(np.ones(6))
    x = x.astype(fg.float64)
    y = F.conv2d(x, w, b, 1, 1)
    assert y.numpy().shape == (0, 6, 5, 5) == fg.realize([y], lower_all=True)[0].shape
    gx, gw, gb = fg.grad(y.sum(), [x, w, b])
    assert gx.numpy().shape == x.shape and not gw.numpy().any() and not gb.numpy().any()
    t = F.conv_transpose2d(x, fg.tensor(np.ones((4, 3, 3, 3))), None, 2, 1)
    assert t.numpy().shape == (0, 3, 9, 9)
    xc, wc = _z(0, 3, 7), _z(3, 4)
    yc = F.causal_conv1d(xc, wc, None, True)
    assert yc.numpy().shape == (0, 3, 7)
    assert not fg.grad(yc.sum(), [wc])[0].numpy().any()
