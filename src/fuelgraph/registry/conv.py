"""Convolutions: CONV2D (id 6), CONV_TRANSPOSE2D (id 11), CAUSAL_CONV1D (id 18) and their two
backward helpers.

* conv2d: x [N, Cin, H, W], weight [Cout, Cin/g, Kh, Kw], bias [Cout] -> [N, Cout, Ho, Wo]
  (cross-correlation, torch semantics)
* conv_transpose2d: x [N, Cin, H, W], weight [Cin, Cout/g, Kh, Kw], bias [Cout]
  -> [N, Cout, Ho, Wo] (the adjoint of conv2d)
* causal_conv1d: x [B, C, L], weight [C, W] or [C, 1, W], bias [C] -> [B, C, L] (depthwise,
  W-1 zeros padded on the left, optional silu)
* conv2d_backward_weight: (x, grad) -> dweight [Cout, Cin/g, Kh, Kw], the weight gradient of
  conv2d, also that of conv_transpose2d with x and grad swapped
* causal_conv1d_backward: (x, weight, grad, [bias]) -> (dx, dweight, dbias)

Padding is stored per side, (top, bottom, left, right): `padding="same"` with an even kernel pads
one more row/column at the bottom/right, as torch does, and the gradient of such a conv2d is a
conv_transpose2d cropping unequal amounts. Output sizes:
    conv2d:           Ho = (H + top + bottom - dh*(Kh-1) - 1) // sh + 1
    conv_transpose2d: Ho = (H-1)*sh - top - bottom + dh*(Kh-1) + output_padding_h + 1
The gradient of conv2d w.r.t. x is a conv_transpose2d node and the reverse; weight gradients
are conv2d_backward_weight nodes (correlations of x with the upstream gradient), whose own
gradients are conv2d / conv_transpose2d again, so every order of derivative stays on the fused
kernels. Recipes compute in acc(T) (float32 for 16-bit inputs) and round once, as the kernels
do; the idioms in the inputs' own dtype are declared as extra patterns."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import FuelGraphError
from ..ir import ops
from ..ir.tensor import Tensor, cat, stack
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import check_arity, check_float, check_same_dtype

CONV2D_BACKWARD_WEIGHT = FusedOpId(0x130)
CAUSAL_CONV1D_BACKWARD = FusedOpId(0x131)


# ---- params --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conv2dParams:
    """stride (sh, sw) >= 1; padding (top, bottom, left, right) >= 0 of zeros; dilation
    (dh, dw) >= 1; groups >= 1 dividing Cin and Cout."""
    stride: tuple = (1, 1)
    padding: tuple = (0, 0, 0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1


@dataclass(frozen=True)
class ConvTranspose2dParams:
    """As Conv2dParams; padding crops (top, bottom, left, right) off the full output and
    output_padding (oh, ow) extends it at the bottom/right (each < max(stride, dilation))."""
    stride: tuple = (1, 1)
    padding: tuple = (0, 0, 0, 0)
    output_padding: tuple = (0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1


@dataclass(frozen=True)
class Conv2dBackwardWeightParams:
    """The forward conv2d's params plus its kernel size (Kh, Kw)."""
    stride: tuple = (1, 1)
    padding: tuple = (0, 0, 0, 0)
    dilation: tuple = (1, 1)
    groups: int = 1
    kernel_size: tuple = (3, 3)


@dataclass(frozen=True)
class CausalConv1dParams:
    """use_silu: apply silu(z) = z * sigmoid(z) after the bias."""
    use_silu: bool = False


# ---- argument parsing (builders) and param checks (validate) --------------------------------
def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _ints(op, arg, v, n):
    """An int or a sequence of n ints as a tuple of n Python ints."""
    if _is_int(v):
        return (int(v),) * n
    if isinstance(v, (tuple, list)) and len(v) == n and all(_is_int(e) for e in v):
        return tuple(int(e) for e in v)
    raise FuelGraphError(f"{op}: {arg} must be an int or a pair of ints, got {v!r}")


def _check_tuple(op, arg, v, n, lo):
    if not (isinstance(v, tuple) and len(v) == n and all(_is_int(e) for e in v)):
        raise FuelGraphError(f"{op}: {arg} must be a tuple of {n} ints, got {v!r}")
    if any(e < lo for e in v):
        what = "positive" if lo == 1 else "non-negative"
        raise FuelGraphError(f"{op}: {arg} is {v}, expected {what} values")


def _check_groups(op, g):
    if not _is_int(g) or g < 1:
        raise FuelGraphError(f"{op}: groups must be a positive int, got {g!r}")


def conv_padding(op, padding, kernel, stride, dilation) -> tuple:
    """Per-side padding (top, bottom, left, right) from torch's conv2d padding argument: an int,
    a pair, "valid" (no padding) or "same" (output size = input size; stride 1 only; an odd
    total goes one more to the bottom/right, as torch does)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise FuelGraphError(f"{op}: padding='same' needs stride 1, got stride {stride}")
            out = []
            for k, d in zip(kernel, dilation):
                total = d * (k - 1)
                out += [total // 2, total - total // 2]
            return tuple(out)
        raise FuelGraphError(f"{op}: padding must be an int, a pair, 'valid' or 'same', "
                             f"got {padding!r}")
    ph, pw = _ints(op, "padding", padding, 2)
    return (ph, ph, pw, pw)


def _conv_out(size, lo, hi, k, s, d):
    return (size + lo + hi - d * (k - 1) - 1) // s + 1


def _transpose_out(size, lo, hi, k, s, d, op_):
    return (size - 1) * s - lo - hi + d * (k - 1) + op_ + 1


def conv2d_out_hw(x_shape, w_shape, p) -> tuple[int, int]:
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = p.stride, p.padding, p.dilation
    return (_conv_out(x_shape[2], pt, pb, w_shape[2], sh, dh),
            _conv_out(x_shape[3], pl, pr, w_shape[3], sw, dw))


def conv_transpose2d_out_hw(x_shape, w_shape, p) -> tuple[int, int]:
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = p.stride, p.padding, p.dilation
    oh, ow = p.output_padding
    return (_transpose_out(x_shape[2], pt, pb, w_shape[2], sh, dh, oh),
            _transpose_out(x_shape[3], pl, pr, w_shape[3], sw, dw, ow))


def _check_conv_params(op, p, transpose=False):
    _check_tuple(op, "stride", p.stride, 2, 1)
    _check_tuple(op, "padding", p.padding, 4, 0)
    _check_tuple(op, "dilation", p.dilation, 2, 1)
    _check_groups(op, p.groups)
    if transpose:
        _check_tuple(op, "output_padding", p.output_padding, 2, 0)
        for o, s, d in zip(p.output_padding, p.stride, p.dilation):
            if o >= max(s, d):
                raise FuelGraphError(f"{op}: output_padding {p.output_padding} must be smaller "
                                     f"than stride {p.stride} or dilation {p.dilation}")


def _check_rank(op, t, label, rank, layout):
    if len(t.shape) != rank:
        raise FuelGraphError(f"{op}: {label} has shape {tuple(t.shape)}, expected rank {rank} "
                             f"{layout}")


def _check_common(op, srcs, labels, n_required):
    check_arity(op, srcs, n_required, n_required + 1)
    labels = labels[:len(srcs)]
    check_float(op, srcs, labels=labels)
    check_same_dtype(op, srcs, tuple(range(len(srcs))), labels)


def _check_bias(op, srcs, index, n):
    if len(srcs) > index and tuple(srcs[index].shape) != (n,):
        raise FuelGraphError(f"{op}: bias has shape {tuple(srcs[index].shape)}, expected ({n},)")


def _check_x(op, x):
    _check_rank(op, x, "x", 4, "[N, Cin, H, W]")
    if min(x.shape[1:]) < 1:
        raise FuelGraphError(f"{op}: x has shape {tuple(x.shape)}, expected Cin, H, W >= 1")


def _validate_conv2d(srcs, p):
    op = "conv2d"
    _check_common(op, srcs, ["x", "weight", "bias"], 2)
    x, w = srcs[0], srcs[1]
    _check_x(op, x)
    _check_rank(op, w, "weight", 4, "[Cout, Cin/groups, Kh, Kw]")
    _check_conv_params(op, p)
    g, cin, (co, cg, kh, kw) = p.groups, x.shape[1], w.shape
    if min(w.shape) < 1:
        raise FuelGraphError(f"{op}: weight has shape {tuple(w.shape)}, expected every dim >= 1")
    if cin % g or co % g:
        raise FuelGraphError(f"{op}: groups {g} must divide Cin {cin} and Cout {co}")
    if cg * g != cin:
        raise FuelGraphError(f"{op}: weight has shape {tuple(w.shape)}: dim 1 is Cin/groups, "
                             f"expected {cin // g} (x has Cin {cin}, groups {g})")
    _check_bias(op, srcs, 2, co)
    (pt, pb, pl, pr), (dh, dw) = p.padding, p.dilation
    for size, lo, hi, k, d, ax in ((x.shape[2], pt, pb, kh, dh, "height"),
                                   (x.shape[3], pl, pr, kw, dw, "width")):
        if d * (k - 1) + 1 > size + lo + hi:
            raise FuelGraphError(f"{op}: weight: the dilated kernel {ax} {d * (k - 1) + 1} is "
                                 f"larger than the padded input {ax} {size + lo + hi}")


def _validate_conv_transpose2d(srcs, p):
    op = "conv_transpose2d"
    _check_common(op, srcs, ["x", "weight", "bias"], 2)
    x, w = srcs[0], srcs[1]
    _check_x(op, x)
    _check_rank(op, w, "weight", 4, "[Cin, Cout/groups, Kh, Kw]")
    _check_conv_params(op, p, transpose=True)
    g, cin = p.groups, x.shape[1]
    if min(w.shape) < 1:
        raise FuelGraphError(f"{op}: weight has shape {tuple(w.shape)}, expected every dim >= 1")
    if w.shape[0] != cin:
        raise FuelGraphError(f"{op}: weight has shape {tuple(w.shape)}: dim 0 is Cin, expected "
                             f"{cin} (x has shape {tuple(x.shape)})")
    if cin % g:
        raise FuelGraphError(f"{op}: groups {g} must divide Cin {cin}")
    _check_bias(op, srcs, 2, w.shape[1] * g)
    ho, wo = conv_transpose2d_out_hw(x.shape, w.shape, p)
    if ho < 1 or wo < 1:
        raise FuelGraphError(f"{op}: padding {p.padding} leaves an empty output ({ho}, {wo}) "
                             f"for x {tuple(x.shape)} and weight {tuple(w.shape)}")


def _validate_backward_weight(srcs, p):
    op = "conv2d_backward_weight"
    check_arity(op, srcs, 2)
    check_float(op, srcs, labels=["x", "grad"])
    check_same_dtype(op, srcs, (0, 1), ["x", "grad"])
    x, gr = srcs
    _check_x(op, x)
    _check_rank(op, gr, "grad", 4, "[N, Cout, Ho, Wo]")
    _check_conv_params(op, p)
    _check_tuple(op, "kernel_size", p.kernel_size, 2, 1)
    g = p.groups
    if gr.shape[0] != x.shape[0] or min(gr.shape[1:]) < 1:
        raise FuelGraphError(f"{op}: grad has shape {tuple(gr.shape)}, expected [N, Cout, Ho, Wo] "
                             f"with N = {x.shape[0]} and Cout, Ho, Wo >= 1")
    if x.shape[1] % g or gr.shape[1] % g:
        raise FuelGraphError(f"{op}: groups {g} must divide Cin {x.shape[1]} and Cout "
                             f"{gr.shape[1]}")
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = p.stride, p.padding, p.dilation
    for o, size, lo, hi, k, s, d, ax in ((gr.shape[2], x.shape[2], pt, pb, p.kernel_size[0], sh,
                                          dh, "height"),
                                         (gr.shape[3], x.shape[3], pl, pr, p.kernel_size[1], sw,
                                          dw, "width")):
        if (o - 1) * s + d * (k - 1) + 1 > size + lo + hi:
            raise FuelGraphError(f"{op}: grad {ax} {o} needs a padded input {ax} of at least "
                                 f"{(o - 1) * s + d * (k - 1) + 1}, x gives {size + lo + hi}")


def _check_silu(op, p):
    if not isinstance(p.use_silu, (bool, np.bool_)):
        raise FuelGraphError(f"{op}: use_silu must be a bool, got {p.use_silu!r}")


def _check_causal_xw(op, x, w):
    _check_rank(op, x, "x", 3, "[B, C, L]")
    b, c, l = x.shape
    if c < 1 or l < 1:
        raise FuelGraphError(f"{op}: x has shape {tuple(x.shape)}, expected C >= 1 and L >= 1")
    ok = (len(w.shape) == 2 and w.shape[0] == c) or \
        (len(w.shape) == 3 and w.shape[0] == c and w.shape[1] == 1)
    if not ok or w.shape[-1] < 1:
        raise FuelGraphError(f"{op}: weight has shape {tuple(w.shape)}, expected [C, W] or "
                             f"[C, 1, W] with C = {c} and W >= 1")


def _validate_causal(srcs, p):
    op = "causal_conv1d"
    _check_common(op, srcs, ["x", "weight", "bias"], 2)
    _check_causal_xw(op, srcs[0], srcs[1])
    _check_bias(op, srcs, 2, srcs[0].shape[1])
    _check_silu(op, p)


def _validate_causal_backward(srcs, p):
    op = "causal_conv1d_backward"
    _check_common(op, srcs, ["x", "weight", "grad", "bias"], 3)
    _check_causal_xw(op, srcs[0], srcs[1])
    if tuple(srcs[2].shape) != tuple(srcs[0].shape):
        raise FuelGraphError(f"{op}: grad has shape {tuple(srcs[2].shape)}, expected "
                             f"{tuple(srcs[0].shape)} (the shape of x)")
    _check_bias(op, srcs, 3, srcs[0].shape[1])
    _check_silu(op, p)


# ---- shape and dtype rules -----------------------------------------------------------------
def _conv2d_shape(shapes, p):
    return [(shapes[0][0], shapes[1][0]) + conv2d_out_hw(shapes[0], shapes[1], p)]


def _conv_transpose2d_shape(shapes, p):
    hw = conv_transpose2d_out_hw(shapes[0], shapes[1], p)
    return [(shapes[0][0], shapes[1][1] * p.groups) + hw]


def _backward_weight_shape(shapes, p):
    x, g = shapes
    return [(g[1], x[1] // p.groups) + tuple(p.kernel_size)]


def _same_as_x(shapes_or_dtypes, p):
    return [shapes_or_dtypes[0]]


def _causal_backward_shape(shapes, p):
    return [shapes[0], shapes[1], (shapes[0][1],)]


def _causal_backward_dtype(dtypes, p):
    return [dtypes[0]] * 3


# ---- recipes (primitives only) ---------------------------------------------------------------
def _in_acc(recipe):
    """Run a recipe in acc(T) (float32 for 16-bit inputs) and round each output once at the end,
    as the kernels do; the plain recipe is also declared as a pattern (16-bit idioms fuse)."""
    def wrapped(*xs, **params):
        d = xs[0].dtype
        out = recipe(*(x.astype(d.acc) for x in xs), **params)
        if isinstance(out, tuple):
            return tuple(o.astype(d) for o in out)
        return out.astype(d)
    wrapped.__name__ = wrapped.__qualname__ = recipe.__name__.replace("_math", "_recipe")
    wrapped.__doc__ = recipe.__doc__
    return wrapped


def _pad4(x, pads):
    """Zero-pad the last two axes by (top, bottom, left, right); the Pad node is built even for
    zero padding, so the recipe has one structure for every setting (it re-fuses from it)."""
    pt, pb, pl, pr = pads
    return x._new(ops.Pad((0, 0, pt, pl), (0, 0, pb, pr), (0, 0, 0, 0), 0.0), x)


def _slice_axis(t, axis, start, stop, step):
    starts = [0] * t.ndim
    stops = list(t.shape)
    steps = [1] * t.ndim
    starts[axis], stops[axis], steps[axis] = start, stop, step
    return t._new(ops.Slice(tuple(starts), tuple(stops), tuple(steps)), t)


def unfold_axis(t, axis, k, d, n_out, s):
    """Windows along one axis with a fixed number of nodes (whatever k, d, s):
    t [*pre, n, *rest] -> [*pre, k, n_out, *rest], out[.., ky, o, ..] = t[.., ky*d + o*s, ..].
    The axis (with its trailing dims, r elements per step) is repeated k times, flattened,
    zero-extended by k*d*r and re-cut into rows of (n + d)*r: row ky then starts ky*d steps
    further into t. Needs (n_out - 1)*s + d*(k - 1) < n."""
    pre, n, rest = t.shape[:axis], t.shape[axis], t.shape[axis + 1:]
    r = math.prod(rest)
    u = t.reshape(pre + (1, n * r)).broadcast_to(pre + (k, n * r)).reshape(pre + (k * n * r,))
    u = u._new(ops.Pad((0,) * len(pre) + (0,), (0,) * len(pre) + (k * d * r,),
                       (0,) * (len(pre) + 1), 0.0), u)
    u = u.reshape(pre + (k, n + d) + rest)
    return _slice_axis(u, axis + 1, 0, (n_out - 1) * s + 1, s)


def fold_axis(u, axis, k, d, n, s):
    """The adjoint of unfold_axis (overlap-add, col2im along one axis):
    u [*pre, k, n_in, *rest] -> [*pre, n, *rest], out[.., i, ..] = sum over ky*d + o*s = i of
    u[.., ky, o, ..]. Needs n >= (n_in - 1)*s + d*(k - 1) + 1."""
    pre, n_in, rest = u.shape[:axis], u.shape[axis + 1], u.shape[axis + 2:]
    r = math.prod(rest)
    zeros_ = (0,) * u.ndim
    hi, inner = list(zeros_), list(zeros_)
    hi[axis + 1] = n + d - ((n_in - 1) * s + 1)
    inner[axis + 1] = s - 1
    t = u._new(ops.Pad(zeros_, tuple(hi), tuple(inner), 0.0), u)     # [.., k, n + d, ..]
    t = t.reshape(pre + (k * (n + d) * r,))
    t = _slice_axis(t, axis, 0, k * n * r, 1).reshape(pre + (k, n) + rest)
    return t.sum(axis)


def _im2col(x, kernel, out_hw, stride, padding, dilation, groups):
    """[N, C, H, W] -> [N, g, C/g*Kh*Kw, Ho*Wo] (rows ordered (c, ky, kx) like the weight)."""
    n, c = x.shape[:2]
    (kh, kw), (ho, wo) = kernel, out_hw
    t = unfold_axis(_pad4(x, padding), 2, kh, dilation[0], ho, stride[0])  # [N, C, Kh, Ho, Wp]
    t = unfold_axis(t, 4, kw, dilation[1], wo, stride[1])                  # [N, C, Kh, Ho, Kw, Wo]
    return t.permute(0, 1, 2, 4, 3, 5).reshape(n, groups, (c // groups) * kh * kw, ho * wo)


def conv2d_math(x, weight, *bias, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1),
                groups=1):
    """pad, im2col (unfold_axis over H then W), one grouped matmul, bias."""
    n = x.shape[0]
    co, cg, kh, kw = weight.shape
    ho, wo = conv2d_out_hw(x.shape, weight.shape, Conv2dParams(stride, padding, dilation, groups))
    cols = _im2col(x, (kh, kw), (ho, wo), stride, padding, dilation, groups)
    y = (weight.reshape(groups, co // groups, cg * kh * kw) @ cols).reshape(n, co, ho, wo)
    return y + bias[0].reshape(co, 1, 1) if bias else y


def conv_transpose2d_math(x, weight, *bias, stride=(1, 1), padding=(0, 0, 0, 0),
                          output_padding=(0, 0), dilation=(1, 1), groups=1):
    """One grouped matmul to the column stack [N, Cout, Kh, Kw, H, W], overlap-add (fold_axis
    over W then H) into the full output, crop by the padding, bias."""
    n, cin, h, w = x.shape
    _, cog, kh, kw = weight.shape
    g, cout = groups, cog * groups
    p = ConvTranspose2dParams(stride, padding, output_padding, dilation, groups)
    ho, wo = conv_transpose2d_out_hw(x.shape, weight.shape, p)
    (sh, sw), (pt, _, pl, _), (dh, dw) = stride, padding, dilation
    full_h = max((h - 1) * sh + dh * (kh - 1) + 1, pt + ho)
    full_w = max((w - 1) * sw + dw * (kw - 1) + 1, pl + wo)
    cols = weight.reshape(g, cin // g, cog * kh * kw).mT @ x.reshape(n, g, cin // g, h * w)
    t = cols.reshape(n, cout, kh, kw, h, w).permute(0, 1, 2, 4, 3, 5)     # [N, Co, Kh, H, Kw, W]
    t = fold_axis(t, 4, kw, dw, full_w, sw)                                # [N, Co, Kh, H, Wf]
    t = fold_axis(t, 2, kh, dh, full_h, sh)                                # [N, Co, Hf, Wf]
    y = t._new(ops.Slice((0, 0, pt, pl), (n, cout, pt + ho, pl + wo), (1, 1, 1, 1)), t)
    return y + bias[0].reshape(cout, 1, 1) if bias else y


def conv2d_backward_weight_math(x, grad, *, stride=(1, 1), padding=(0, 0, 0, 0),
                                dilation=(1, 1), groups=1, kernel_size=(3, 3)):
    """dW[co, ci, ky, kx] = sum over n, oh, ow of grad[n, co, oh, ow] * the padded input at the
    tap: im2col of x (as in conv2d) and one grouped matmul contracting batch and pixels."""
    n, c = x.shape[:2]
    co, ho, wo = grad.shape[1:]
    kh, kw = kernel_size
    g, ckk = groups, (c // groups) * kh * kw
    cols = _im2col(x, kernel_size, (ho, wo), stride, padding, dilation, groups)
    cols = cols.permute(1, 0, 3, 2).reshape(g, n * ho * wo, ckk)
    gr = grad.reshape(n, g, co // g, ho * wo).permute(1, 2, 0, 3).reshape(g, co // g, n * ho * wo)
    return (gr @ cols).reshape(co, c // g, kh, kw)


def causal_conv1d_math(x, weight, *bias, use_silu=False):
    """z[b, c, t] = bias[c] + sum_k weight[c, k] * x[b, c, t + k - (W-1)] (zeros before t = 0);
    the W windows come from unfold_axis, so the recipe has one structure for every W."""
    b, c, l = x.shape
    k = weight.shape[-1]
    xp = x._new(ops.Pad((0, 0, k - 1), (0, 0, 0), (0, 0, 0), 0.0), x)
    z = (unfold_axis(xp, 2, k, 1, l, 1) * weight.reshape(c, k, 1)).sum(2)
    if bias:
        z = z + bias[0].reshape(c, 1)
    return z.silu() if use_silu else z


def causal_conv1d_backward_math(x, weight, grad, *bias, use_silu=False):
    """(dx, dweight, dbias) of causal_conv1d for the upstream gradient `grad`:
    dz = grad * silu'(z) (or grad), dbias = sum_{b,t} dz, dweight[c, k] = sum_{b,t} dz * x
    shifted by k - (W-1), dx[u] = sum_k dz[u + W-1-k] * weight[c, k]."""
    b, c, l = x.shape
    k = weight.shape[-1]
    w2 = weight.reshape(c, k)
    if use_silu:
        z = causal_conv1d_math(x, weight, *bias)
        s = z.sigmoid()
        dz = grad * (s * (1.0 + z * (1.0 - s)))
    else:
        dz = grad
    xp = x.pad(((0, 0), (0, 0), (k - 1, 0)))
    dw = cat([(dz * xp[:, :, j:j + l]).sum((0, 2)).reshape(c, 1) for j in range(k)], 1)
    dzp = dz.pad(((0, 0), (0, 0), (0, k - 1)))
    dx = None
    for j in range(k):
        term = dzp[:, :, k - 1 - j: k - 1 - j + l] * w2[:, j:j + 1]
        dx = term if dx is None else dx + term
    return dx, dw.reshape(weight.shape), dz.sum((0, 2))


# ---- hand-written idioms (extra fusion patterns) ------------------------------------------------
def conv2d_3x3_idiom(x, weight, *bias, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1),
                     groups=1, _pad=True):
    """A 3x3 conv as users write it: pad, nine strided slices stacked, one matmul, bias."""
    n, co = x.shape[0], weight.shape[0]
    (sh, sw), (dh, dw) = stride, dilation
    xp = x.pad(((0, 0), (0, 0), padding[:2], padding[2:])) if _pad else x
    ho = (xp.shape[2] - 2 * dh - 1) // sh + 1
    wo = (xp.shape[3] - 2 * dw - 1) // sw + 1
    cols = stack([xp[:, :, ky * dh: ky * dh + (ho - 1) * sh + 1: sh,
                     kx * dw: kx * dw + (wo - 1) * sw + 1: sw]
                  for ky in range(3) for kx in range(3)], 2)
    y = (weight.reshape(co, -1) @ cols.reshape(n, -1, ho * wo)).reshape(n, co, ho, wo)
    return y + bias[0].reshape(co, 1, 1) if bias else y


def causal_conv1d_idiom(taps):
    """Causal depthwise conv with `taps` weight columns as users write it: a left pad and a
    sum of shifted slices times weight columns (+ bias, silu)."""
    def idiom(x, weight, *bias, use_silu=False):
        c, l = x.shape[1], x.shape[2]
        xp = x.pad(((0, 0), (0, 0), (taps - 1, 0)))
        z = None
        for j in range(taps):
            term = xp[:, :, j:j + l] * weight[:, j:j + 1]
            z = term if z is None else z + term
        if bias:
            z = z + bias[0].reshape(c, 1)
        return z.silu() if use_silu else z
    idiom.__name__ = f"causal_conv1d_{taps}tap_idiom"
    return idiom


def _inputs(n, fn):
    """`fn` as a pattern on the first n sample inputs: the form without the optional bias."""
    def wrapped(*xs, **params):
        return fn(*xs[:n], **params)
    wrapped.n_inputs = n
    wrapped.__name__ = f"{fn.__name__}_without_bias"
    wrapped.read_kind = getattr(fn, "read_kind", None)
    return wrapped


def _tagged(fn, kind, **fixed):
    def wrapped(*xs, **params):
        return fn(*xs, **params, **fixed)
    wrapped.__name__ = fn.__name__
    wrapped.read_kind = kind
    return wrapped


conv2d_recipe = _in_acc(conv2d_math)
conv_transpose2d_recipe = _in_acc(conv_transpose2d_math)
conv2d_backward_weight_recipe = _in_acc(conv2d_backward_weight_math)
causal_conv1d_recipe = _in_acc(causal_conv1d_math)
causal_conv1d_backward_recipe = _in_acc(causal_conv1d_backward_math)


# ---- backward --------------------------------------------------------------------------------
def _grad_bias(g):
    return g.sum((0, 2, 3))


def _conv2d_dx(x_shape, w, g, p):
    """conv2d's input gradient: conv_transpose2d(g, w) with the output padding (< stride) that
    restores x's size (the rows a strided conv never reached)."""
    (sh, sw), (pt, pb, pl, pr), (dh, dw) = p.stride, p.padding, p.dilation
    kh, kw = w.shape[2:]
    oph = (x_shape[2] + pt + pb - dh * (kh - 1) - 1) % sh
    opw = (x_shape[3] + pl + pr - dw * (kw - 1) - 1) % sw
    return call_fused(FusedOps.CONV_TRANSPOSE2D, g, w, stride=p.stride, padding=p.padding,
                      output_padding=(oph, opw), dilation=p.dilation, groups=p.groups)


def _conv2d_vjp(xs, ys, gs, p):
    """dx = conv_transpose2d(g, w); dw = conv2d_backward_weight(x, g); dbias = sum of g over
    N, Ho, Wo."""
    x, w, g = xs[0], xs[1], gs[0]
    dwt = call_fused(CONV2D_BACKWARD_WEIGHT, x, g, stride=p.stride, padding=p.padding,
                     dilation=p.dilation, groups=p.groups, kernel_size=tuple(w.shape[2:]))
    return [_conv2d_dx(x.shape, w, g, p), dwt] + ([_grad_bias(g)] if len(xs) == 3 else [])


def _conv_transpose2d_vjp(xs, ys, gs, p):
    """dx = conv2d(g, w) (cropped to x's size when output_padding >= stride), dw =
    conv2d_backward_weight(g, x) (the roles swap), dbias = sum of g."""
    x, w, g = xs[0], xs[1], gs[0]
    dx = call_fused(FusedOps.CONV2D, g, w, stride=p.stride, padding=p.padding,
                    dilation=p.dilation, groups=p.groups)
    if dx.shape[2:] != x.shape[2:]:
        dx = dx[:, :, :x.shape[2], :x.shape[3]]
    dwt = call_fused(CONV2D_BACKWARD_WEIGHT, g, x, stride=p.stride, padding=p.padding,
                     dilation=p.dilation, groups=p.groups, kernel_size=tuple(w.shape[2:]))
    return [dx, dwt] + ([_grad_bias(g)] if len(xs) == 3 else [])


def _backward_weight_vjp(xs, ys, gs, p):
    """dW is linear in x and in grad: for a cotangent V shaped like dW, d/dgrad = conv2d(x, V)
    (cropped to grad's size) and d/dx = conv_transpose2d(grad zero-extended to the full conv
    output, V)."""
    x, gr, v = xs[0], xs[1], gs[0]
    cp = Conv2dParams(p.stride, p.padding, p.dilation, p.groups)
    full_h, full_w = conv2d_out_hw(x.shape, v.shape, cp)
    dgr = call_fused(FusedOps.CONV2D, x, v, stride=p.stride, padding=p.padding,
                     dilation=p.dilation, groups=p.groups)
    if dgr.shape[2:] != gr.shape[2:]:
        dgr = dgr[:, :, :gr.shape[2], :gr.shape[3]]
    ge = gr.pad(((0, 0), (0, 0), (0, full_h - gr.shape[2]), (0, full_w - gr.shape[3])))
    return [_conv2d_dx(x.shape, v, ge, cp), dgr]


def _causal_vjp(xs, ys, gs, p):
    dx, dw, db = call_fused(CAUSAL_CONV1D_BACKWARD, xs[0], xs[1], gs[0], *xs[2:],
                            use_silu=p.use_silu)
    return [dx, dw] + ([db] if len(xs) == 3 else [])


# ---- samples (pattern derivation and the registry-wide decomposition test) -------------------
def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _conv2d_sample(rng):
    return [_f32(rng, 2, 4, 7, 6), _f32(rng, 6, 4, 3, 3), _f32(rng, 6)]


def _conv_transpose2d_sample(rng):
    return [_f32(rng, 2, 4, 5, 4), _f32(rng, 4, 3, 3, 3), _f32(rng, 3)]


def _backward_weight_sample(rng):
    return [_f32(rng, 2, 4, 7, 6), _f32(rng, 2, 6, 5, 4)]


def _causal_sample(rng):
    return [_f32(rng, 2, 3, 9), _f32(rng, 3, 4), _f32(rng, 3)]


def _causal_backward_sample(rng):
    return [_f32(rng, 2, 3, 9), _f32(rng, 3, 4), _f32(rng, 2, 3, 9), _f32(rng, 3)]


def _pads_of(node):
    op = node.op
    return (op.lo[2], op.hi[2], op.lo[3], op.hi[3])


def _read_conv2d(bound):
    """stride, padding, dilation and groups of a matched conv2d recipe or 3x3 idiom, read off
    its Pad and Slice nodes (the match is then verified by re-tracing with them)."""
    x, w = bound.capture(0).shape, bound.capture(1).shape
    pads, slices = bound.nodes_of(ops.Pad), bound.nodes_of(ops.Slice)
    if getattr(bound.pattern.recipe, "read_kind", None) == "idiom3":
        s0 = slices[0].op
        return dict(stride=(s0.steps[2], s0.steps[3]),
                    padding=_pads_of(pads[0]) if pads else (0, 0, 0, 0),
                    dilation=(slices[3].op.starts[2], slices[1].op.starts[3]), groups=1)
    pad_x, pad_h, pad_w = pads
    sl_h, sl_w = slices
    padding = _pads_of(pad_x)
    wp = x[3] + padding[2] + padding[3]
    return dict(stride=(sl_h.op.steps[3], sl_w.op.steps[5]), padding=padding,
                dilation=(pad_h.op.hi[-1] // (w[2] * wp), pad_w.op.hi[-1] // w[3]),
                groups=x[1] // w[1])


def _read_conv_transpose2d(bound):
    """Params of a matched conv_transpose2d recipe from its fold Pads and Slices and the crop.
    Only padding_bottom - output_padding shows in the graph: the smaller pair is taken."""
    (_, _, h, wd), (_, cog, kh, kw) = bound.capture(0).shape, bound.capture(1).shape
    pad_w, pad_h = bound.nodes_of(ops.Pad)
    sl_w, sl_h, crop = bound.nodes_of(ops.Slice)
    sw, sh = pad_w.op.interior[5] + 1, pad_h.op.interior[3] + 1
    full_w = sl_w.op.stops[4] // kw
    full_h = sl_h.op.stops[2] // (kh * full_w)
    dw = pad_w.op.hi[5] - full_w + (wd - 1) * sw + 1
    dh = pad_h.op.hi[3] - full_h + (h - 1) * sh + 1
    pt, pl = crop.op.starts[2], crop.op.starts[3]
    ho, wo = crop.op.stops[2] - pt, crop.op.stops[3] - pl
    bh = (h - 1) * sh - pt + dh * (kh - 1) + 1 - ho          # padding_bottom - output_padding
    bw = (wd - 1) * sw - pl + dw * (kw - 1) + 1 - wo
    return dict(stride=(sh, sw), padding=(pt, max(bh, 0), pl, max(bw, 0)),
                output_padding=(max(-bh, 0), max(-bw, 0)), dilation=(dh, dw),
                groups=bound.root.shape[1] // cog)


_G1 = {"groups": 1}
_PADDED = {"groups": 1, "padding": (1, 1, 1, 1)}      # traced with a Pad node (read back later)
_CONV2D_PATTERNS = (
    (_inputs(2, conv2d_recipe), _G1),
    (_tagged(conv2d_3x3_idiom, "idiom3"), _PADDED),
    (_tagged(conv2d_3x3_idiom, "idiom3", _pad=False), _G1),
    (_inputs(2, _tagged(conv2d_3x3_idiom, "idiom3")), _PADDED),
    (_inputs(2, _tagged(conv2d_3x3_idiom, "idiom3", _pad=False)), _G1),
)
_CAUSAL_PATTERNS = tuple(
    [(_inputs(2, causal_conv1d_recipe), {"use_silu": silu}) for silu in (False, True)] +
    [(fn, {"use_silu": silu}) for taps in (2, 3, 4)
     for fn in (causal_conv1d_idiom(taps), _inputs(2, causal_conv1d_idiom(taps)))
     for silu in (False, True)])


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.CONV2D, name="conv2d", family="forward", params=Conv2dParams,
        shape_rule=_conv2d_shape, dtype_rule=_same_as_x, validate=_validate_conv2d,
        decompose=conv2d_recipe, pattern_variants=(_G1,), extra_patterns=_CONV2D_PATTERNS,
        read_params=_read_conv2d,
        backward=BackwardKind.fused(FusedOps.CONV_TRANSPOSE2D), vjp=_conv2d_vjp,
        sample=_conv2d_sample,
        doc="2-D cross-correlation (torch conv2d). x [N, Cin, H, W], weight [Cout, Cin/g, Kh, "
            "Kw], optional bias [Cout], one float dtype -> [N, Cout, Ho, Wo] in it, "
            "Ho = (H + top + bottom - dh*(Kh-1) - 1) // sh + 1. Accumulates in float32 "
            "(float64 for float64). Backward: conv_transpose2d for x, conv2d_backward_weight "
            "for weight, a sum for bias. Fuses from its recipe (any params) and from a 3x3 conv "
            "written as pad + nine strided slices stacked + matmul (+ bias)."))
    reg.add(FusedOpEntry(
        id=FusedOps.CONV_TRANSPOSE2D, name="conv_transpose2d", family="forward",
        params=ConvTranspose2dParams, shape_rule=_conv_transpose2d_shape,
        dtype_rule=_same_as_x, validate=_validate_conv_transpose2d,
        decompose=conv_transpose2d_recipe, pattern_variants=(_G1,),
        extra_patterns=((_inputs(2, conv_transpose2d_recipe), _G1),),
        read_params=_read_conv_transpose2d,
        backward=BackwardKind.fused(FusedOps.CONV2D), vjp=_conv_transpose2d_vjp,
        sample=_conv_transpose2d_sample,
        doc="2-D transposed convolution (torch conv_transpose2d), the adjoint of conv2d. x [N, "
            "Cin, H, W], weight [Cin, Cout/g, Kh, Kw], optional bias [Cout] -> [N, Cout, Ho, "
            "Wo], Ho = (H-1)*sh - top - bottom + dh*(Kh-1) + output_padding + 1 (>= 1; "
            "output_padding < max(stride, dilation)). Backward: conv2d for x, "
            "conv2d_backward_weight (roles swapped) for weight."))
    reg.add(FusedOpEntry(
        id=FusedOps.CAUSAL_CONV1D, name="causal_conv1d", family="forward",
        params=CausalConv1dParams, shape_rule=_same_as_x, dtype_rule=_same_as_x,
        validate=_validate_causal, decompose=causal_conv1d_recipe,
        pattern_variants=({"use_silu": False}, {"use_silu": True}),
        extra_patterns=_CAUSAL_PATTERNS,
        backward=BackwardKind.fused(CAUSAL_CONV1D_BACKWARD), vjp=_causal_vjp,
        sample=_causal_sample,
        doc="Causal depthwise conv1d (Mamba). x [B, C, L] (L >= 1, unpadded: W-1 zeros go "
            "before t = 0), weight [C, W] or [C, 1, W], optional bias [C] -> [B, C, L]: "
            "z = bias + sum_k weight[:, k] * x[t + k - (W-1)], y = silu(z) if use_silu. "
            "Fuses from its recipe and from a left pad + sum of shifted slices times weight "
            "columns (W = 2, 3, 4; with or without bias and silu)."))
    reg.add(FusedOpEntry(
        id=CONV2D_BACKWARD_WEIGHT, name="conv2d_backward_weight", family="backward",
        params=Conv2dBackwardWeightParams, shape_rule=_backward_weight_shape,
        dtype_rule=_same_as_x, validate=_validate_backward_weight,
        decompose=conv2d_backward_weight_recipe, pattern_variants=None,
        backward=BackwardKind.fused(FusedOps.CONV2D), vjp=_backward_weight_vjp,
        sample=_backward_weight_sample,
        doc="Weight gradient of conv2d: x [N, Cin, H, W] (the forward input), grad [N, Cout, "
            "Ho, Wo] -> dweight [Cout, Cin/g, Kh, Kw], dW[co, ci, ky, kx] = sum over n, oh, ow "
            "of grad[n, co, oh, ow] * xpad[n, group(co)*Cin/g + ci, oh*sh + ky*dh, ow*sw + "
            "kx*dw]. With x and grad swapped it is conv_transpose2d's weight gradient."))
    reg.add(FusedOpEntry(
        id=CAUSAL_CONV1D_BACKWARD, name="causal_conv1d_backward", family="backward",
        params=CausalConv1dParams, shape_rule=_causal_backward_shape,
        dtype_rule=_causal_backward_dtype, validate=_validate_causal_backward,
        decompose=causal_conv1d_backward_recipe, pattern_variants=None,
        outputs=("dx", "dweight", "dbias"), backward=BackwardKind.DECOMPOSE,
        sample=_causal_backward_sample,
        doc="Gradients of causal_conv1d: (x, weight, grad, [bias]) -> (dx [B, C, L], dweight "
            "shaped like weight, dbias [C]); silu' is recomputed from x when use_silu. dbias "
            "is returned also when the forward had no bias."))


# ---- public builders -------------------------------------------------------------------------
def _bias(op, bias):
    if bias is None:
        return ()
    if not isinstance(bias, Tensor):
        raise FuelGraphError(f"{op}: bias must be a Tensor or None, got {type(bias).__name__}")
    return (bias,)


def _weight_kernel(op, weight):
    if not isinstance(weight, Tensor) or len(weight.shape) != 4:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise FuelGraphError(f"{op}: weight must be a rank-4 Tensor, got {shape}")
    return tuple(weight.shape[2:])


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D cross-correlation, as torch.nn.functional.conv2d (same positional order).

    x [N, Cin, H, W]; weight [Cout, Cin/groups, Kh, Kw]; bias [Cout] or None; one float dtype
    (float32, float64, bfloat16, float16) -> [N, Cout, Ho, Wo] in that dtype with
    Ho = (H + 2*ph - dh*(Kh-1) - 1) // sh + 1 (likewise Wo). stride and dilation: an int or a
    pair (>= 1); padding: an int or a pair (>= 0) of zeros on both sides, "valid" (none) or
    "same" (stride 1 only; Ho = H; when dh*(Kh-1) is odd the extra row goes at the bottom,
    the extra column at the right); groups >= 1 divides Cin and Cout. Out-of-range or mismatched
    arguments raise FuelGraphError when the call is built. Accumulates in float32 (float64 for
    float64). Differentiable in x, weight and bias, to any order."""
    op = "conv2d"
    kernel = _weight_kernel(op, weight)
    st, dil = _ints(op, "stride", stride, 2), _ints(op, "dilation", dilation, 2)
    pad = conv_padding(op, padding, kernel, st, dil)
    return call_fused(FusedOps.CONV2D, x, weight, *_bias(op, bias), stride=st, padding=pad,
                      dilation=dil, groups=groups)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1,
                     groups=1):
    """2-D transposed convolution, as torch.nn.functional.conv_transpose2d: the gradient of
    conv2d with respect to its input. Positional order as conv2d's (..., dilation, groups);
    torch puts groups before dilation, so pass those two by keyword when porting code.

    x [N, Cin, H, W]; weight [Cin, Cout/groups, Kh, Kw]; bias [Cout] or None; one float dtype
    -> [N, Cout, Ho, Wo] with Ho = (H-1)*sh - 2*ph + dh*(Kh-1) + oph + 1 (likewise Wo), which
    must be >= 1. stride, padding, output_padding and dilation: an int or a pair; padding >= 0
    crops the full output on both sides, output_padding (0 <= op < max(stride, dilation)) adds
    rows/columns at the bottom/right. groups divides Cin. Accumulates in float32 (float64 for
    float64). Differentiable in x, weight and bias, to any order."""
    op = "conv_transpose2d"
    _weight_kernel(op, weight)
    st, dil = _ints(op, "stride", stride, 2), _ints(op, "dilation", dilation, 2)
    ph, pw = _ints(op, "padding", padding, 2)
    return call_fused(FusedOps.CONV_TRANSPOSE2D, x, weight, *_bias(op, bias), stride=st,
                      padding=(ph, ph, pw, pw),
                      output_padding=_ints(op, "output_padding", output_padding, 2),
                      dilation=dil, groups=groups)


def causal_conv1d(x, weight, bias=None, use_silu=False):
    """Causal depthwise 1-D convolution (Mamba's conv; Dao-AILab causal_conv1d_fn).

    x [B, C, L] (L >= 1), unpadded: the op puts W-1 zeros before t = 0; weight [C, W] or
    [C, 1, W] (W >= 1); bias [C] or None; one float dtype -> [B, C, L] in it:
    z[b, c, t] = bias[c] + sum_{k<W} weight[c, k] * x[b, c, t + k - (W-1)], and
    y = silu(z) = z * sigmoid(z) when use_silu, else z. Any L >= 1 works, also L < W.
    Accumulates in float32 (float64 for float64). Differentiable in x, weight and bias."""
    op = "causal_conv1d"
    if not isinstance(use_silu, (bool, np.bool_)):
        raise FuelGraphError(f"{op}: use_silu must be a bool, got {use_silu!r}")
    return call_fused(FusedOps.CAUSAL_CONV1D, x, weight, *_bias(op, bias),
                      use_silu=bool(use_silu))


def conv2d_backward_weight(x, grad, kernel_size, stride=1, padding=0, dilation=1, groups=1):
    """Weight gradient of conv2d(x, w, stride, padding, dilation, groups) for the upstream
    gradient grad [N, Cout, Ho, Wo]: -> [Cout, Cin/groups, Kh, Kw] (kernel_size = (Kh, Kw)).
    padding: an int, a pair or the per-side (top, bottom, left, right)."""
    op = "conv2d_backward_weight"
    pad = tuple(padding) if isinstance(padding, (tuple, list)) and len(padding) == 4 else \
        (lambda p: (p[0], p[0], p[1], p[1]))(_ints(op, "padding", padding, 2))
    return call_fused(CONV2D_BACKWARD_WEIGHT, x, grad, stride=_ints(op, "stride", stride, 2),
                      padding=pad, dilation=_ints(op, "dilation", dilation, 2), groups=groups,
                      kernel_size=_ints(op, "kernel_size", kernel_size, 2))


def causal_conv1d_backward(x, weight, grad, bias=None, use_silu=False):
    """(dx, dweight, dbias) of causal_conv1d(x, weight, bias, use_silu) for the upstream
    gradient grad [B, C, L]; dbias [C] is returned also without a bias."""
    return call_fused(CAUSAL_CONV1D_BACKWARD, x, weight, grad,
                      *_bias("causal_conv1d_backward", bias), use_silu=bool(use_silu))

