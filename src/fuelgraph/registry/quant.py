"""Quantized matmuls: the weight is stored packed and dequantized on the fly.

* QMATMUL (id 14)     a @ W.T, W [N, K] given as the raw bytes of a GGUF tensor (ggml blocks
                      along K; formats Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K)
* NF4_MATMUL (id 21)  a @ W.T, W [N, K] as bitsandbytes NF4 codes (two per byte, the even
                      element in the HIGH nibble) times a float32 absmax per block of K
* AWQ_MATMUL (id 25)  a @ W, W [K, N] from AutoAWQ GEMM tensors: W = (q - z) * s
* QMATMUL_GRAD_A (0x140), NF4_MATMUL_GRAD_A (0x141), AWQ_MATMUL_GRAD_A (0x142): the gradient
  with respect to the activations, `g @ W` (g @ W.T for AWQ), emitted by the backward.

The activations `a [..., K]` may be any float dtype; the output `[..., N]` has a's dtype. The
packed weights are constants: gradients flow to `a` only. Every recipe dequantizes in
primitives to a float32 weight (bit-exact with the format's reference dequantizer), casts it to
a's dtype and runs one matmul over all rows of a; kernels keep the weight in float32 or
dequantize it in registers next to the MMA."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.tensor import const, stack
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .quant_gguf import FORMATS, dequantize_gguf_recipe, gguf_format
from .rules import check_arity, check_float

QMATMUL_GRAD_A = FusedOpId(0x140)
NF4_MATMUL_GRAD_A = FusedOpId(0x141)
AWQ_MATMUL_GRAD_A = FusedOpId(0x142)

#: bitsandbytes' NF4 code book (index -> value, float32); index 7 is exactly zero
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
#: per byte, the values of (high nibble = even element, low nibble = odd element)
NF4_BYTE_PAIRS = np.stack([NF4_CODE[np.arange(256) >> 4], NF4_CODE[np.arange(256) & 15]], 1)
#: AutoAWQ packs logical column 8c + e of a word into nibble AWQ_REVERSE_ORDER[e]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


# ---- params ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class QMatMulParams:
    """quant_type: GGUF format name (e.g. "Q4_K"); n, k: the weight's [N, K] (the builder
    always passes them; None infers k from the activations and n from the byte count, or for
    the gradient n from the incoming gradient and k from the byte count)."""
    quant_type: str = "Q4_0"
    n: int | None = None
    k: int | None = None


@dataclass(frozen=True)
class NF4Params:
    """block_size: elements of K sharing one absmax (bitsandbytes' blocksize, default 64)."""
    block_size: int = 64


@dataclass(frozen=True)
class AWQParams:
    """group_size: input channels (rows of K) sharing one zero and scale (AutoAWQ's q_group_size)."""
    group_size: int = 128


# ---- validation ------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _check_int_param(name, label, v, lo):
    if not _is_int(v) or v < lo:
        raise FuelGraphError(f"{name}: param {label} must be an integer >= {lo}, got {v!r}")


def _check_act(name, src, label, k):
    check_float(name, [src], labels=[label])
    if len(src.shape) < 1 or src.shape[-1] != k:
        raise FuelGraphError(f"{name}: {label} has shape {src.shape}, expected [..., {k}] "
                             f"(the weight's K = {k})")


def _check_dtype(name, src, label, want, what=""):
    if src.dtype != want:
        raise FuelGraphError(f"{name}: {label} has dtype {src.dtype.name}, expected "
                             f"{want.name}{what}")


def _check_shape(name, src, label, want, what=""):
    if tuple(src.shape) != tuple(want):
        raise FuelGraphError(f"{name}: {label} has shape {src.shape}, expected {tuple(want)}{what}")


def qmatmul_nk(quant_type: str, n, k, x_shape, w_size: int, grad: bool = False):
    """(n, k) of a validated qmatmul (grad: qmatmul_grad_a) call whose params may leave them
    None: k from the activations, n from the gradient, the other from the byte count."""
    fmt = FORMATS[quant_type]
    if grad and n is None:
        n = x_shape[-1]
    if not grad and k is None:
        k = x_shape[-1]
    if k is None:
        k = w_size // n // fmt.type_size * fmt.block
    if n is None:
        n = w_size // fmt.row_bytes(k)
    return n, k


def _qmatmul_dims(name, p, act, w, grad=False):
    """(format, n, k) of a qmatmul (grad: qmatmul_grad_a) call, checking every input."""
    fmt = gguf_format(p.quant_type, name)
    if fmt.name != p.quant_type:
        raise FuelGraphError(f"{name}: param quant_type {p.quant_type!r} is not a canonical "
                             f"format name; expected one of {list(FORMATS)}")
    for label, v in (("n", p.n), ("k", p.k)):
        if v is not None:
            _check_int_param(name, label, v, 1)
    _check_dtype(name, w, "w_bytes", dt.uint8, " (the raw GGUF tensor data)")
    size = int(np.prod(w.shape, dtype=np.int64))
    if len(act.shape) < 1:
        raise FuelGraphError(f"{name}: {'grad' if grad else 'a'} must have rank >= 1")
    n, k = p.n, p.k
    if grad and n is None:
        n = act.shape[-1]
    if not grad and k is None:
        k = act.shape[-1]
    if k is None:                                # grad: K from the byte count
        per_row = size // max(n, 1)
        k = per_row // fmt.type_size * fmt.block if per_row % fmt.type_size == 0 else -1
    if k <= 0 or k % fmt.block:
        raise FuelGraphError(f"{name}: K = {k} is not a positive multiple of the {fmt.name} "
                             f"block of {fmt.block} elements")
    if n is None:
        n = size // fmt.row_bytes(k)
    want = fmt.nbytes(n, k)
    if n < 1 or size != want:
        raise FuelGraphError(f"{name}: w_bytes holds {size} bytes, expected {want} = N {n} x "
                             f"(K {k} / {fmt.block}) blocks x {fmt.type_size} bytes of {fmt.name}")
    _check_act(name, act, "grad" if grad else "a", n if grad else k)
    return fmt, n, k


def _validate_qmatmul(srcs, p):
    check_arity("qmatmul", srcs, 2)
    _qmatmul_dims("qmatmul", p, srcs[0], srcs[1])


def _validate_qmatmul_grad(srcs, p):
    check_arity("qmatmul_grad_a", srcs, 2)
    _qmatmul_dims("qmatmul_grad_a", p, srcs[0], srcs[1], grad=True)


class _Meta:
    """Shape-and-dtype stand-in for the shape rule (the inputs were validated already)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _qmatmul_n(shapes, p):
    if p.n is not None:
        return p.n
    return _qmatmul_dims("qmatmul", p, _Meta(shapes[0], dt.float32),
                         _Meta(shapes[1], dt.uint8))[1]


def _qmatmul_k(shapes, p):
    if p.k is not None:
        return p.k
    return _qmatmul_dims("qmatmul_grad_a", p, _Meta(shapes[0], dt.float32),
                         _Meta(shapes[1], dt.uint8), grad=True)[2]


def _nf4_geometry(name, w, absmax, p):
    _check_int_param(name, "block_size", p.block_size, 1)
    _check_dtype(name, w, "w_packed", dt.uint8, " (two 4-bit codes per byte)")
    if len(w.shape) != 2:
        raise FuelGraphError(f"{name}: w_packed has shape {w.shape}, expected [N, K/2]")
    n, k = w.shape[0], 2 * w.shape[1]
    if n == 0:
        raise FuelGraphError(f"{name}: w_packed has shape {w.shape}: N must be >= 1")
    if k == 0 or k % p.block_size:
        raise FuelGraphError(f"{name}: K = {k} (2 x w_packed.shape[1]) is not a positive "
                             f"multiple of block_size {p.block_size}")
    _check_dtype(name, absmax, "absmax", dt.float32)
    _check_shape(name, absmax, "absmax", (n, k // p.block_size), " = [N, K / block_size]")
    return n, k


def _validate_nf4(srcs, p):
    name = "nf4_matmul"
    check_arity(name, srcs, 3)
    n, k = _nf4_geometry(name, srcs[1], srcs[2], p)
    _check_act(name, srcs[0], "a", k)


def _validate_nf4_grad(srcs, p):
    name = "nf4_matmul_grad_a"
    check_arity(name, srcs, 3)
    n, k = _nf4_geometry(name, srcs[1], srcs[2], p)
    _check_act(name, srcs[0], "grad", n)


def _awq_geometry(name, qweight, qzeros, scales, p):
    _check_int_param(name, "group_size", p.group_size, 1)
    for label, t in (("qweight", qweight), ("qzeros", qzeros)):
        _check_dtype(name, t, label, dt.int32, " (AutoAWQ packs 8 nibbles per int32)")
    if len(qweight.shape) != 2:
        raise FuelGraphError(f"{name}: qweight has shape {qweight.shape}, expected [K, N/8]")
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    if n == 0:
        raise FuelGraphError(f"{name}: qweight has shape {qweight.shape}: N / 8 must be >= 1")
    if k == 0 or k % p.group_size:
        raise FuelGraphError(f"{name}: K = {k} (qweight.shape[0]) is not a positive multiple of "
                             f"group_size {p.group_size}")
    g = k // p.group_size
    _check_shape(name, qzeros, "qzeros", (g, n // 8), " = [K / group_size, N / 8]")
    _check_dtype(name, scales, "scales", dt.float16)
    _check_shape(name, scales, "scales", (g, n), " = [K / group_size, N]")
    return n, k


def _validate_awq(srcs, p):
    name = "awq_matmul"
    check_arity(name, srcs, 4)
    n, k = _awq_geometry(name, *srcs[1:], p)
    _check_act(name, srcs[0], "a", k)


def _validate_awq_grad(srcs, p):
    name = "awq_matmul_grad_a"
    check_arity(name, srcs, 4)
    n, k = _awq_geometry(name, *srcs[1:], p)
    _check_act(name, srcs[0], "grad", n)


# ---- dequantization in primitives --------------------------------------------------------------
def dequantize_gguf(w_bytes, quant_type, n: int, k: int):
    """float32 [n, k] weight of raw GGUF bytes, in primitives (bit-exact with gguf-py)."""
    return dequantize_gguf_recipe(w_bytes.reshape(-1), gguf_format(quant_type), n, k)


def dequantize_nf4(w_packed, absmax, block_size: int = 64):
    """float32 [N, K] weight: NF4[code] * absmax[n, k // block_size], one rounding."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    vals = const(NF4_BYTE_PAIRS, device=w_packed.device).take(w_packed, 0)   # [N, K/2, 2]
    scale = absmax.reshape(n, k // block_size, 1).broadcast_to(n, k // block_size, block_size)
    return vals.reshape(n, k) * scale.reshape(n, k)


def _awq_unpack(packed):
    """int32 [R, C] packed along C with AutoAWQ's nibble order -> float32 codes [R, 8C]."""
    r, c = packed.shape
    shifts = const(np.array([4 * p for p in AWQ_REVERSE_ORDER], np.int32), device=packed.device)
    q = (packed.reshape(r, c, 1) >> shifts.reshape(1, 1, 8)) & 15
    return q.reshape(r, 8 * c).astype(dt.float32)


def _per_group(x, group_size):
    """[G, N] -> [G * group_size, N]: each group's row repeated over its K rows."""
    g, n = x.shape
    return x.reshape(g, 1, n).broadcast_to(g, group_size, n).reshape(g * group_size, n)


def dequantize_awq(qweight, qzeros, scales, group_size: int = 128):
    """float32 [K, N] weight (q - z) * s (exact in float32)."""
    q = _awq_unpack(qweight)
    z = _per_group(_awq_unpack(qzeros), group_size)
    s = _per_group(scales.astype(dt.float32), group_size)
    return (q - z) * s


# ---- recipes -----------------------------------------------------------------------------------
def _times(x, w, transpose: bool):
    """x [..., R] @ (w.T if transpose else w), w float32 cast to x's dtype; one matmul over all
    rows of x; result [..., C] in x's dtype."""
    w = w.astype(x.dtype)
    if transpose:
        w = w.mT
    rows = x.reshape(-1, x.shape[-1]) @ w
    return rows.reshape(x.shape[:-1] + (w.shape[-1],))


def qmatmul_recipe(a, w_bytes, quant_type="Q4_0", n=None, k=None):
    _, n, k = _qmatmul_dims("qmatmul", QMatMulParams(quant_type, n, k), a, w_bytes)
    return _times(a, dequantize_gguf(w_bytes, quant_type, n, k), True)


def qmatmul_grad_a_recipe(g, w_bytes, quant_type="Q4_0", n=None, k=None):
    _, n, k = _qmatmul_dims("qmatmul_grad_a", QMatMulParams(quant_type, n, k), g, w_bytes,
                            grad=True)
    return _times(g, dequantize_gguf(w_bytes, quant_type, n, k), False)


def nf4_matmul_recipe(a, w_packed, absmax, block_size):
    return _times(a, dequantize_nf4(w_packed, absmax, block_size), True)


def nf4_matmul_grad_a_recipe(g, w_packed, absmax, block_size):
    return _times(g, dequantize_nf4(w_packed, absmax, block_size), False)


def awq_matmul_recipe(a, qweight, qzeros, scales, group_size):
    return _times(a, dequantize_awq(qweight, qzeros, scales, group_size), False)


def awq_matmul_grad_a_recipe(g, qweight, qzeros, scales, group_size):
    return _times(g, dequantize_awq(qweight, qzeros, scales, group_size), True)


# ---- shape / dtype rules and backward ----------------------------------------------------------
def _out_shape(n_of):
    return lambda shapes, p: [tuple(shapes[0][:-1]) + (n_of(shapes, p),)]


def _act_dtype(dtypes, params):
    return [dtypes[0]]


class _WeightHasNoGradient:
    """Stands in a vjp's result for a packed-weight input: autograd reads a cotangent's dtype
    only when that input's gradient is actually needed (it was asked for, or something asked
    for depends on it), and then this raises, naming the op and the input."""

    def __init__(self, op, label):
        self.message = (f"{op}: {label} is part of the quantized weight, a constant: it has no "
                        f"gradient (the op is differentiable with respect to its activations "
                        f"only; detach it or do not ask for its gradient)")

    @property
    def dtype(self):
        raise FuelGraphError(self.message)

    shape = dtype


def _linear_vjp(other, weight_labels, op):
    """vjp of a product by a constant packed weight: the cotangent of input 0 is `other`
    (the product by the transposed weight) applied to the output cotangent; the weight
    inputs have none."""
    def vjp(xs, ys, gs, p):
        return [call_fused(other, gs[0], *xs[1:], **dataclasses.asdict(p))] + \
            [_WeightHasNoGradient(op, label) for label in weight_labels]
    return vjp


# ---- samples (registry-wide tests, pattern derivation) -----------------------------------------
def _sample_qmatmul(rng):
    w = rng.integers(0, 256, size=(3, 2 * 18), dtype=np.uint8)
    w[:, 0:2] = w[:, 18:20] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite d
    return [rng.standard_normal((2, 64)).astype(np.float32), w.reshape(-1)]


def _sample_qmatmul_grad(rng):
    a, w = _sample_qmatmul(rng)
    return [rng.standard_normal((2, 3)).astype(np.float32), w]


def _sample_nf4(rng):
    return [rng.standard_normal((2, 128)).astype(np.float32),
            rng.integers(0, 256, size=(3, 64), dtype=np.uint8),
            rng.uniform(0.5, 2.0, size=(3, 2)).astype(np.float32)]


def _sample_nf4_grad(rng):
    s = _sample_nf4(rng)
    return [rng.standard_normal((2, 3)).astype(np.float32)] + s[1:]


def _sample_awq(rng):
    return [rng.standard_normal((2, 128)).astype(np.float32),
            rng.integers(-2 ** 31, 2 ** 31, size=(128, 2), dtype=np.int64).astype(np.int32),
            rng.integers(-2 ** 31, 2 ** 31, size=(1, 2), dtype=np.int64).astype(np.int32),
            rng.uniform(0.01, 0.1, size=(1, 16)).astype(np.float16)]


def _sample_awq_grad(rng):
    s = _sample_awq(rng)
    return [rng.standard_normal((2, 16)).astype(np.float32)] + s[1:]


# ---- fusion patterns: the recipes and the idioms as people write them --------------------------
# Each op fuses from its recipe (so a lowered op fuses back) and from `a @ W.T` / `a @ W` over
# the dequantized weight for activations of any rank (the recipe flattens them to rows first).
# The packed weights are captured inputs; the GGUF format is one pattern per format (each with a
# sample of its own block size); n, k, block_size and group_size are read off the shapes. The
# NF4 idiom may also look its codes up in the 16-entry code book (a constant: a code book fed as
# an input could change under the cached plan, so it never fuses).
def _with_sample(fn, sample, name):
    def spelling(*xs, **params):
        return fn(*xs, **params)
    spelling.sample = sample
    spelling.__name__ = spelling.__qualname__ = name
    return spelling


def _batched(dequantize, transpose, check=None):
    """The idiom `a @ W.T` (transpose) or `a @ W` on the dequantized float32 weight, cast to
    a's dtype, for a of any rank >= 2 (a matmul broadcasting W over a's batch axes)."""
    def idiom(a, *weights, **params):
        if check is not None:
            check(a, *weights, **params)
        w = dequantize(*weights, **params).astype(a.dtype)
        return a @ (w.mT if transpose else w)
    return idiom


def _gguf_dequantize(w_bytes, quant_type="Q4_0", n=None, k=None):
    return dequantize_gguf(w_bytes, quant_type, n, k)


def _gguf_check(a, w_bytes, quant_type="Q4_0", n=None, k=None):
    if (n, k) != _qmatmul_dims("qmatmul", QMatMulParams(quant_type, n, k), a, w_bytes)[1:]:
        raise FuelGraphError("qmatmul: n, k do not fit the inputs")


def _gguf_sample(fmt, batch=()):
    """a [*batch, 2, 256] and the bytes of a [3, 256] weight in format `fmt`."""
    def sample(rng):
        return [np.zeros(batch + (2, 256), np.float32),
                np.zeros(fmt.nbytes(3, 256), np.uint8)]
    return sample


def _gguf_spellings():
    out = []
    for name, fmt in FORMATS.items():
        out.append((_with_sample(qmatmul_recipe, _gguf_sample(fmt), f"qmatmul_{name}_recipe"),
                    {"quant_type": name, "n": None, "k": None}))
        idiom = _batched(_gguf_dequantize, True, _gguf_check)
        out.append((_with_sample(idiom, _gguf_sample(fmt, (2,)), f"qmatmul_{name}_idiom"),
                    {"quant_type": name, "n": 3, "k": 256}))
    return tuple(out)


def _read_qmatmul(bound):
    """n and k of a matched qmatmul: the output's last axis and the activations' last axis."""
    return {"n": bound.root.shape[-1], "k": bound.capture(0).shape[-1]}


def dequantize_nf4_codebook(w_packed, absmax, block_size: int = 64):
    """The NF4 weight as people write it: split each byte into its two codes (high nibble
    first), look them up in the code book, scale each block by its absmax."""
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    codes = stack([w_packed >> 4, w_packed & 15], -1).reshape(n, k)
    vals = const(NF4_CODE, device=w_packed.device).take(codes, 0)
    return vals * absmax.repeat_interleave(block_size, 1)


def _nf4_sample(batch=()):
    def sample(rng):
        return [np.zeros(batch + (2, 128), np.float32), np.zeros((3, 64), np.uint8),
                np.ones((3, 2), np.float32)]
    return sample


_NF4_FIXED = {"block_size": 64}
_NF4_SPELLINGS = tuple(
    (_with_sample(fn, _nf4_sample(batch), name), _NF4_FIXED) for fn, batch, name in (
        (nf4_matmul_recipe, (), "nf4_matmul_recipe"),
        (_batched(dequantize_nf4, True), (2,), "nf4_matmul_idiom"),
        (_batched(dequantize_nf4_codebook, True), (), "nf4_codebook_idiom"),
        (_batched(dequantize_nf4_codebook, True), (2,), "nf4_codebook_idiom_batched")))


def _read_nf4(bound):
    """block_size: K over the absmax entries per row."""
    w, absmax = bound.capture(1).shape, bound.capture(2).shape
    per_row = int(np.prod(absmax)) // w[0]
    return {"block_size": 2 * w[1] // per_row if per_row else 0}


def _awq_sample(batch=()):
    """Two groups of 64 rows (one group would let canonicalization drop the group axis)."""
    def sample(rng):
        return [np.zeros(batch + (2, 128), np.float32), np.zeros((128, 2), np.int32),
                np.zeros((2, 2), np.int32), np.ones((2, 16), np.float16)]
    return sample


_AWQ_FIXED = {"group_size": 64}
_AWQ_SPELLINGS = tuple(
    (_with_sample(fn, _awq_sample(batch), name), _AWQ_FIXED) for fn, batch, name in (
        (awq_matmul_recipe, (), "awq_matmul_recipe"),
        (_batched(dequantize_awq, False), (2,), "awq_matmul_idiom")))


def _read_awq(bound):
    """group_size: K over the rows of scales."""
    k, scales = bound.capture(1).shape[0], bound.capture(3).shape
    groups = int(np.prod(scales)) // (8 * bound.capture(1).shape[1])
    return {"group_size": k // groups if groups else 0}


def declare(reg):
    gguf_doc = ", ".join(FORMATS)
    reg.add(FusedOpEntry(
        id=FusedOps.QMATMUL, name="qmatmul", family="quantized", params=QMatMulParams,
        shape_rule=_out_shape(_qmatmul_n), dtype_rule=_act_dtype,
        validate=_validate_qmatmul, decompose=qmatmul_recipe,
        backward=BackwardKind.fused(QMATMUL_GRAD_A),
        vjp=_linear_vjp(QMATMUL_GRAD_A, ("w_bytes",), "qmatmul"),
        pattern_variants=None, extra_patterns=_gguf_spellings(), read_params=_read_qmatmul,
        pattern_needs=(ops.Bitcast,),
        sample=_sample_qmatmul,
        doc=f"out = a @ W.T with W [N, K] given as raw GGUF bytes (uint8, N * K / QK blocks "
            f"along K; formats {gguf_doc}); a [..., K] any float dtype -> out [..., N] in a's "
            f"dtype. Dequantization is bit-exact with gguf-py. Params quant_type, n, k. "
            f"Differentiable in a only (backward: qmatmul_grad_a). Fuses from its recipe (every "
            f"format) and from a @ W.T over W dequantized by the format's recipe "
            f"(registry.quant.dequantize_gguf), a of any rank."))
    reg.add(FusedOpEntry(
        id=QMATMUL_GRAD_A, name="qmatmul_grad_a", family="backward", params=QMatMulParams,
        shape_rule=_out_shape(_qmatmul_k), dtype_rule=_act_dtype,
        validate=_validate_qmatmul_grad, decompose=qmatmul_grad_a_recipe,
        backward=BackwardKind.fused(FusedOps.QMATMUL),
        vjp=_linear_vjp(FusedOps.QMATMUL, ("w_bytes",), "qmatmul_grad_a"), pattern_variants=None, sample=_sample_qmatmul_grad,
        doc="Gradient of qmatmul with respect to a: grad [..., N] @ W -> [..., K] in grad's "
            "dtype (same params and w_bytes as the forward)."))
    reg.add(FusedOpEntry(
        id=FusedOps.NF4_MATMUL, name="nf4_matmul", family="quantized", params=NF4Params,
        shape_rule=_out_shape(lambda s, p: s[1][0]), dtype_rule=_act_dtype,
        validate=_validate_nf4, decompose=nf4_matmul_recipe,
        backward=BackwardKind.fused(NF4_MATMUL_GRAD_A),
        vjp=_linear_vjp(NF4_MATMUL_GRAD_A, ("w_packed", "absmax"), "nf4_matmul"),
        pattern_variants=None, extra_patterns=_NF4_SPELLINGS, read_params=_read_nf4,
        pattern_needs=(ops.Take,),
        sample=_sample_nf4,
        doc="out = a @ W.T, W[n, k] = NF4[code(n, k)] * absmax[n, k // block_size]; w_packed "
            "uint8 [N, K/2] (bitsandbytes order: element 2j in the high nibble of byte j, 2j+1 "
            "in the low), absmax float32 [N, K/block_size]; a [..., K] any float dtype -> "
            "[..., N] in a's dtype. Differentiable in a only (backward: nf4_matmul_grad_a). Fuses "
            "from its recipe and from a @ W.T over W = NF4[code] * absmax, the codes looked up "
            "per byte or per nibble (high first) in a constant code book, absmax repeated per "
            "block; a of any rank."))
    reg.add(FusedOpEntry(
        id=NF4_MATMUL_GRAD_A, name="nf4_matmul_grad_a", family="backward", params=NF4Params,
        shape_rule=_out_shape(lambda s, p: 2 * s[1][1]), dtype_rule=_act_dtype,
        validate=_validate_nf4_grad, decompose=nf4_matmul_grad_a_recipe,
        backward=BackwardKind.fused(FusedOps.NF4_MATMUL),
        vjp=_linear_vjp(FusedOps.NF4_MATMUL, ("w_packed", "absmax"), "nf4_matmul_grad_a"), pattern_variants=None, sample=_sample_nf4_grad,
        doc="Gradient of nf4_matmul with respect to a: grad [..., N] @ W -> [..., K]."))
    reg.add(FusedOpEntry(
        id=FusedOps.AWQ_MATMUL, name="awq_matmul", family="quantized", params=AWQParams,
        shape_rule=_out_shape(lambda s, p: 8 * s[1][1]), dtype_rule=_act_dtype,
        validate=_validate_awq, decompose=awq_matmul_recipe,
        backward=BackwardKind.fused(AWQ_MATMUL_GRAD_A),
        vjp=_linear_vjp(AWQ_MATMUL_GRAD_A, ("qweight", "qzeros", "scales"), "awq_matmul"),
        pattern_variants=None, extra_patterns=_AWQ_SPELLINGS, read_params=_read_awq,
        sample=_sample_awq,
        doc="out = a @ W, W[k, n] = (q - z) * s from AutoAWQ GEMM tensors: qweight int32 "
            "[K, N/8], qzeros int32 [K/G, N/8] (logical column 8c+e in nibble "
            "(0,4,1,5,2,6,3,7)[e] of word c), scales float16 [K/G, N], G = group_size; a "
            "[..., K] any float dtype -> [..., N] in a's dtype. Differentiable in a only. Fuses "
            "from its recipe and from a @ ((q - z) * s) unpacked as the recipe does, a of any "
            "rank."))
    reg.add(FusedOpEntry(
        id=AWQ_MATMUL_GRAD_A, name="awq_matmul_grad_a", family="backward", params=AWQParams,
        shape_rule=_out_shape(lambda s, p: s[1][0]), dtype_rule=_act_dtype,
        validate=_validate_awq_grad, decompose=awq_matmul_grad_a_recipe,
        backward=BackwardKind.fused(FusedOps.AWQ_MATMUL),
        vjp=_linear_vjp(FusedOps.AWQ_MATMUL, ("qweight", "qzeros", "scales"),
                        "awq_matmul_grad_a"), pattern_variants=None, sample=_sample_awq_grad,
        doc="Gradient of awq_matmul with respect to a: grad [..., N] @ W.T -> [..., K]."))


# ---- public builders ----------------------------------------------------------------------------
def _quant_type_name(quant_type) -> str:
    return gguf_format(quant_type, "qmatmul").name


def qmatmul(a, w_bytes, quant_type, n, k):
    """`a @ W.T` for a GGUF-quantized weight W [n, k].

    a: [..., k], any float dtype (float32, float64, bfloat16, float16).
    w_bytes: uint8, the tensor's raw GGUF data (any shape holding exactly
        n * (k / QK) * type_size bytes: N rows of K / QK blocks along K).
    quant_type: "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"
        (any case) or a gguf.GGMLQuantizationType. k must be a multiple of the block (32 for
        the first five, 256 for the K-quants).
    Returns [..., n] in a's dtype. The dequantized weight is bit-exact with
    gguf.quants.dequantize; 16-bit activations are multiplied in float32 or with the weight
    rounded to their dtype (tensor cores), accumulating in float32. Differentiable in a."""
    name = _quant_type_name(quant_type)
    if _is_int(w_bytes.ndim) and w_bytes.ndim != 1:
        w_bytes = w_bytes.reshape(-1)
    return call_fused(FusedOps.QMATMUL, a, w_bytes, quant_type=name, n=n, k=k)


def nf4_matmul(a, w_packed, absmax, block_size=64):
    """`a @ W.T` for an NF4 weight W [N, K] in bitsandbytes' layout.

    a: [..., K], any float dtype. w_packed: uint8 [N, K/2]; byte j of a row holds element 2j
    in its high nibble and 2j+1 in its low nibble (a bitsandbytes 4-bit tensor of an [N, K]
    weight, which it stores as [N*K/2, 1], reshaped to [N, K/2]). absmax: float32
    [N, K / block_size] (bitsandbytes' flat absmax reshaped; double-quantized absmax must be
    dequantized first). W[n, k] = NF4[code] * absmax[n, k // block_size]. K must be a positive
    multiple of block_size. Returns [..., N] in a's dtype. Differentiable in a."""
    return call_fused(FusedOps.NF4_MATMUL, a, w_packed, absmax, block_size=block_size)


def awq_matmul(a, qweight, qzeros, scales, group_size=128):
    """`a @ W` for an AutoAWQ (GEMM version) 4-bit weight W [K, N].

    a: [..., K], any float dtype. qweight: int32 [K, N/8]; qzeros: int32 [K/G, N/8]; both pack
    8 nibbles per word along N, logical column 8c + e in nibble (0, 4, 1, 5, 2, 6, 3, 7)[e] of
    word c (AutoAWQ's order 0,2,4,6,1,3,5,7). scales: float16 [K/G, N]. G = group_size (-1
    means one group over all of K). W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n], exact
    in float32. Returns [..., N] in a's dtype. Differentiable in a."""
    if _is_int(group_size) and group_size == -1 and len(qweight.shape) == 2:
        group_size = qweight.shape[0]
    return call_fused(FusedOps.AWQ_MATMUL, a, qweight, qzeros, scales, group_size=group_size)
