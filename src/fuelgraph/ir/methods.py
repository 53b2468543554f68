"""The torch-named tensor API, built from the primitive basis only (no new primitive): torch's
keywords (`dim=`, `keepdim=`), comparisons and selections (clamp, argmax, topk, sort, any,
isnan, ...), scans (cumsum), movement (split, chunk, tril, repeat_interleave, ...), einsum and
functional index assignment. Everything here is differentiable where torch's is, through the
primitives' own gradient rules (values picked by `sort`/`topk` are gathered, so their
gradient is scattered back to the positions they came from).

Imported by `ir/tensor.py`, which binds these functions onto `Tensor`."""
from __future__ import annotations

import functools
import math
from collections import namedtuple
from typing import Sequence

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from .tensor import (Tensor, _as_index, arange, broadcast_shapes, broadcast_tensors, cat, full,
                     iota, matmul, stack, tensor, where, zeros)

ValuesIndices = namedtuple("ValuesIndices", ["values", "indices"])
_NO = object()


# ---- torch keywords ---------------------------------------------------------------------------
def _accept_dim(fn, axis_kw="axis"):
    """Let `fn(self, axis, ...)` also be called as torch does, with `dim=`."""
    @functools.wraps(fn)
    def wrapped(self, *args, dim=_NO, **kw):
        if dim is not _NO:
            if args or axis_kw in kw:
                raise FuelGraphError(f"{fn.__name__}: the axis is given twice (dim= and axis)")
            kw[axis_kw] = dim
        return fn(self, *args, **kw)
    return wrapped


def _extremum(kind):
    """max/min: `x.max()` the scalar, `x.max(axis)` the values (NumPy style, as before),
    `x.max(dim=d)` torch's (values, indices) pair, `x.max(other_tensor)` the elementwise
    maximum (torch.max(a, b))."""
    reduce = Tensor._reduce

    def fn(self, axis=None, keepdim=False, *, dim=_NO):
        if isinstance(axis, Tensor):
            return self.maximum(axis) if kind == "max" else self.minimum(axis)
        if dim is not _NO:
            if axis is not None:
                raise FuelGraphError(f"{kind}: the axis is given twice (dim= and axis)")
            values = reduce(self, kind, dim, keepdim)
            idx = _arg(self, kind, dim, keepdim)
            return ValuesIndices(values, idx)
        return reduce(self, kind, axis, keepdim)
    fn.__name__ = kind
    fn.__doc__ = _extremum.__doc__.replace("max", kind)
    return fn


# ---- selection ---------------------------------------------------------------------------------
def _isnan(self) -> Tensor:
    """True where the value is NaN (always False for integer and bool tensors)."""
    if not self.dtype.is_float:
        return full(self.shape, False, dt.bool_, self.device)
    return self != self


def _isinf(self) -> Tensor:
    if not self.dtype.is_float:
        return full(self.shape, False, dt.bool_, self.device)
    return self.abs() == math.inf


def _isfinite(self) -> Tensor:
    if not self.dtype.is_float:
        return full(self.shape, True, dt.bool_, self.device)
    return (self - self) == 0.0


def _arg(self, kind, dim=None, keepdim=False) -> Tensor:
    """Index (int64) of the first maximum (minimum) along `dim`; over the flattened tensor
    when dim is None. NaN counts as the maximum and the minimum, as in torch."""
    x = self
    if dim is None:
        x = x.reshape(-1)
        d = 0
    else:
        d = x._axes(dim, f"arg{kind}")[0]
    n = x.shape[d]
    if n == 0:
        raise FuelGraphError(f"arg{kind}: cannot reduce an empty axis of shape {self.shape}")
    if x.dtype is dt.bool_:
        x = x.astype(dt.int32)
    m = x._reduce(kind, d, True)
    hit = x == m
    if x.dtype.is_float:
        hit = hit | (_isnan(x) & _isnan(m))
    pos = iota(n, dt.int64, x.device).reshape((n,) + (1,) * (x.ndim - d - 1))
    idx = where(hit, pos, n).min(d, keepdim=True)
    if dim is None:
        return idx.reshape(()) if not keepdim else idx.reshape((1,) * self.ndim)
    return idx if keepdim else idx.squeeze(d)


def argmax(self, dim=None, keepdim=False) -> Tensor:
    """Index of the first maximum along `dim` (of the flattened tensor when dim is None)."""
    return _arg(self, "max", dim, keepdim)


def argmin(self, dim=None, keepdim=False) -> Tensor:
    """Index of the first minimum along `dim` (of the flattened tensor when dim is None)."""
    return _arg(self, "min", dim, keepdim)


def clamp(self, min=None, max=None) -> Tensor:  # noqa: A002  (torch's names)
    """Elementwise min(max(x, min), max); bounds are scalars or broadcastable tensors. The
    gradient passes where min <= x <= max; NaN stays NaN."""
    if min is None and max is None:
        raise FuelGraphError("clamp: at least one of min and max must be given")
    y = self
    if min is not None:
        y = where(y < min, min, y)
    if max is not None:
        y = where(y > max, max, y)
    return y


def _sort_order(x: Tensor, d: int, descending: bool) -> Tensor:
    """Indices (int64) that sort x stably along axis d: a bitonic network of compare-exchange
    steps on (key, index) pairs, log2(n)*(log2(n)+1)/2 elementwise stages over the axis padded
    to a power of two (NaN sorts as the largest value, as in torch)."""
    x = x.detach()
    n = x.shape[d]
    if n == 0:
        return full(x.shape, 0, dt.int64, x.device)
    x = x.transpose(d, -1) if d != x.ndim - 1 else x
    lead = x.shape[:-1]
    p = 1 << (n - 1).bit_length()
    if x.dtype is dt.bool_:
        x = x.astype(dt.int32)
    # rank orders before the key: numbers, then NaN (first when descending), then padding
    if x.dtype.is_float:
        nan = _isnan(x)
        key = where(nan, 0, x)
        rank = nan.astype(dt.int32)
        if descending:
            rank = 1 - rank
    else:
        key, rank = x, full(x.shape, 0, dt.int32, x.device)
    if descending:
        key = -key if key.dtype.kind != "u" else (~key)
    if p != n:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, p - n)]
        key = key.pad(pad, 0)
        rank = rank.pad(pad, 2)
    idx = iota(p, dt.int64, x.device).broadcast_to(lead + (p,))
    key = key.broadcast_to(lead + (p,))
    rank = rank.broadcast_to(lead + (p,))
    k = 2
    while k <= p:
        j = k // 2
        while j >= 1:
            # pair element i with i ^ j: view the axis as [p/(2j), 2, j]
            shp = lead + (p // (2 * j), 2, j)
            blk = iota(p // (2 * j), dt.int64, x.device) * (2 * j)
            up = ((blk & k) == 0).reshape((p // (2 * j), 1))   # ascending blocks
            parts = [t.reshape(shp) for t in (key, idx, rank)]
            a = [t[..., 0, :] for t in parts]
            b = [t[..., 1, :] for t in parts]
            gt = (a[2] > b[2]) | ((a[2] == b[2]) & ((a[0] > b[0]) |
                                                 ((a[0] == b[0]) & (a[1] > b[1]))))
            swap = where(up, gt, ~gt)
            new = []
            for ta, tb in zip(a, b):
                lo = where(swap, tb, ta)
                hi = where(swap, ta, tb)
                new.append(stack([lo, hi], -2).reshape(lead + (p,)))
            key, idx, rank = new
            j //= 2
        k *= 2
    idx = idx[..., :n]
    return idx.transpose(d, -1) if d != x.ndim - 1 else idx


def sort(self, dim=-1, descending=False, stable=False) -> ValuesIndices:
    """(values, indices) sorted along `dim`, ascending unless `descending`; equal values keep
    their order (the sort is always stable). NaN sorts last ascending, first descending, as
    in torch. Differentiable in the values (the gradient goes back to where each came from)."""
    d = self._axes(dim, "sort")[0] if self.ndim else 0
    if self.ndim == 0:
        return ValuesIndices(self, full((), 0, dt.int64, self.device))
    idx = _sort_order(self, d, descending)
    return ValuesIndices(self.gather(d, idx), idx)


def argsort(self, dim=-1, descending=False, stable=False) -> Tensor:
    return sort(self, dim, descending, stable).indices


def topk(self, k, dim=-1, largest=True, sorted=True) -> ValuesIndices:  # noqa: A002
    """(values, indices) of the k largest (smallest) entries along `dim`, ordered largest
    (smallest) first; ties keep the lower index first. Differentiable in the values."""
    d = self._axes(dim, "topk")[0]
    n = self.shape[d]
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= n:
        raise FuelGraphError(f"topk: k={k!r} out of range for an axis of size {n}")
    if k <= 8 and k < n:
        # k passes of argmax: cheaper than a full sort for small k
        x = self.detach()
        if x.dtype is dt.bool_:
            x = x.astype(dt.int32)
        if not largest:
            x = -x if x.dtype.kind != "u" else ~x
        pos = iota(n, dt.int64, self.device).reshape((n,) + (1,) * (self.ndim - d - 1))
        low = -math.inf if x.dtype.is_float else int(np.iinfo(x.dtype.np).min)
        picks = []
        for _ in range(k):
            i = _arg(x, "max", d, True)
            picks.append(i)
            x = where(pos == i, low, x)
        idx = cat(picks, d)
    else:
        idx = _sort_order(self, d, largest)
        sl = [slice(None)] * self.ndim
        sl[d] = slice(0, k)
        idx = idx[tuple(sl)]
    return ValuesIndices(self.gather(d, idx), idx)


def any_(self, dim=None, keepdim=False) -> Tensor:
    """True where any element along `dim` (all of them when None) is nonzero."""
    return (self != 0).astype(dt.int32)._reduce("max", dim, keepdim) > 0 if self.ndim else \
        (self != 0)


def all_(self, dim=None, keepdim=False) -> Tensor:
    """True where every element along `dim` (all of them when None) is nonzero."""
    return (self != 0).astype(dt.int32)._reduce("min", dim, keepdim) > 0 if self.ndim else \
        (self != 0)


def masked_fill(self, mask, value) -> Tensor:
    """`value` where `mask` (bool, broadcastable) is True, else self; keeps self's dtype."""
    mask = self._lift(mask) if not isinstance(mask, Tensor) else mask
    if mask.dtype is not dt.bool_:
        raise FuelGraphError(f"masked_fill: mask must be bool, got {mask.dtype.name}")
    v = value if isinstance(value, Tensor) else self._lift(value)
    return where(mask, v.astype(self.dtype), self)


# ---- scans ----------------------------------------------------------------------------------------
def _scan(x: Tensor, d: int, combine, identity) -> Tensor:
    """Inclusive scan along axis d by doubling (Hillis-Steele): log2(n) steps, each combining
    the running value with itself shifted by 2^k (the shifted-in edge holds `identity`)."""
    n = x.shape[d]
    s = 1
    while s < n:
        pads = [(0, 0)] * x.ndim
        pads[d] = (s, -s)
        x = combine(x, x.pad(pads, identity))
        s *= 2
    return x


def cumsum(self, dim, dtype=None) -> Tensor:
    """Running sum along `dim`; integer and bool inputs sum in int64 (torch's rule)."""
    d = self._axes(dim, "cumsum")[0] if self.ndim else 0
    x = self.astype(dtype) if dtype is not None else \
        (self if self.dtype.is_float else self.astype(dt.int64))
    if x.ndim == 0:
        return x
    return _scan(x, d, lambda a, b: a + b, 0)


def cumprod(self, dim, dtype=None) -> Tensor:
    """Running product along `dim`."""
    d = self._axes(dim, "cumprod")[0] if self.ndim else 0
    x = self.astype(dtype) if dtype is not None else \
        (self if self.dtype.is_float else self.astype(dt.int64))
    if x.ndim == 0:
        return x
    return _scan(x, d, lambda a, b: a * b, 1)


def logsumexp(self, dim, keepdim=False) -> Tensor:
    x = self._float()
    m = x.detach().max(dim, keepdim=True)
    m = where(_isinf(m), 0.0, m)
    r = (x - m).exp().sum(dim, keepdim=True).log() + m
    return r if keepdim else r.squeeze(x._axes(dim, "logsumexp"))


# ---- movement ---------------------------------------------------------------------------------------
def split(self, split_size_or_sections, dim=0) -> tuple:
    """Pieces along `dim`: of `split_size` each (the last may be smaller), or of the given
    section sizes (which must add up to the axis)."""
    d = self._axes(dim, "split")[0]
    n = self.shape[d]
    if isinstance(split_size_or_sections, (int, np.integer)):
        s = int(split_size_or_sections)
        if s <= 0:
            raise FuelGraphError(f"split: split_size must be positive, got {s}")
        sizes = [min(s, n - i) for i in range(0, n, s)] or [0]
    else:
        sizes = [int(v) for v in split_size_or_sections]
        if sum(sizes) != n or any(v < 0 for v in sizes):
            raise FuelGraphError(f"split: sections {sizes} do not add up to the axis size {n}")
    out, off = [], 0
    for s in sizes:
        sl = [slice(None)] * self.ndim
        sl[d] = slice(off, off + s)
        out.append(self[tuple(sl)])
        off += s
    return tuple(out)


def chunk(self, chunks, dim=0) -> tuple:
    """Split into `chunks` pieces of ceil(n / chunks) along `dim` (fewer when n is small)."""
    if not isinstance(chunks, (int, np.integer)) or chunks <= 0:
        raise FuelGraphError(f"chunk: chunks must be a positive int, got {chunks!r}")
    n = self.shape[self._axes(dim, "chunk")[0]]
    return split(self, max(1, -(-n // int(chunks))), dim)


def unbind(self, dim=0) -> tuple:
    d = self._axes(dim, "unbind")[0]
    return tuple(p.squeeze(d) for p in split(self, 1, d))


def _tri(self, diagonal, lower) -> Tensor:
    if self.ndim < 2:
        raise FuelGraphError(f"{'tril' if lower else 'triu'}: needs at least 2 dims, got "
                             f"{self.shape}")
    r, c = self.shape[-2:]
    i = iota(r, dt.int64, self.device).reshape(r, 1)
    j = iota(c, dt.int64, self.device).reshape(1, c)
    keep = (j - i <= diagonal) if lower else (j - i >= diagonal)
    return where(keep, self, full((), 0, self.dtype, self.device))


def tril(self, diagonal=0) -> Tensor:
    """Lower triangle of the last two dims (j - i <= diagonal kept, the rest zero)."""
    return _tri(self, int(diagonal), True)


def triu(self, diagonal=0) -> Tensor:
    """Upper triangle of the last two dims (j - i >= diagonal kept, the rest zero)."""
    return _tri(self, int(diagonal), False)


def repeat_interleave(self, repeats, dim=None) -> Tensor:
    """Repeat each element `repeats` times along `dim` (of the flattened tensor when None);
    `repeats` is an int or a per-element list of ints (known when the graph is built)."""
    x = self.reshape(-1) if dim is None else self
    d = 0 if dim is None else x._axes(dim, "repeat_interleave")[0]
    if isinstance(repeats, Tensor):
        repeats = repeats.numpy() if repeats.ndim else int(repeats.item())
    if isinstance(repeats, (int, np.integer)):
        r = int(repeats)
        if r < 0:
            raise FuelGraphError(f"repeat_interleave: repeats must be >= 0, got {r}")
        y = x.unsqueeze(d + 1)
        y = y.broadcast_to(y.shape[:d + 1] + (r,) + y.shape[d + 2:])
        return y.reshape(x.shape[:d] + (x.shape[d] * r,) + x.shape[d + 1:])
    reps = np.asarray(repeats, dtype=np.int64).reshape(-1)
    if reps.shape[0] != x.shape[d] or (reps < 0).any():
        raise FuelGraphError(f"repeat_interleave: repeats {reps.tolist()} must give one count "
                             f">= 0 per element of the axis of size {x.shape[d]}")
    return x.take(tensor(np.repeat(np.arange(x.shape[d]), reps), device=x.device), d)


def repeat(self, *sizes) -> Tensor:
    """Tile: repeat the whole tensor `sizes[i]` times along axis i (torch's `repeat`)."""
    sizes = tuple(int(s) for s in (sizes[0] if len(sizes) == 1 and
                                   isinstance(sizes[0], (tuple, list)) else sizes))
    if len(sizes) < self.ndim:
        raise FuelGraphError(f"repeat: needs at least {self.ndim} sizes, got {sizes}")
    x = self.reshape((1,) * (len(sizes) - self.ndim) + self.shape)
    inter = tuple(v for s, n in zip(sizes, x.shape) for v in (1, n))
    y = x.reshape(inter).broadcast_to(tuple(v for s, n in zip(sizes, x.shape) for v in (s, n)))
    return y.reshape(tuple(s * n for s, n in zip(sizes, x.shape)))


def expand(self, *sizes) -> Tensor:
    """Broadcast to `sizes`; -1 keeps an axis' size (torch's `expand`)."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
    lead = len(sizes) - self.ndim
    if lead < 0:
        raise FuelGraphError(f"expand: {len(sizes)} sizes for a tensor of shape {self.shape}")
    shape = tuple(self.shape[i - lead] if s == -1 and i >= lead else int(s)
                  for i, s in enumerate(sizes))
    return self.broadcast_to(shape)


def narrow(self, dim, start, length) -> Tensor:
    d = self._axes(dim, "narrow")[0]
    sl = [slice(None)] * self.ndim
    sl[d] = slice(start, start + length)
    return self[tuple(sl)]


def unflatten(self, dim, sizes) -> Tensor:
    d = self._axes(dim, "unflatten")[0]
    sizes = tuple(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes = tuple(self.shape[d] // known if s == -1 else s for s in sizes)
    return self.reshape(self.shape[:d] + sizes + self.shape[d + 1:])


def outer(self, other) -> Tensor:
    """Outer product of two 1-D tensors: out[i, j] = self[i] * other[j]."""
    other = self._lift(other)
    if self.ndim != 1 or other.ndim != 1:
        raise FuelGraphError(f"outer: needs two 1-D tensors, got {self.shape} and {other.shape}")
    return self.reshape(-1, 1) * other.reshape(1, -1)


def norm(self, p=2, dim=None, keepdim=False) -> Tensor:
    x = self._float()
    if p == 2 or p == "fro":
        return (x * x).sum(dim, keepdim).sqrt()
    if p == 1:
        return x.abs().sum(dim, keepdim)
    if p == math.inf:
        return x.abs().max(dim, keepdim)
    return (x.abs() ** float(p)).sum(dim, keepdim) ** (1.0 / p)


def std(self, dim=None, keepdim=False, correction=1, unbiased=None) -> Tensor:
    if unbiased is not None:
        correction = 1 if unbiased else 0
    return self._float().var(dim, keepdim, correction).sqrt()


# ---- functional index assignment -------------------------------------------------------------
def index_put(self, indices, values, accumulate=False) -> Tensor:
    """A new tensor equal to self with `values` written at `indices` (torch's index_put, out of
    place): indices is a tuple of integer index tensors for the leading axes (broadcast
    together), values broadcast to the indexed shape. With accumulate=True values add up
    (repeated indices add every time); otherwise a repeated index takes the sum of its values
    (torch leaves that case undefined)."""
    if isinstance(indices, Tensor) or not isinstance(indices, (tuple, list)):
        indices = (indices,)
    idx = [_as_index(i, self.device, "index_put") for i in indices]
    if any(i.dtype is dt.bool_ for i in idx) or not idx:
        raise FuelGraphError("index_put: indices must be integer tensors (use masked_fill or "
                             "where for boolean masks)")
    k = len(idx)
    if k > self.ndim:
        raise FuelGraphError(f"index_put: {k} index tensors for a tensor of shape {self.shape}")
    idx = broadcast_tensors(*idx, op="index_put")
    lead, rest = self.shape[:k], self.shape[k:]
    flat = None
    for i, (t, n) in enumerate(zip(idx, lead)):
        t = where(t < 0, t + n, t)
        flat = t if flat is None else flat * n + t
    flat = flat.reshape(-1)
    m = flat.shape[0]
    rows = self.reshape((math.prod(lead),) + rest)
    v = self._lift(values) if not isinstance(values, Tensor) else values
    v = v.astype(self.dtype).broadcast_to(idx[0].shape + rest).reshape((m,) + rest)
    index = flat.reshape((m,) + (1,) * len(rest)).broadcast_to((m,) + rest)
    if accumulate:
        out = rows.scatter_add(0, index, v)
    else:
        wide = self.dtype if self.dtype.is_float else dt.int64
        hit = zeros(rows.shape, dt.int32, self.device).scatter_add(
            0, index, full((m,) + rest, 1, dt.int32, self.device)) > 0
        put = zeros(rows.shape, wide, self.device).scatter_add(0, index, v.astype(wide))
        out = where(hit, put.astype(self.dtype), rows)
    return out.reshape(self.shape)


def with_item(self, idx, value) -> Tensor:
    """The value `self[idx] = value` gives, as a new tensor (`__setitem__` rebinds self to it).
    idx: a bool mask (broadcast from the leading axes), or anything `__getitem__` accepts."""
    if isinstance(idx, Tensor) and idx.dtype is dt.bool_:
        mask = idx.reshape(idx.shape + (1,) * (self.ndim - idx.ndim)) if idx.ndim < self.ndim \
            else idx
        return masked_fill(self, mask, value)
    pos = arange(self.numel(), dtype=dt.int64, device=self.device).reshape(self.shape)[idx]
    v = self._lift(value) if not isinstance(value, Tensor) else value
    v = v.astype(self.dtype).broadcast_to(pos.shape)
    flat = self.reshape(-1)
    wide = self.dtype if self.dtype.is_float else dt.int64
    p = pos.reshape(-1)
    hit = zeros(flat.shape, dt.int32, self.device).scatter_add(
        0, p, full(p.shape, 1, dt.int32, self.device)) > 0
    put = zeros(flat.shape, wide, self.device).scatter_add(0, p, v.reshape(-1).astype(wide))
    return where(hit, put.astype(self.dtype), flat).reshape(self.shape)


def _setitem(self, idx, value):
    """`x[idx] = value`: x becomes a new value (tensors are values: other tensors computed from
    the old x keep it; `x` itself now reads the update). See `with_item`."""
    self._inplace(with_item(self, idx, value), "setitem")


# ---- einsum ----------------------------------------------------------------------------------------
def einsum(equation: str, *operands) -> Tensor:
    """Einstein summation, as torch.einsum / numpy.einsum: 'ij,jk->ik', implicit output (the
    indices seen once, in alphabetical order), '...' for broadcast batch dims, repeated
    indices within one operand (diagonals). Operands contract left to right, each pair as one
    batched matmul."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    specs = lhs.split(",")
    if len(specs) != len(operands):
        raise FuelGraphError(f"einsum: {len(specs)} operand specs in {equation!r} for "
                             f"{len(operands)} operands")
    ts = list(operands)
    ell_rank = 0
    for s, t in zip(specs, ts):
        if not isinstance(t, Tensor):
            raise FuelGraphError(f"einsum: operands must be Tensors, got {type(t).__name__}")
        n_letters = len(s.replace("...", ""))
        if "..." in s:
            ell_rank = max(ell_rank, t.ndim - n_letters)
        elif n_letters != t.ndim:
            raise FuelGraphError(f"einsum: spec {s!r} has {n_letters} indices for an operand "
                                 f"of shape {t.shape}")
    ell = [chr(0x100 + i) for i in range(ell_rank)]   # private letters for '...' axes
    terms = []
    for s, t in zip(specs, ts):
        letters = list(s.replace("...", "|"))
        if "|" in letters:
            k = t.ndim - (len(letters) - 1)
            at = letters.index("|")
            letters[at:at + 1] = ell[ell_rank - k:]
        terms.append((letters, t))
    if arrow:
        out_l = list(out.replace("...", "|"))
        if "|" in out_l:
            at = out_l.index("|")
            out_l[at:at + 1] = ell
    else:
        counts: dict = {}
        for letters, _ in terms:
            for c in letters:
                counts[c] = counts.get(c, 0) + 1
        out_l = ell + sorted(c for c, k in counts.items() if k == 1 and c not in ell)
    for c in out_l:
        if not any(c in letters for letters, _ in terms):
            raise FuelGraphError(f"einsum: output index {c!r} appears in no operand")
    terms = [_diagonal(letters, t) for letters, t in terms]
    sizes: dict = {}
    for letters, t in terms:
        for c, n in zip(letters, t.shape):
            if sizes.get(c, n) != n and n != 1 and sizes.get(c) != 1:
                raise FuelGraphError(f"einsum: index {c!r} has sizes {sizes[c]} and {n}")
            sizes[c] = max(sizes.get(c, 1), n)
    cur_l, cur = terms[0]
    for k, (letters, t) in enumerate(terms[1:], 1):
        later = set(out_l) | {c for ls, _ in terms[k + 1:] for c in ls}
        cur_l, cur = _contract(cur_l, cur, letters, t, later)
    # sum indices not in the output, then order as the output
    gone = [i for i, c in enumerate(cur_l) if c not in out_l]
    if gone:
        cur = cur.sum(tuple(gone))
        cur_l = [c for c in cur_l if c in out_l]
    if not cur_l:
        return cur
    return cur.permute(*[cur_l.index(c) for c in out_l])


def _diagonal(letters, t):
    """Take the diagonal of repeated indices within one operand ('ii->i')."""
    letters = list(letters)
    while len(set(letters)) < len(letters):
        c = next(c for c in letters if letters.count(c) > 1)
        i = letters.index(c)
        j = letters.index(c, i + 1)
        n = t.shape[i]
        rest = [a for a in range(t.ndim) if a not in (i, j)]
        t = t.permute(*rest, i, j).reshape(tuple(t.shape[a] for a in rest) + (n * n,))
        t = t[..., ::n + 1]
        letters = [letters[a] for a in rest] + [c]
    return letters, t


def _contract(la, a, lb, b, later):
    """One pairwise contraction as a batched matmul: batch = shared indices kept, contracted =
    shared indices not needed later; indices of one operand not needed later are summed
    first."""
    def presum(ls, t, other):
        drop = [i for i, c in enumerate(ls) if c not in later and c not in other]
        if drop:
            t = t.sum(tuple(drop))
            ls = [c for i, c in enumerate(ls) if i not in drop]
        return ls, t
    la, a = presum(la, a, lb)
    lb, b = presum(lb, b, la)
    batch = [c for c in la if c in lb and c in later]
    con = [c for c in la if c in lb and c not in later]
    ra = [c for c in la if c not in lb]
    rb = [c for c in lb if c not in la]

    def arrange(ls, t, order):
        return t.permute(*[ls.index(c) for c in order]) if order != ls else t
    a = arrange(la, a, batch + ra + con)
    b = arrange(lb, b, batch + con + rb)
    nb = len(batch)
    bshape = broadcast_shapes(a.shape[:nb], b.shape[:nb], op="einsum")
    ka = math.prod(a.shape[nb + len(ra):]) if con else 1
    a2 = a.reshape(a.shape[:nb] + (math.prod(a.shape[nb:nb + len(ra)]), ka))
    b2 = b.reshape(b.shape[:nb] + (ka, math.prod(b.shape[nb + len(con):])))
    if con and a2.shape[-1] != b2.shape[-2]:
        raise FuelGraphError(f"einsum: contracted indices {con} have different sizes")
    out = matmul(a2, b2)
    shape = bshape + a.shape[nb:nb + len(ra)] + b.shape[nb + len(con):]
    return batch + ra + rb, out.reshape(shape)


# ---- conversions and small helpers ----------------------------------------------------------------
def _clone(self) -> Tensor:
    """A new handle on the same value (tensors are values, so nothing is copied: in-place
    updates of either handle leave the other alone). Gradients flow through."""
    return Tensor(self.value)


METHODS = {
    "sum": _accept_dim(Tensor.sum), "prod": _accept_dim(Tensor.prod),
    "mean": _accept_dim(Tensor.mean), "var": _accept_dim(Tensor.var),
    "amax": _accept_dim(Tensor.max), "amin": _accept_dim(Tensor.min),
    "max": _extremum("max"), "min": _extremum("min"),
    "softmax": _accept_dim(Tensor.softmax), "log_softmax": _accept_dim(Tensor.log_softmax),
    "flip": _accept_dim(Tensor.flip), "squeeze": _accept_dim(Tensor.squeeze),
    "unsqueeze": _accept_dim(Tensor.unsqueeze), "gather": _accept_dim(Tensor.gather),
    "scatter_add": _accept_dim(Tensor.scatter_add), "flatten": Tensor.flatten,
    "argmax": argmax, "argmin": argmin, "clamp": clamp, "clip": clamp, "sort": sort,
    "argsort": argsort, "topk": topk, "any": any_, "all": all_, "isnan": _isnan,
    "isinf": _isinf, "isfinite": _isfinite, "masked_fill": masked_fill, "cumsum": cumsum,
    "cumprod": cumprod, "logsumexp": logsumexp, "split": split, "chunk": chunk,
    "unbind": unbind, "tril": tril, "triu": triu, "repeat_interleave": repeat_interleave,
    "repeat": repeat, "expand": expand, "narrow": narrow, "unflatten": unflatten,
    "outer": outer, "norm": norm, "std": std, "index_put": index_put, "with_item": with_item,
    "__setitem__": _setitem, "clone": _clone,
    "float": lambda self: self.astype(dt.float32),
    "double": lambda self: self.astype(dt.float64),
    "half": lambda self: self.astype(dt.float16),
    "bfloat16": lambda self: self.astype(dt.bfloat16),
    "long": lambda self: self.astype(dt.int64), "int": lambda self: self.astype(dt.int32),
    "bool": lambda self: self.astype(dt.bool_),
    "type_as": lambda self, other: self.astype(other.dtype),
    "view_as": lambda self, other: self.reshape(other.shape),
    "reshape_as": lambda self, other: self.reshape(other.shape),
    "expand_as": lambda self, other: self.broadcast_to(other.shape),
    "t": lambda self: self.transpose(0, 1) if self.ndim == 2 else self,
    "matmul": lambda self, other: matmul(self, self._lift(other)),
    "mm": lambda self, other: matmul(self, other), "bmm": lambda self, other: matmul(self, other),
    "ceil": lambda self: -((-self._float()).floor()),
    "trunc": lambda self: where(self._float() < 0, -((-self._float()).floor()),
                                self._float().floor()),
    "log1p": lambda self: (1.0 + self._float()).log(),
    "expm1": lambda self: self._float().exp() - 1.0,
    "logical_not": lambda self: (self != 0) ^ True,
    "logical_and": lambda self, o: (self != 0) & (self._lift(o) != 0),
    "logical_or": lambda self, o: (self != 0) | (self._lift(o) != 0),
    "eq": lambda self, o: self == o, "ne": lambda self, o: self != o,
    "lt": lambda self, o: self < o, "le": lambda self, o: self <= o,
    "gt": lambda self, o: self > o, "ge": lambda self, o: self >= o,
    "new_zeros": lambda self, *s, dtype=None: full(_size(s), 0, dtype or self.dtype, self.device),
    "new_ones": lambda self, *s, dtype=None: full(_size(s), 1, dtype or self.dtype, self.device),
    "new_full": lambda self, s, v, dtype=None: full(_size((s,)), v, dtype or self.dtype,
                                                    self.device),
}


def _size(s) -> tuple:
    return tuple(s[0]) if len(s) == 1 and isinstance(s[0], (tuple, list)) else tuple(s)


def _inplace_op(fn):
    def method(self, *a, **kw):
        return self._inplace(fn(self, *a, **kw))
    return method


INPLACE = {
    "__iadd__": lambda self, o: self + o, "__isub__": lambda self, o: self - o,
    "__imul__": lambda self, o: self * o, "__itruediv__": lambda self, o: self / o,
    "add_": lambda self, o, alpha=1: self + (o * alpha if alpha != 1 else o),
    "sub_": lambda self, o, alpha=1: self - (o * alpha if alpha != 1 else o),
    "mul_": lambda self, o: self * o, "div_": lambda self, o: self / o,
    "zero_": lambda self: full(self.shape, 0, self.dtype, self.device),
    "fill_": lambda self, v: full(self.shape, v, self.dtype, self.device)
    if not isinstance(v, Tensor) else v.broadcast_to(self.shape),
    "copy_": lambda self, src: src if isinstance(src, Tensor) else self._lift(src),
    "clamp_": clamp, "masked_fill_": masked_fill,
}


def install() -> None:
    for name, fn in METHODS.items():
        setattr(Tensor, name, fn)
    for name, fn in INPLACE.items():
        setattr(Tensor, name, _inplace_op(fn))
    Tensor.data = property(lambda self: self.detach(),
                           lambda self, v: self._inplace(v, "data"),
                           doc="The value without gradient history; assigning sets the value "
                               "(as `copy_`).")


def _default_inplace(self, new, op="in-place"):
    """Lazy rebind (the public layer replaces this with the full rule for leaves)."""
    self.value = new.astype(self.dtype).broadcast_to(self.shape).value
    return self


Tensor._inplace = _default_inplace
install()


__all__ = ["einsum", "ValuesIndices", "argmax", "argmin", "clamp", "sort", "topk", "cumsum",
           "split", "chunk", "tril", "triu", "outer", "index_put", "with_item"]


def _unused(_: Sequence) -> None:   # keep linters quiet about typing imports
    return None
