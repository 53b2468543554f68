"""fg.scan: forward vs Python loops, gradients vs torch autograd of the same loop, errors."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph import FuelGraphError

RNG = np.random.default_rng(0)


def rnd(*shape):
    return RNG.standard_normal(shape)


def T(a, dtype=fg.float64, **kw):
    return fg.tensor(np.asarray(a), dtype=dtype, **kw)


def tt(a):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)


def close(got, want, tol=1e-10):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


# ---- forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(fg.float32, 1e-5), (fg.float64, 1e-12)])
def test_cumsum(dtype, tol):
    x = rnd(6, 3)
    (c,), (ys,) = fg.scan(lambda c, xt, k: ([c[0] + xt[0]], [c[0] + xt[0]]),
                          [fg.zeros((3,), dtype)], [T(x, dtype)])
    assert ys.shape == (6, 3) and ys.dtype == dtype and c.dtype == dtype
    close(ys.numpy(), np.cumsum(x, 0), tol)
    close(c.numpy(), x.sum(0), tol)


def _linrec_np(h, x, a, b, c, reverse=False):
    ys = np.zeros(x.shape)
    for t in (range(len(x) - 1, -1, -1) if reverse else range(len(x))):
        h = a * h + b * x[t]
        ys[t] = c * h
    return h, ys


def _linrec_fn(cs, xt, k):
    a, b, c = k
    h = a * cs[0] + b * xt[0]
    return [h], [c * h]


@pytest.mark.parametrize("dtype,tol", [(fg.float32, 1e-5), (fg.float64, 1e-12)])
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence(dtype, tol, reverse):
    h0, x, a, b, c = rnd(4), rnd(7, 4), rnd(4) * 0.5, rnd(4), rnd(4)
    (h,), (ys,) = fg.scan(_linrec_fn, [T(h0, dtype)], [T(x, dtype)],
                          [T(a, dtype), T(b, dtype), T(c, dtype)], reverse=reverse)
    hw, yw = _linrec_np(h0, x, a, b, c, reverse)
    close(h.numpy(), hw, tol)
    close(ys.numpy(), yw, tol)


def _two_carry_fn(cs, xt, k):
    h, s = cs
    (w,) = k
    h2 = (h @ w + xt[0]).tanh()
    s2 = s + (h2 * h2).sum()
    return [h2, s2], [h2.exp(), s2 * 2.0]


def _two_carry_np(h, s, x, w):
    y1, y2 = [], []
    for t in range(len(x)):
        h = np.tanh(h @ w + x[t])
        s = s + (h * h).sum()
        y1.append(np.exp(h))
        y2.append(2 * s)
    return h, s, np.stack(y1), np.stack(y2)


def test_two_carries_and_two_ys():
    h0, s0, x, w = rnd(3), np.float64(0.3), rnd(5, 3), rnd(3, 3) * 0.5
    (h, s), (y1, y2) = fg.scan(_two_carry_fn, [T(h0), T(s0)], [T(x)], [T(w)])
    for got, want in zip((h, s, y1, y2), _two_carry_np(h0, s0, x, w)):
        close(got.numpy(), want)
    assert y2.shape == (5,)


def test_length_without_xs():
    m = rnd(3, 3) * 0.4
    (v,), (ys,) = fg.scan(lambda c, x, k: ([k[0] @ c[0]], [c[0].sum()]), [T(np.ones(3))],
                          consts=[T(m)], length=4)
    v_np, ys_np = np.ones(3), []
    for _ in range(4):
        ys_np.append(v_np.sum())
        v_np = m @ v_np
    close(v.numpy(), v_np)
    close(ys.numpy(), ys_np)


def test_length_one_and_zero():
    x = rnd(1, 2)
    (c,), (ys,) = fg.scan(lambda c, xt, k: ([c[0] * xt[0]], [c[0] + 1.0]), [T([2.0, 3.0])], [T(x)])
    close(c.numpy(), np.array([2.0, 3.0]) * x[0])
    close(ys.numpy(), [[3.0, 4.0]])
    (c,), (ys,) = fg.scan(lambda c, xt, k: ([c[0] * 2.0], [c[0]]), [T([2.0, 3.0])], length=0)
    close(c.numpy(), [2.0, 3.0])
    assert ys.shape == (0, 2)


def test_no_carries_is_a_map_and_int_carry():
    x = rnd(4, 3)
    fin, (ys,) = fg.scan(lambda c, xt, k: ([], [xt[0] * k[0]]), [], [T(x)], [T(2.0)])
    assert fin == []
    close(ys.numpy(), 2 * x)
    # an integer step counter as a carry next to a float one
    (n, acc), (ys,) = fg.scan(
        lambda c, xt, k: ([c[0] + 1, c[1] + c[0].astype(fg.float64) * xt[0]], [c[0]]),
        [fg.tensor(np.int64(0), dtype=fg.int64), T(np.zeros(3))], [T(x)])
    assert n.item() == 4 and ys.dtype == fg.int64
    close(acc.numpy(), (np.arange(4)[:, None] * x).sum(0))


def test_nested_scan_forward():
    x = rnd(3, 4)

    def outer(c, xt, k):
        (s,), _ = fg.scan(lambda ci, xi, ki: ([ci[0] + xi[0] * ki[0]], []),
                          [fg.zeros((), fg.float64)], [xt[0]], [c[0]])
        return [c[0] + s], [s]

    (c,), (ys,) = fg.scan(outer, [T(1.0)], [T(x)])
    c_np, ys_np = 1.0, []
    for t in range(3):
        s = (x[t] * c_np).sum()
        c_np += s
        ys_np.append(s)
    close(c.numpy(), c_np)
    close(ys.numpy(), ys_np)


# ---- gradients vs torch -------------------------------------------------------------------
def _torch_linrec(h, x, a, b, c, reverse=False):
    ys = [None] * len(x)
    for t in (range(len(x) - 1, -1, -1) if reverse else range(len(x))):
        h = a * h + b * x[t]
        ys[t] = c * h
    return h, torch.stack(ys)


@pytest.mark.parametrize("reverse", [False, True])
def test_grad_linear_recurrence(reverse):
    vals = [rnd(4), rnd(6, 4), rnd(4) * 0.7, rnd(4), rnd(4)]
    wy, wh = rnd(6, 4), rnd(4)
    ins = [T(v) for v in vals]
    (h,), (ys,) = fg.scan(_linrec_fn, ins[:1], ins[1:2], ins[2:], reverse=reverse)
    loss = (ys * T(wy)).sum() + (h * h * T(wh)).sum()
    got = fg.grad(loss, ins)
    tv = [tt(v) for v in vals]
    th, tys = _torch_linrec(*tv, reverse=reverse)
    tl = (tys * torch.tensor(wy)).sum() + (th * th * torch.tensor(wh)).sum()
    want = torch.autograd.grad(tl, tv)
    close(loss.numpy(), tl.item())
    for g, w in zip(got, want):
        close(g.numpy(), w.numpy())


def test_grad_two_carries():
    h0, s0, x, w = rnd(3), rnd(), rnd(5, 3), rnd(3, 3) * 0.5
    ins = [T(h0), T(s0), T(x), T(w)]
    (h, s), (y1, y2) = fg.scan(_two_carry_fn, ins[:2], ins[2:3], ins[3:])
    wy = rnd(5, 3)
    loss = (y1 * T(wy)).sum() + y2.sum() * 0.1 + (h * h).sum() + s * 3.0
    got = fg.grad(loss, ins)

    tv = [tt(v) for v in (h0, s0, x, w)]
    th, ts, tx, tw = tv
    y1l, y2l = [], []
    for t in range(5):
        th = torch.tanh(th @ tw + tx[t])
        ts = ts + (th * th).sum()
        y1l.append(torch.exp(th))
        y2l.append(ts * 2.0)
    tl = (torch.stack(y1l) * torch.tensor(wy)).sum() + torch.stack(y2l).sum() * 0.1 \
        + (th * th).sum() + ts * 3.0
    want = torch.autograd.grad(tl, tv)
    close(loss.numpy(), tl.item())
    for g, w_ in zip(got, want):
        close(g.numpy(), w_.numpy())


def test_grad_missing_cotangents():
    vals = [rnd(4), rnd(5, 4), rnd(4) * 0.7, rnd(4), rnd(4)]
    ins = [T(v) for v in vals]
    (h,), (ys,) = fg.scan(_linrec_fn, ins[:1], ins[1:2], ins[2:])
    tv = [tt(v) for v in vals]
    th, tys = _torch_linrec(*tv)
    # only the ys are used
    for g, w in zip(fg.grad(ys.sum(), ins), torch.autograd.grad(tys.sum(), tv, retain_graph=True)):
        close(g.numpy(), w.numpy())
    # only the final carry is used (c gets a zero gradient)
    got = fg.grad((h * h).sum(), ins)
    want = torch.autograd.grad((th * th).sum(), tv, allow_unused=True)
    for g, w in zip(got, want):
        close(g.numpy(), np.zeros(g.shape) if w is None else w.numpy())


def test_grad_length_without_xs_and_backward():
    v0, m = rnd(3), rnd(3, 3) * 0.4
    tv0 = T(v0, requires_grad=True)
    tm = T(m, requires_grad=True)
    (v,), (ys,) = fg.scan(lambda c, x, k: ([(k[0] @ c[0]).sin()], [c[0].sum()]), [tv0],
                          consts=[tm], length=4, reverse=True)
    (v.sum() + (ys * ys).sum()).backward()
    a, b = tt(v0), tt(m)
    cur, yl = a, []
    for _ in range(4):
        yl.append(cur.sum())
        cur = torch.sin(b @ cur)
    (cur.sum() + (torch.stack(yl) ** 2).sum()).backward()
    close(tv0.grad.numpy(), a.grad.numpy())
    close(tm.grad.numpy(), b.grad.numpy())


def test_grad_length_one():
    vals = [rnd(2), rnd(1, 2), rnd(2), rnd(2), rnd(2)]
    ins = [T(v) for v in vals]
    (h,), (ys,) = fg.scan(_linrec_fn, ins[:1], ins[1:2], ins[2:])
    tv = [tt(v) for v in vals]
    th, tys = _torch_linrec(*tv)
    for g, w in zip(fg.grad((ys * ys).sum() + h.sum(), ins),
                    torch.autograd.grad((tys * tys).sum() + th.sum(), tv)):
        close(g.numpy(), w.numpy())


def test_grad_float32():
    vals = [rnd(4), rnd(6, 4), rnd(4) * 0.7, rnd(4), rnd(4)]
    ins = [T(v, fg.float32) for v in vals]
    (h,), (ys,) = fg.scan(_linrec_fn, ins[:1], ins[1:2], ins[2:])
    got = fg.grad(ys.sum() + h.sum(), ins)
    assert all(g.dtype == fg.float32 for g in got)
    tv = [tt(np.asarray(v, np.float32)) for v in vals]
    th, tys = _torch_linrec(*tv)
    for g, w in zip(got, torch.autograd.grad(tys.sum() + th.sum(), tv)):
        close(g.numpy(), w.numpy(), 1e-5)


def test_grad_with_int_carry_and_int_xs():
    x, idx, w = rnd(4, 3), np.array([2, 0, 1, 2]), rnd(3)
    ins = [T(np.zeros(3)), T(x), T(w)]

    def fn(c, xt, k):
        n, acc = c
        x_t, i_t = xt
        picked = k[0].take(i_t.reshape(1), 0).broadcast_to((3,))
        acc2 = acc * 0.5 + n.astype(fg.float64) * x_t * picked
        return [n + 1, acc2], [acc2.sum()]

    (n, acc), (ys,) = fg.scan(fn, [fg.tensor(np.int64(1), dtype=fg.int64), ins[0]],
                              [ins[1], fg.tensor(idx, dtype=fg.int64)], [ins[2]])
    loss = (acc * acc).sum() + ys.sum()
    got = fg.grad(loss, ins)
    ta, tx, tw = [tt(v) for v in (np.zeros(3), x, w)]
    acc_t, yl = ta, []
    for t in range(4):
        acc_t = acc_t * 0.5 + (t + 1) * tx[t] * tw[idx[t]]
        yl.append(acc_t.sum())
    tl = (acc_t * acc_t).sum() + torch.stack(yl).sum()
    close(loss.numpy(), tl.item())
    for g, w_ in zip(got, torch.autograd.grad(tl, [ta, tx, tw])):
        close(g.numpy(), w_.numpy())


def test_grad_nested_scan():
    x0, c0 = rnd(3, 4), 0.3
    ins = [T(c0), T(x0)]

    def outer(c, xt, k):
        (s,), _ = fg.scan(lambda ci, xi, ki: ([ci[0] * 0.5 + (xi[0] * ki[0]).sin()], []),
                          [fg.zeros((), fg.float64)], [xt[0]], [c[0]])
        return [c[0] + s], [s * s]

    (c,), (ys,) = fg.scan(outer, ins[:1], ins[1:])
    got = fg.grad(c + ys.sum(), ins)
    tc, tx = tt(c0), tt(x0)
    cur, yl = tc, []
    for t in range(3):
        s = torch.zeros((), dtype=torch.float64)
        for i in range(4):
            s = s * 0.5 + torch.sin(tx[t, i] * cur)
        cur = cur + s
        yl.append(s * s)
    want = torch.autograd.grad(cur + torch.stack(yl).sum(), [tc, tx])
    for g, w in zip(got, want):
        close(g.numpy(), w.numpy())


def test_second_order():
    h0, x, a = rnd(2), rnd(4, 2), rnd(2) * 0.6
    ins = [T(h0), T(x), T(a)]

    def fn(c, xt, k):
        h = (k[0] * c[0] + xt[0]).tanh()
        return [h], [h * h]

    (h,), (ys,) = fg.scan(fn, ins[:1], ins[1:2], ins[2:])
    g1 = fg.grad(ys.sum() + (h * h * h).sum(), ins)
    g2 = fg.grad((g1[0] * g1[0]).sum() + g1[2].sum() + (g1[1] * T(x)).sum(), ins)

    tv = [tt(v) for v in (h0, x, a)]
    th, yl = tv[0], []
    for t in range(4):
        th = torch.tanh(tv[2] * th + tv[1][t])
        yl.append(th * th)
    tl = torch.stack(yl).sum() + (th ** 3).sum()
    t1 = torch.autograd.grad(tl, tv, create_graph=True)
    t2 = torch.autograd.grad((t1[0] * t1[0]).sum() + t1[2].sum() + (t1[1] * torch.tensor(x)).sum(),
                             tv)
    for g, w in zip(g1, t1):
        close(g.numpy(), w.detach().numpy())
    for g, w in zip(g2, t2):
        close(g.numpy(), w.numpy(), 1e-9)


# ---- errors -------------------------------------------------------------------------------
def test_error_carry_shape_change():
    with pytest.raises(FuelGraphError, match=r"scan: carry 0 changes from \(3,\)"):
        fg.scan(lambda c, xt, k: ([c[0].sum()], []), [T(np.ones(3))], [T(rnd(2, 3))])


def test_error_carry_dtype_change():
    with pytest.raises(FuelGraphError, match="scan: carry 0 .*float32"):
        fg.scan(lambda c, xt, k: ([c[0].astype(fg.float32)], []), [T(np.ones(3))], length=2)


def test_error_closure_over_outside_tensor():
    w = T(rnd(3))
    with pytest.raises(FuelGraphError, match="scan: the body reads a tensor from outside"):
        fg.scan(lambda c, xt, k: ([c[0] * w], []), [T(np.ones(3))], [T(rnd(2, 3))])
    # passing it as a const is fine
    (c,), _ = fg.scan(lambda c, xt, k: ([c[0] * k[0]], []), [T(np.ones(3))], length=2, consts=[w])
    close(c.numpy(), w.numpy() ** 2)


def test_error_mismatched_xs_lengths():
    with pytest.raises(FuelGraphError, match="scan: xs\\[1\\] has length 4"):
        fg.scan(lambda c, xt, k: ([c[0] + xt[0] + xt[1]], []), [T(0.0)], [T(rnd(3)), T(rnd(4))])
    with pytest.raises(FuelGraphError, match="scan: length=5 but xs have length 3"):
        fg.scan(lambda c, xt, k: ([c[0] + xt[0]], []), [T(0.0)], [T(rnd(3))], length=5)
    with pytest.raises(FuelGraphError, match="scan: pass length="):
        fg.scan(lambda c, xt, k: ([c[0]], []), [T(0.0)])


def test_error_bad_fn_results():
    with pytest.raises(FuelGraphError, match="scan: fn returned 2 carries, expected 1"):
        fg.scan(lambda c, xt, k: ([c[0], c[0]], []), [T(0.0)], length=2)
    with pytest.raises(FuelGraphError, match="scan: fn must return a pair"):
        fg.scan(lambda c, xt, k: c[0], [T(0.0)], length=2)
    with pytest.raises(FuelGraphError, match="expected a Tensor"):
        fg.scan(lambda c, xt, k: ([1.0], []), [T(0.0)], length=2)
