"""Memory layout of buffers as the backends make them, predicted without running: element
strides of each view op's result (NumPy and torch agree on these rules), whether a reshape can
be a view or must copy, and how many distinct elements a (possibly broadcast) view reads."""
from __future__ import annotations

import math

from ..ir import ops


def c_strides(shape) -> tuple[int, ...]:
    """Element strides of a fresh row-major buffer of `shape`."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def is_contiguous(shape, strides) -> bool:
    """Row-major contiguous, ignoring the strides of size-1 axes (as NumPy and torch do)."""
    if math.prod(shape) == 0:
        return True
    want = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != want:
            return False
        want *= d
    return True


def unique_elements(shape, strides) -> int:
    """Elements a view actually holds: broadcast (stride-0) axes repeat the same memory."""
    return math.prod(d for d, s in zip(shape, strides) if s != 0 or d == 0)


def reshape_strides(shape, strides, new_shape) -> tuple[int, ...] | None:
    """Strides of `new_shape` viewing the same memory, or None when the reshape must copy
    (axes merged across a gap in memory)."""
    if is_contiguous(shape, strides):
        return c_strides(new_shape)
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    new = [d for d in new_shape if d != 1]
    out: list[int] = []
    i = j = 0
    while i < len(old) and j < len(new):
        i2, j2 = i + 1, j + 1
        po, pn = old[i][0], new[j]
        while po != pn:
            if po < pn:
                po *= old[i2][0]
                i2 += 1
            else:
                pn *= new[j2]
                j2 += 1
        for k in range(i, i2 - 1):        # the old axes of one group must be one run of memory
            if old[k][1] != old[k + 1][1] * old[k + 1][0]:
                return None
        st = old[i2 - 1][1]
        group = []
        for d in reversed(new[j:j2]):
            group.append(st)
            st *= d
        out += reversed(group)
        i, j = i2, j2
    it = iter(out)
    return tuple(next(it) if d != 1 else 0 for d in new_shape)


def view_strides(op, shape, strides) -> tuple[int, ...] | None:
    """Element strides of a view op's result given its input's; None when the op copies."""
    if isinstance(op, ops.Reshape):
        return reshape_strides(shape, strides, op.shape)
    if isinstance(op, ops.Permute):
        return tuple(strides[p] for p in op.perm)
    if isinstance(op, ops.BroadcastTo):
        return tuple(0 if a == 1 and b != 1 else s for a, b, s in zip(shape, op.shape, strides))
    if isinstance(op, ops.Slice):
        return tuple(s * k for s, k in zip(strides, op.steps))
    if isinstance(op, (ops.Bitcast, ops.Detach)):
        return tuple(strides)
    return None


def buffer_strides(buf) -> tuple[int, ...]:
    """Element strides of a concrete NumPy array or torch tensor."""
    st = getattr(buf, "stride", None)
    if callable(st):
        return tuple(st())
    return tuple(s // buf.itemsize for s in buf.strides) if buf.itemsize else (0,) * buf.ndim
