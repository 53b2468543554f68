"""CudaBackend: buffers are torch CUDA tensors; primitives run as torch ops, fused ops as the
kernels that the modules of `kernels/` declare (Triton, or cuBLAS/cuDNN through torch)."""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..base import elementwise_cost, import_kernel_modules, register_kernel
from . import primitives


class CudaBackend:
    name = "cuda"
    view_ops = primitives.VIEW_OPS

    def __init__(self):
        for op_cls, fn in primitives.PRIMITIVES.items():
            register_kernel(op_cls.__name__, "cuda", fn, cost=elementwise_cost, strided_input=True,
                            name=f"torch.{fn.__name__}")
        import_kernel_modules(f"{__package__}.kernels")

    @staticmethod
    def from_any(data, device):
        if isinstance(data, torch.Tensor):
            return data.to(device).contiguous()
        a = np.asarray(data, order="C")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
        return torch.from_numpy(a.copy()).to(device)

    @staticmethod
    def to_numpy(buf):
        t = buf.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    @staticmethod
    def contiguous(buf):
        return buf.contiguous()

    @staticmethod
    def is_contiguous(buf) -> bool:
        return buf.is_contiguous()

    @staticmethod
    def writable_copy_needed(buf) -> bool:
        return not buf.is_contiguous()

    @staticmethod
    def empty_like(buf):
        return torch.empty_like(buf, memory_format=torch.contiguous_format)

    @staticmethod
    def copy(buf):
        return buf.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def storage(buf):
        """Identity of the memory `buf` views."""
        return (buf.device.index, buf.untyped_storage().data_ptr())

    @staticmethod
    def storage_nbytes(buf) -> int:
        return int(buf.untyped_storage().nbytes())

    @staticmethod
    def capacity_bytes() -> int:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


@contextlib.contextmanager
def _graph_capture():
    """Kernels choose as under capture (kernels.common.GRAPH_CAPTURE) for the warm-up and the
    capture alike, so the capture records only kernels the warm-up already loaded."""
    from .kernels.common import GRAPH_CAPTURE
    before, GRAPH_CAPTURE[0] = GRAPH_CAPTURE[0], True
    try:
        yield
    finally:
        GRAPH_CAPTURE[0] = before


class GraphedPlan:
    """A plan captured into a CUDA graph: inputs are copied into static buffers, the graph is
    replayed (one launch for the whole plan instead of one host round per node) and outputs
    are cloned out of the graph's pool. Built after one eager run, so every Triton kernel is
    compiled before capture."""

    def __init__(self, plan, inputs):
        self.static_in = [b.clone() for b in inputs]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _graph_capture(), torch.cuda.stream(side):  # warm-up on a side stream, as capture
            plan.run(self.static_in)                     # requires, with its kernel choices
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _graph_capture(), torch.cuda.graph(self.graph):
            self.static_out = plan.run(self.static_in)

    def run(self, inputs):
        for dst, src in zip(self.static_in, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        return [o.clone() for o in self.static_out]


class GraphedStep:
    """A traced step (fuelgraph.jit) captured as a CUDA graph. The buffers of donated inputs
    (parameters and optimizer state updated in place) are the graph's own static buffers: a
    replay updates them where they are, with no copy in or out (a new value the plan computed
    elsewhere is copied back into that buffer). Persistent inputs that the step
    only reads (`persistent`: parameters of a decode step, constants) are captured where they
    are too, so a replay copies no weights; a state the plan computes into another buffer is
    copied back by the graph itself; `run` returns None when one of them has moved to
    another buffer since the capture, adding it to `moved` (capture again with it copied, as
    the other inputs are). Other inputs are copied into static buffers when their storage
    differs, and outputs other than the in-place results are cloned out of the graph's pool.
    `inplace_of`: output index -> the input index it overwrites."""

    def __init__(self, plan, bufs, inplace_of, persistent=(), moved=()):
        self.inplace_of = dict(inplace_of)
        own = set(self.inplace_of.values())
        self.moved = set(moved)
        self.persistent = [k for k in persistent if k not in own and k not in self.moved]
        keep = own | set(self.persistent)
        self.static_in = [b if k in keep else b.clone() for k, b in enumerate(bufs)]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _graph_capture(), torch.cuda.stream(side):  # warm-up on copies of what the step
            plan.run([b.clone() if k in own else b       # overwrites: it must not run twice
                      for k, b in enumerate(self.static_in)])
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with _graph_capture(), torch.cuda.graph(self.graph):
            self.static_out = plan.run(self.static_in)
            # states the plan computed elsewhere (no destructive op wrote them in place) are
            # copied back into their buffers by the graph itself: no host work per replay
            for j, k in self.inplace_of.items():
                if self.static_out[j].data_ptr() != self.static_in[k].data_ptr():
                    self.static_in[k].copy_(self.static_out[j])
        self.static_out = [self.static_in[self.inplace_of[j]] if j in self.inplace_of else o
                           for j, o in enumerate(self.static_out)]

    def replay_args(self, args, bufs, nres):
        """A replay where only the inputs at positions `args` may have new buffers (the others
        are known to be the captured ones: see fuelgraph.jit.Replayer) -> clones of the first
        `nres` outputs. An argument buffer given again (the same object: buffers are immutable
        values) is not copied again."""
        last = self.__dict__.setdefault("_last_src", {})
        for k in args:
            src = bufs[k]
            if last.get(k) is not src:
                dst = self.static_in[k]
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
                last[k] = src
        self.graph.replay()
        return [o.clone() for o in self.static_out[:nres]]

    def run(self, bufs):
        self.__dict__.pop("_last_src", None)       # copies of a normal run are not remembered
        moved = {k for k in self.persistent if self.static_in[k].data_ptr() != bufs[k].data_ptr()}
        if moved:
            self.moved |= moved
            return None
        for dst, src in zip(self.static_in, bufs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        out = []
        for j, o in enumerate(self.static_out):
            k = self.inplace_of.get(j)
            if k is None:
                out.append(o.clone())
                continue
            if o.data_ptr() != self.static_in[k].data_ptr():
                # a state the plan did not update in place (no destructive op wrote it): copied
                # back into its input buffer, where the next replay reads it without a copy-in
                self.static_in[k].copy_(o)
            out.append(self.static_in[k])
        return out
