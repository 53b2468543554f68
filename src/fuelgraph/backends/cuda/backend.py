"""CudaBackend: buffers are torch CUDA tensors; primitives run as torch ops, fused ops as
Triton kernels (kernels/), GEMM-shaped ops through cuBLAS (torch.addmm / baddbmm)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ... import dtype as dt
from ...registry.core import FusedOps as F
from ..base import Cost, elementwise_cost, register_kernel
from . import kernels as K
from . import primitives


def _gemm(a, b, bias):
    """a [..., M, K] @ b [K, N] or [..., K, N] + bias [N] through cuBLAS with bias epilogue."""
    if b.dim() == 2:
        out = torch.addmm(bias, a.reshape(-1, a.shape[-1]), b)
        return out.reshape(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    out = torch.baddbmm(bias.expand(a3.shape[0], a3.shape[1], b3.shape[2]), a3, b3)
    return out.reshape(*batch, a.shape[-2], b.shape[-1])


def _gemm_cost(shapes, params=None):
    a, b = shapes[0], shapes[1]
    m = math.prod(a[:-1])
    return Cost(2 * m * a[-1] * b[-1], 2 * (math.prod(a) + math.prod(b) + m * b[-1]))


def _row_cost(flops):
    def cost(shapes, params=None):
        n = sum(math.prod(s) for s in shapes)
        return Cost(flops * n, 2 * 2 * n)
    return cost


FUSED = [
    (F.SOFTMAX_LAST_DIM, K.softmax_last_dim, 4),
    (F.SOFTMAX_LAST_DIM_BACKWARD, K.softmax_last_dim_backward, 4),
    (F.RMS_NORM_LAST_DIM, K.rms_norm_last_dim, 4),
    (F.LAYER_NORM_LAST_DIM, K.layer_norm_last_dim, 6),
    (F.RMS_NORM_LAST_DIM_BACKWARD, K.rms_norm_last_dim_backward, 6),
    (F.LAYER_NORM_LAST_DIM_BACKWARD, K.layer_norm_last_dim_backward, 8),
    (F.ROPE, K.rope, 3),
    (F.REDUCE_MAX_TO_BACKWARD, K.reduce_max_to_backward, 4),
    (F.POWI_BACKWARD, K.powi_backward, 4),
    (F.INPLACE_AFFINE, K.inplace_affine, 2),
]
# the Triton cross-entropy keeps its log-sum-exp in float32: float64 logits run the recipe
CE = [(F.FUSED_SOFTMAX_CROSS_ENTROPY, K.fused_softmax_cross_entropy, 6),
      (("fused", "fused_softmax_cross_entropy_backward"), K.fused_softmax_cross_entropy_backward, 6)]
HALF_AND_F32 = (dt.float32, dt.bfloat16, dt.float16)


class CudaBackend:
    name = "cuda"
    view_ops = primitives.VIEW_OPS

    def __init__(self):
        for op_cls, fn in primitives.PRIMITIVES.items():
            register_kernel(op_cls.__name__, "cuda", fn, cost=elementwise_cost, strided_input=True,
                            name=f"torch.{fn.__name__}")
        for op_id, fn, flops in FUSED:
            register_kernel(op_id, "cuda", fn, cost=_row_cost(flops), name=f"triton.{fn.__name__}")
        for op_id, fn, flops in CE:
            register_kernel(op_id, "cuda", fn, cost=_row_cost(flops), dtypes=HALF_AND_F32,
                            name=f"triton.{fn.__name__}")
        register_kernel(F.FUSED_LINEAR, "cuda", _gemm, cost=_gemm_cost, name="cublas.addmm",
                        precision="fp32 accumulate")

    @staticmethod
    def from_any(data, device):
        if isinstance(data, torch.Tensor):
            return data.to(device).contiguous()
        a = np.ascontiguousarray(data)
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
        with torch.cuda.stream(side):       # warm-up on a side stream, as capture requires
            plan.run(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = plan.run(self.static_in)

    def run(self, inputs):
        for dst, src in zip(self.static_in, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        return [o.clone() for o in self.static_out]
