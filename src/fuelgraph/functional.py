"""Public fused-op functions (`import fuelgraph.functional as F`). Each builds one fused node;
the optimizer runs it as a kernel or lowers it to its primitive recipe. Every builder is
written beside its op's declaration in `fuelgraph.registry.<family>`; this module re-exports
them."""
from .registry.affine import inplace_affine
from .registry.attention import flash_attn, flash_attn_backward
from .registry.collective import all_gather, all_reduce, reduce_scatter, replicate, shard
from .registry.conv import (causal_conv1d, causal_conv1d_backward, conv2d, conv2d_backward_weight,
                            conv_transpose2d)
from .registry.helpers import powi_backward, reduce_max_to_backward
from .registry.linear import fused_linear, silu_mul, silu_mul_backward
from .registry.loss import fused_linear_cross_entropy, fused_softmax_cross_entropy
from .registry.norm import (add_rms_norm, layer_norm_last_dim, layer_norm_last_dim_backward,
                            rms_norm_last_dim, rms_norm_last_dim_backward)
from .registry.paged import paged_attn, paged_cache_write, paged_cache_write_kv
from .registry.quant import awq_matmul, nf4_matmul, qmatmul
from .registry.rope import rope
from .registry.softmax import softmax_last_dim, softmax_last_dim_backward
from .registry.ssm import selective_scan, ssd_chunk_scan

__all__ = ["flash_attn", "flash_attn_backward", "all_gather", "all_reduce", "reduce_scatter",
           "replicate", "shard", "inplace_affine", "causal_conv1d",
           "causal_conv1d_backward", "conv2d", "conv2d_backward_weight", "conv_transpose2d",
           "powi_backward", "reduce_max_to_backward", "fused_linear", "silu_mul",
           "silu_mul_backward",
           "fused_softmax_cross_entropy", "fused_linear_cross_entropy",
           "add_rms_norm", "layer_norm_last_dim", "layer_norm_last_dim_backward",
           "rms_norm_last_dim", "rms_norm_last_dim_backward", "rope", "softmax_last_dim",
           "softmax_last_dim_backward", "selective_scan", "ssd_chunk_scan", "paged_attn",
           "paged_cache_write", "paged_cache_write_kv", "qmatmul", "nf4_matmul", "awq_matmul"]
