"""How much memory a plan will allocate, predicted before it runs, and measured when it does.

The prediction walks the plan's steps as `Plan.run` executes them: every non-view step
allocates its outputs; a view shares its input's storage (a reshape that cannot be a view
copies); a kernel that wants contiguous inputs gets a contiguous copy of each strided one, which
replaces the view in its slot (later readers reuse it; it is freed with the slot); a
destructive op overwrites its input when the plan proved that safe and nothing else reads that
storage (in-place reuse: nothing is allocated); a storage is freed
when the last slot reading it dies; a kernel's scratch memory counts while it runs where the
kernel declares it (`@kernel(workspace=...)`). Inputs and constants exist before the run and are
reported apart."""
from __future__ import annotations

import math
import tracemalloc
from dataclasses import dataclass, field

from ..backends import kernels_for
from ..backends.base import op_identity
from ..ir import ops
from .cost import op_flops
from .executor import compile_plan
from .strides import buffer_strides, c_strides, is_contiguous, unique_elements, view_strides

#: allocation granularity per backend: torch's CUDA caching allocator rounds blocks to 512 B
GRANULARITY = {"cuda": 512}


@dataclass
class MemoryPlan:
    """peak_bytes: most bytes the run holds at once beyond its inputs and constants (what the
    plan allocates); peak_step / peak_op: the step where it peaks; output_bytes: allocated
    outputs still alive after the run; timeline: live allocated bytes after each step;
    flops / bytes_moved: totals over the steps (contiguous copies included)."""
    peak_bytes: int
    peak_step: int
    peak_op: str
    output_bytes: int
    input_bytes: int
    const_bytes: int
    flops: float
    bytes_moved: float
    copies: int = 0
    inplace_reused: int = 0
    timeline: list = field(default_factory=list, repr=False)


class _Storage:
    __slots__ = ("nbytes", "refs", "owned", "writable")

    def __init__(self, nbytes, owned, writable=True):
        self.nbytes, self.refs, self.owned, self.writable = nbytes, 0, owned, writable


def _alloc_size(nbytes: int, gran: int) -> int:
    return -(-nbytes // gran) * gran if gran > 1 and nbytes else nbytes


def predict_memory(plan, inputs=None) -> MemoryPlan:
    """Simulate `plan`'s buffer lifetimes. `inputs`: the buffers `Plan.run` will get (for their
    strides and sharing); by default, distinct contiguous buffers."""
    types = plan.slot_types
    if not types:
        raise ValueError("plan has no slot types (built by an older build_plan)")
    be = plan.backend
    gran = GRANULARITY.get(be.name, 1)
    nb = lambda s: math.prod(types[s][0]) * types[s][1].itemsize   # noqa: E731
    store: dict[int, _Storage] = {}
    strides: dict[int, tuple] = {}
    input_bytes = const_bytes = 0
    by_buffer: dict[int, _Storage] = {}
    for k, slot in enumerate(plan.input_slots):
        if slot < 0:
            continue
        buf = inputs[k] if inputs is not None else None
        key = be.storage(buf) if buf is not None else ("input", k)
        st = by_buffer.get(key)
        if st is None:
            st = by_buffer[key] = _Storage(nb(slot), owned=False)
            input_bytes += nb(slot)
        store[slot] = st
        strides[slot] = buffer_strides(buf) if buf is not None else c_strides(types[slot][0])
    for slot, buf in plan.const_slots.items():
        st = _Storage(be.storage_nbytes(buf), owned=False, writable=False)
        const_bytes += st.nbytes
        store[slot], strides[slot] = st, buffer_strides(buf)
    for slot in store:
        store[slot].refs += 1

    cur = peak = 0
    peak_step, peak_op = -1, ""
    flops = moved = 0.0
    copies = reused = 0
    timeline = []

    def alloc(slot, shape):
        nonlocal cur
        st = _Storage(_alloc_size(nb(slot), gran), owned=True)
        st.refs = 1
        store[slot], strides[slot] = st, c_strides(shape)
        cur += st.nbytes

    for i, step in enumerate(plan.steps):
        op = step.op
        temp = 0
        in_shapes = [types[s][0] for s in step.srcs]
        in_dtypes = [types[s][1] for s in step.srcs]
        out_shapes = [types[s][0] for s in step.outs]
        if isinstance(op, be.view_ops) or isinstance(op, ops.Detach):
            src = step.srcs[0]
            vs = view_strides(op, in_shapes[0], strides[src])
            if vs is None:                              # a reshape that must copy
                alloc(step.outs[0], out_shapes[0])
                moved += 2 * nb(step.outs[0])
                copies += 1
            else:
                store[step.outs[0]], strides[step.outs[0]] = store[src], vs
                store[src].refs += 1
        else:
            if step.group:                              # products run together
                k = 0
                for j, (gop, nsrc) in enumerate(step.group):
                    flops += op_flops(gop, in_shapes[k:k + nsrc], in_dtypes[k:k + nsrc],
                                      out_shapes[j:j + 1], be.name)
                    k += nsrc
            else:
                flops += op_flops(op, in_shapes, in_dtypes, out_shapes, be.name)
            contig = [is_contiguous(types[s][0], strides[s]) for s in step.srcs]
            moved += sum(unique_elements(types[s][0], strides[s]) * types[s][1].itemsize
                         for s in step.srcs)
            moved += sum(nb(o) for o in step.outs)
            if step.contiguous:
                for k, s in enumerate(step.srcs):
                    if not is_contiguous(types[s][0], strides[s]):
                        # the slot itself takes the contiguous copy (Plan.run): it lives as
                        # long as the slot, later readers reuse it, and the view's storage
                        # loses this reader
                        old = store[s]
                        alloc(s, types[s][0])
                        old.refs -= 1
                        if old.refs == 0 and old.owned:
                            cur -= old.nbytes
                        moved += 2 * nb(s)
                        copies += 1
                        contig[k] = True
            outs = list(step.outs)
            done = set()
            # output j of a destructive op is written over its j-th destructive input
            for j, (k, static_copy) in enumerate(zip(step.inplace, step.copy_first)):
                if j >= len(outs):
                    break
                src = step.srcs[k]
                st = store[src]
                if (not static_copy and src in step.free and st.owned and st.writable
                        and st.refs == 1 and contig[k]):
                    store[outs[j]], strides[outs[j]] = st, strides[src]
                    st.refs += 1
                    reused += 1
                else:
                    alloc(outs[j], out_shapes[j])
                done.add(j)
            out_shapes = [sh for j, sh in enumerate(out_shapes) if j not in done]
            outs = [o for j, o in enumerate(outs) if j not in done]
            if isinstance(op, ops.Scan):
                temp += _scan_body_peak(op)
            else:
                temp += _workspace(be.name, step, in_shapes, in_dtypes)
            for o, shape in zip(outs, out_shapes):
                alloc(o, shape)
        if cur + temp > peak:
            peak, peak_step, peak_op = cur + temp, i, step.name or op.name
        for s in step.free:
            st = store.pop(s, None)
            if st is None:
                continue
            st.refs -= 1
            if st.refs == 0 and st.owned:
                cur -= st.nbytes
        timeline.append(cur)
    out_bytes = 0
    seen = set()
    for s in plan.output_slots:
        st = store.get(s)
        if st is not None and st.owned and id(st) not in seen:
            seen.add(id(st))
            out_bytes += st.nbytes
    return MemoryPlan(peak, peak_step, peak_op, out_bytes, input_bytes, const_bytes, flops,
                      moved, copies, reused, timeline)


def _workspace(backend: str, step, shapes, dtypes) -> int:
    """Scratch bytes the step's kernel declares (the kernel is found by the name the plan
    recorded for it)."""
    for k in kernels_for(op_identity(step.op), backend):
        if k.name == step.name and k.workspace is not None:
            params = step.op.params if isinstance(step.op, ops.Fused) else step.op
            return int(k.workspace(shapes, dtypes, params))
    return 0


def _scan_body_peak(op) -> int:
    """Peak of one iteration of a scan's body (its buffers die between iterations)."""
    body_plan, _ = compile_plan(list(op.body.outputs))
    return predict_memory(body_plan).peak_bytes


def measure_peak(plan, inputs) -> tuple[int, list]:
    """Run `plan` once on `inputs` and return (peak bytes allocated during the run beyond what
    was allocated before it, outputs). NumPy: tracemalloc (NumPy reports its data buffers to
    it), with the kernels' kept output blocks off for the run; CUDA: torch's caching-allocator
    statistics."""
    if plan.backend.name == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs = plan.run(inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, outs
    # the NumPy kernels' outputs come from blocks kept for reuse (backends/numpy/common.py):
    # measured without them, this is what the plan allocates, as the CUDA figure above counts
    # allocated bytes and not what torch's caching allocator keeps
    from ..backends.numpy import common as np_common
    was_tracing, recycle = tracemalloc.is_tracing(), np_common.RECYCLE
    if not was_tracing:
        tracemalloc.start()
    np_common.RECYCLE = False
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        outs = plan.run(inputs)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        np_common.RECYCLE = recycle
        if not was_tracing:
            tracemalloc.stop()
    return peak, outs

