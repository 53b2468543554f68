"""Modules, parameters and layers with torch.nn's names (`import fuelgraph.nn as nn`),
`fuelgraph.nn.functional` with torch.nn.functional's, and small model builders written in
primitives (the optimizer fuses their idioms)."""
from . import functional, utils
from .kv_cache import PagedKVCache
from .layers import (GELU, Conv2d, Dropout, Embedding, Flatten, Identity, LayerNorm, Linear,
                     ReLU, RMSNorm, Sigmoid, SiLU, Tanh)
from .module import Buffer, Module, ModuleDict, ModuleList, Parameter, Sequential
from .transformer import TinyBlock

__all__ = ["functional", "utils", "GELU", "Conv2d", "Dropout", "Embedding", "Flatten", "Identity",
           "LayerNorm", "Linear", "ReLU", "RMSNorm", "Sigmoid", "SiLU", "Tanh", "Buffer",
           "Module", "ModuleDict", "ModuleList", "Parameter", "Sequential", "PagedKVCache",
           "TinyBlock"]
