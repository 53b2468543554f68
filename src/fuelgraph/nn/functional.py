"""torch.nn.functional's names over fuelgraph's ops (`import fuelgraph.nn.functional as F`):
each is written with registry fused ops where one exists (linear, norms, cross-entropy,
softmax, RoPE) and with primitives otherwise. Ops that other families register later
(`fuelgraph.functional.flash_attn`, `conv2d`) are used when present."""
from __future__ import annotations

import math

from .. import dtype as dt
from .. import functional as _reg
from ..errors import FuelGraphError
from ..ir.tensor import Tensor, cat, matmul, where
from ..random import dropout as _dropout


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, weight [out, in] (torch's layout). With a bias it fuses into
    fused_linear; without one, the rows of x are one GEMM (so is the weight's gradient, with
    no batch of products to sum afterwards)."""
    if bias is not None:
        return x @ weight.mT + bias
    if x.ndim > 2:
        rows = x.reshape(-1, x.shape[-1]) @ weight.mT
        return rows.reshape(x.shape[:-1] + (weight.shape[0],))
    return x @ weight.mT


def embedding(idx: Tensor, weight: Tensor) -> Tensor:
    """Rows of `weight` [num, dim] picked by integer `idx` (any shape) -> idx.shape + (dim,)."""
    return weight.take(idx, 0)


def relu(x): return x.relu()
def silu(x): return x.silu()
def sigmoid(x): return x.sigmoid()
def tanh(x): return x.tanh()


def gelu(x, approximate: str = "none"):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + (math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
    return x.gelu()


def softmax(x, dim=-1):
    x = x._float()
    if dim in (-1, x.ndim - 1):
        return _reg.softmax_last_dim(x)
    return x.softmax(dim)


def log_softmax(x, dim=-1):
    return x._float().log_softmax(dim)


def dropout(x, p=0.5, training=True):
    return _dropout(x, p, training)


def rms_norm(x, normalized_shape=None, weight=None, eps=None):
    """RMS norm over the last axis (torch.nn.functional.rms_norm; eps None: the dtype's
    machine epsilon, as torch)."""
    if eps is None:
        eps = float(_finfo_eps(x.dtype))
    y = _reg.rms_norm_last_dim(x, eps)
    return y * weight if weight is not None else y


def layer_norm(x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
    y = _reg.layer_norm_last_dim(x, eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def _finfo_eps(d) -> float:
    import numpy as np
    return 2.0 ** -7 if d is dt.bfloat16 else float(np.finfo(d.np).eps)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean"):
    """Softmax cross-entropy over classes: logits [N, C] or [..., C] (class last, as the fused
    op; torch's [N, C, d...] layout is moved there), integer targets."""
    if logits.ndim > 2 and target.ndim == logits.ndim - 1 and target.shape[0] == logits.shape[0] \
            and target.shape[1:] == logits.shape[2:]:
        logits = logits.permute(0, *range(2, logits.ndim), 1)
    return _reg.fused_softmax_cross_entropy(logits, target.astype(dt.int64), reduction,
                                            ignore_index)


def mse_loss(x, y, reduction="mean"):
    d = (x - y)
    d = d * d
    return d.mean() if reduction == "mean" else d.sum() if reduction == "sum" else d


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(q @ k^T * scale + mask) @ v over [..., S, D] (heads-first, as torch; a causal
    mask is aligned to the top left). Uses the registry's flash attention when it applies (no
    explicit mask, 4-D, and as many queries as keys when causal); otherwise the scores are
    materialized (a softmax the optimizer fuses)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    fa = getattr(_reg, "flash_attn", None)
    # the fused op aligns a causal mask to the bottom right, torch to the top left: they agree
    # when there are as many queries as keys
    if fa is not None and attn_mask is None and q.ndim == 4 and \
            (not is_causal or q.shape[-2] == k.shape[-2]):
        return fa(q, k, v, softmax_scale=scale, causal=is_causal)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    s = matmul(q, k.mT) * scale
    if is_causal:
        sq, sk = q.shape[-2], k.shape[-2]
        mask = Tensor.tril(_ones_bool(sq, sk, q.device), 0)     # torch: top-left aligned
        s = where(mask, s, -math.inf)
    if attn_mask is not None:
        s = where(attn_mask, s, -math.inf) if attn_mask.dtype is dt.bool_ else s + attn_mask
    return matmul(softmax(s, -1).astype(v.dtype), v)


def _ones_bool(r, c, device):
    from ..ir.tensor import full
    return full((r, c), True, dt.bool_, device)


def rope(x, cos, sin, interleaved=False):
    return _reg.rope(x, cos, sin, interleaved)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """2-D cross-correlation as torch's. Uses the registry's conv2d when present; otherwise an
    im2col of slices and one matmul (groups=1, integer padding)."""
    fn = getattr(_reg, "conv2d", None)
    if fn is not None:
        return fn(x, weight, bias, stride, padding, dilation, groups)
    if groups != 1:
        raise FuelGraphError("conv2d: groups > 1 needs the conv family's fused op")
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    n, c, h, w = x.shape
    co, ci, kh, kw = weight.shape
    if ci != c:
        raise FuelGraphError(f"conv2d: weight {weight.shape} expects {ci} input channels, x has "
                             f"{c}")
    xp = x.pad([(0, 0), (0, 0), (ph, ph), (pw, pw)])
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = []
    for i in range(kh):
        for j in range(kw):
            cols.append(xp[:, :, i * dh: i * dh + sh * (ho - 1) + 1: sh,
                           j * dw: j * dw + sw * (wo - 1) + 1: sw])
    col = cat([t.unsqueeze(2) for t in cols], 2)              # [n, c, kh*kw, ho, wo]
    col = col.reshape(n, c * kh * kw, ho * wo)
    y = matmul(weight.reshape(co, c * kh * kw), col).reshape(n, co, ho, wo)
    return y + bias.reshape(1, co, 1, 1) if bias is not None else y
