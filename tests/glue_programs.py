"""Random glue programs for the glue-kernel tests (NumPy and CUDA): a few inputs broadcastable to
one shape (0-d and size-1 axes included), then a chain of elementwise ops, casts, compares,
wheres and last-axis reductions whose results are broadcast back, reading earlier values at
random (so intermediates are read outside the regions too). Floats carry NaN, inf and -0.0."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import fuelgraph as fg

TARGETS = [(), (1,), (5,), (3, 4), (3, 1), (1, 4), (2, 3, 4), (2, 1, 5), (1, 1, 3), (4, 17)]
FLOAT_UNARY = ["neg", "abs", "exp", "tanh", "sin", "sqrt", "log", "floor", "sign", "rsqrt",
               "recip", "erf", "cos"]
DT = {"float32": fg.float32, "float64": fg.float64, "bfloat16": fg.bfloat16,
      "float16": fg.float16, "int32": fg.int32, "int64": fg.int64, "bool": fg.bool}


def _input_shape(draw, target):
    shape = list(target)
    for i in range(len(shape)):
        if draw(st.booleans()) and draw(st.booleans()):
            shape[i] = 1
    drop = draw(st.integers(0, len(shape)))
    return tuple(shape[drop:])


def _data(draw, shape, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "bool":
        return rng.random(shape) < 0.5
    if kind in ("int32", "int64"):
        return rng.integers(-20, 20, shape).astype(kind)
    a = (rng.standard_normal(shape) * 2.0).astype(np.float32)
    if a.size and draw(st.booleans()):
        flat = a.reshape(-1)
        for v in draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 0.0]),
                               max_size=3)):
            flat[rng.integers(0, flat.size)] = v
    return a.astype(DT[kind].np)


@st.composite
def glue_program(draw, kind="float32", max_ops=8, reductions=True):
    """(list of output Tensors, description) of a random program over `kind` inputs."""
    target = draw(st.sampled_from(TARGETS))
    seed = draw(st.integers(0, 2 ** 16))
    n_in = draw(st.integers(1, 3))
    pool = [fg.tensor(_data(draw, _input_shape(draw, target), kind, seed + i))
            for i in range(n_in)]
    desc = [f"inputs {[tuple(p.shape) for p in pool]} {kind}"]
    is_float = kind not in ("int32", "int64", "bool")
    for _ in range(draw(st.integers(2, max_ops))):
        a = draw(st.sampled_from(pool))
        b = draw(st.sampled_from(pool))
        choice = draw(st.integers(0, 11))
        y, what = _step(draw, a, b, choice, kind, is_float, reductions)
        if y is None:
            continue
        pool.append(y)
        desc.append(what)
    outs = [pool[-1]]
    if len(pool) > n_in + 1 and draw(st.booleans()):
        outs.append(pool[draw(st.integers(n_in, len(pool) - 2))])
    return outs, "; ".join(desc)


def _step(draw, a, b, choice, kind, is_float, reductions):
    if kind == "bool":
        op = draw(st.sampled_from(["and", "or", "xor", "eq", "ne", "where"]))
        if op == "where":
            return fg.where(a, b, a ^ b), "where"
        return {"and": a & b, "or": a | b, "xor": a ^ b, "eq": a == b, "ne": a != b}[op], op
    if choice <= 2 and is_float:
        op = draw(st.sampled_from(FLOAT_UNARY))
        return getattr(a, {"recip": "reciprocal"}.get(op, op))(), op
    if choice <= 5:
        ops_ = ["add", "sub", "mul", "maximum", "minimum"]
        ops_ += ["div"] if is_float else ["floordiv", "rem", "and", "or", "xor"]
        op = draw(st.sampled_from(ops_))
        f = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
             "maximum": lambda: a.maximum(b), "minimum": lambda: a.minimum(b),
             "div": lambda: a / b, "floordiv": lambda: a // b, "rem": lambda: a % b,
             "and": lambda: a & b, "or": lambda: a | b, "xor": lambda: a ^ b}[op]
        return f(), op
    if choice == 6:
        c = draw(st.sampled_from([0.5, -2.0, 3.0, 1e30])) if is_float else \
            draw(st.sampled_from([2, -3, 7]))
        return (a * c if draw(st.booleans()) else a + c), f"scalar {c}"
    if choice == 7:
        cmp = draw(st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]))
        cond = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b,
                "ne": a != b}[cmp]
        return fg.where(cond, a, b), f"where({cmp})"
    if choice == 8:
        if is_float:
            other = draw(st.sampled_from(["int32", "bool", kind]))
            if other == "int32":        # float -> int of NaN/inf/huge is undefined: clamp first
                x = fg.where(a.abs() < 1000.0, a, 0.0)
                return x.astype(fg.int32).astype(a.dtype), "cast int32"
            if other == "bool":
                return a.astype(fg.bool).astype(a.dtype) * a, "cast bool"
            return (a.astype(fg.float32) * 1.5).astype(a.dtype), "cast f32 roundtrip"
        return (a.astype(fg.float32) * 0.5).astype(fg.int32).astype(a.dtype), "cast float"
    if choice >= 9 and reductions and a.ndim >= 1:
        op = draw(st.sampled_from(["sum", "max", "min"] if is_float else ["sum", "max"]))
        r = getattr(a, op)(-1, keepdim=True)
        r = r.astype(a.dtype)
        return a - r if not is_float or draw(st.booleans()) else a * r, f"row {op}"
    return None, ""
