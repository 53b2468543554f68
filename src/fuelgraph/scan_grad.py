"""Reverse mode through a Scan node.

For a scan with body f(c, x_t, k) -> (c', y_t) over t (in the scan's own order):
  (a) the carries entering each step are recomputed by a forward scan of the same body that
      also emits its incoming carries as extra ys: c_hist[t] = carry entering step t;
  (b) the body's VJP is built once, as a new closed Body, by running `autograd.grad` on the
      traced body graph with placeholder cotangents (gc for c', gy for y_t):
          (gc, acc ; c_t, x_t, gy_t ; k) -> (dc, acc + dk ; dx_t)
      where (dc, dx_t, dk) = d f / d(c, x_t, k) applied to (gc, gy_t);
  (c) a scan in the opposite direction runs that VJP body: its carries are the carry
      cotangents (starting at the cotangents of the final carries) plus one accumulator per
      float const (starting at zero), its xs are c_hist, the original xs and the ys'
      cotangents; its final carries are the cotangents of the init carries and consts, its ys
      the cotangents of the xs.
Missing cotangents are zeros; non-float carries/xs/consts get None. Everything is built from
Scan nodes and primitives, so the result can be differentiated again.
"""
from __future__ import annotations

from .ir.scan import build_scan, make_body, placeholder
from .ir.tensor import Tensor, zeros_like


def scan_vjp(n, xs: list[Tensor], ys: list[Tensor], gs: list, grad) -> list:
    """Cotangents for the sources of Scan node `n` (init carries, xs, consts) given the
    cotangents `gs` (None = zero) of its outputs (final carries, ys); `grad` is autograd's
    entry point, used on the traced body."""
    op = n.op
    body = op.body
    nc, nx = op.n_carry, op.n_xs
    nk = len(n.srcs) - nc - nx
    P, O = tuple(body.inputs), tuple(body.outputs)
    ny = len(O) - nc
    c_in, x_in, k_in = P[:nc], P[nc:nc + nx], P[nc + nx:]
    fc = [i for i in range(nc) if c_in[i].dtype.is_float]
    fx = [j for j in range(nx) if x_in[j].dtype.is_float]
    fk = [j for j in range(nk) if k_in[j].dtype.is_float]
    fy = [j for j in range(ny) if O[nc + j].dtype.is_float]
    res: list = [None] * len(xs)
    if not (fc or fx or fk) or not (fc or fy):
        return res
    init_t, xs_t, consts_t = xs[:nc], xs[nc:nc + nx], xs[nc + nx:]
    L, dev = op.length, n.device

    # (a) the carry entering every step, stacked [L, ...] and indexed by t
    c_hist: list[Tensor] = []
    if nc:
        aug = make_body(P, O + c_in, "scan (gradient)")
        _, ys_aug = build_scan(aug, init_t, xs_t, consts_t, L, op.reverse)
        c_hist = ys_aug[ny:]

    # (b) the body's VJP as a closed Body
    gc_ph = [placeholder(c_in[i].shape, c_in[i].dtype, dev) for i in fc]
    gy_ph = [placeholder(O[nc + j].shape, O[nc + j].dtype, dev) for j in fy]
    acc_ph = [placeholder(k_in[j].shape, k_in[j].dtype, dev) for j in fk]
    outs = [Tensor(O[i]) for i in fc] + [Tensor(O[nc + j]) for j in fy]
    wrt = [Tensor(c_in[i]) for i in fc] + [Tensor(x_in[j]) for j in fx] + \
          [Tensor(k_in[j]) for j in fk]
    got = grad(outs, wrt, gc_ph + gy_ph)
    g_c, g_x, g_k = got[:len(fc)], got[len(fc):len(fc) + len(fx)], got[len(fc) + len(fx):]
    new_acc = [a + g for a, g in zip(acc_ph, g_k)]
    vjp_inputs = [t.value for t in gc_ph + acc_ph] + list(c_in) + list(x_in) + \
                 [t.value for t in gy_ph] + list(k_in)
    vjp_body = make_body(vjp_inputs, [t.value for t in g_c + new_acc + g_x], "scan (gradient)")

    # (c) the reverse scan
    r_init = [gs[i] if gs[i] is not None else zeros_like(ys[i]) for i in fc] + \
             [zeros_like(consts_t[j]) for j in fk]
    r_xs = list(c_hist) + list(xs_t) + \
           [gs[nc + j] if gs[nc + j] is not None else zeros_like(ys[nc + j]) for j in fy]
    finals, r_ys = build_scan(vjp_body, r_init, r_xs, consts_t, L, not op.reverse)
    for a, i in enumerate(fc):
        res[i] = finals[a]
    for a, j in enumerate(fk):
        res[nc + nx + j] = finals[len(fc) + a]
    for a, j in enumerate(fx):
        res[nc + j] = r_ys[a]
    return res
