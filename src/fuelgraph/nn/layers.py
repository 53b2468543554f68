"""Layers with torch's constructors, parameter names, layouts and initializations (drawn from
fuelgraph's seeded generator: `fg.manual_seed` makes them reproducible)."""
from __future__ import annotations

import math

from .. import dtype as dt
from ..random import randn, rand
from . import functional as F
from .module import Module, Parameter


def _uniform(shape, bound, dtype, device):
    return (rand(shape, device=device) * (2.0 * bound) - bound).astype(dtype)


class Linear(Module):
    """y = x @ weight.T + bias; weight [out, in], both U(-1/sqrt(in), 1/sqrt(in)) (torch's)."""

    def __init__(self, in_features, out_features, bias=True, device="cpu", dtype=dt.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        b = 1.0 / math.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_uniform((out_features, in_features), b, dtype, device))
        self.bias = Parameter(_uniform((out_features,), b, dtype, device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


class Embedding(Module):
    """Rows of weight [num_embeddings, embedding_dim] ~ N(0, 1) picked by integer indices."""

    def __init__(self, num_embeddings, embedding_dim, device="cpu", dtype=dt.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(randn((num_embeddings, embedding_dim), device=device)
                                .astype(dtype))

    def forward(self, idx):
        return F.embedding(idx, self.weight)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}"


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (eps None: the dtype's epsilon)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device="cpu",
                 dtype=dt.float32):
        super().__init__()
        n = normalized_shape if isinstance(normalized_shape, int) else normalized_shape[-1]
        self.eps = eps
        self.weight = Parameter(_ones(n, dtype, device)) if elementwise_affine else None

    def forward(self, x):
        return F.rms_norm(x, None, self.weight, self.eps)


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device="cpu", dtype=dt.float32):
        super().__init__()
        n = normalized_shape if isinstance(normalized_shape, int) else normalized_shape[-1]
        self.eps = eps
        self.weight = Parameter(_ones(n, dtype, device)) if elementwise_affine else None
        self.bias = Parameter(_ones(n, dtype, device) * 0.0) if elementwise_affine and bias \
            else None

    def forward(self, x):
        return F.layer_norm(x, None, self.weight, self.bias, self.eps)


class Conv2d(Module):
    """2-D convolution, torch's layout: weight [out, in/groups, kh, kw], bias [out]."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, device="cpu", dtype=dt.float32):
        super().__init__()
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        fan_in = in_channels // groups * kh * kw
        b = 1.0 / math.sqrt(fan_in)
        self.weight = Parameter(_uniform((out_channels, in_channels // groups, kh, kw), b, dtype,
                                         device))
        self.bias = Parameter(_uniform((out_channels,), b, dtype, device)) if bias else None

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                        self.groups)


class Dropout(Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)


def _ones(n, dtype, device):
    from ..ir.tensor import ones
    return ones((n,), dtype, device)


class _Act(Module):
    fn = None

    def forward(self, x):
        return type(self).fn(x)


class ReLU(_Act): fn = staticmethod(F.relu)
class SiLU(_Act): fn = staticmethod(F.silu)
class Tanh(_Act): fn = staticmethod(F.tanh)
class Sigmoid(_Act): fn = staticmethod(F.sigmoid)
class Identity(_Act): fn = staticmethod(lambda x: x)


class GELU(Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, self.approximate)


class Flatten(Module):
    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return x.flatten(self.start_dim, self.end_dim)
