"""Shape, dtype and validation rules shared by many entries (each entry names the ones it uses)."""
from __future__ import annotations

from ..dtype import FLOATS
from ..errors import FuelGraphError


def same_as_input0(shapes_or_dtypes, params):
    return [shapes_or_dtypes[0]]


def check_arity(name, srcs, *counts):
    if len(srcs) not in counts:
        want = " or ".join(map(str, counts))
        raise FuelGraphError(f"{name}: expected {want} inputs, got {len(srcs)}")


def check_float(name, srcs, which=None, labels=None):
    for i in (range(len(srcs)) if which is None else which):
        d = srcs[i].dtype
        if d not in FLOATS:
            label = labels[i] if labels else f"input {i}"
            raise FuelGraphError(f"{name}: {label} has dtype {d.name}, expected one of "
                                 f"{[f.name for f in FLOATS]}")


def check_same_dtype(name, srcs, which, labels):
    d0 = srcs[which[0]].dtype
    for i in which[1:]:
        if srcs[i].dtype != d0:
            raise FuelGraphError(f"{name}: {labels[i]} has dtype {srcs[i].dtype.name}, expected "
                                 f"{d0.name} (same as {labels[which[0]]})")


def check_rank(name, src, label, min_rank):
    if len(src.shape) < min_rank:
        raise FuelGraphError(f"{name}: {label} has shape {src.shape}, expected rank >= {min_rank}")


def check_same_shape(name, srcs, labels):
    for i in range(1, len(srcs)):
        if srcs[i].shape != srcs[0].shape:
            raise FuelGraphError(f"{name}: {labels[i]} has shape {srcs[i].shape}, expected "
                                 f"{srcs[0].shape} (same as {labels[0]})")


def unary_float_rowwise(name, min_last=0):
    """validate for ops over `x [..., n]` (rank >= 1, float, n >= min_last)."""
    def validate(srcs, params):
        check_arity(name, srcs, 1)
        check_float(name, srcs, labels=["x"])
        check_rank(name, srcs[0], "x", 1)
        if srcs[0].shape[-1] < min_last:
            raise FuelGraphError(f"{name}: x has shape {srcs[0].shape}, expected a last "
                                 f"dimension >= {min_last}")
    return validate


def pair_float_rowwise(name, labels=("x", "grad"), min_last=0, min_rank=1):
    """validate for helpers over two same-shaped float tensors `[..., n]`."""
    def validate(srcs, params):
        check_arity(name, srcs, 2)
        check_float(name, srcs, labels=labels)
        check_rank(name, srcs[0], labels[0], min_rank)
        check_same_shape(name, srcs, labels)
        check_same_dtype(name, srcs, (0, 1), labels)
        if min_last and srcs[0].shape[-1] < min_last:
            raise FuelGraphError(f"{name}: {labels[0]} has shape {srcs[0].shape}, expected a "
                                 f"last dimension >= {min_last}")
    return validate


def real_param(v):
    """A plain float for real numbers (params are hashed); anything else is left for the op's
    validation to reject with a clear error."""
    import numbers
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v
