"""Tensor parallelism, Megatron style: each process holds a slice of every large weight and
computes its part of each layer; two collectives per block (one after attention, one after the
MLP) make the results whole again.

* `ColumnParallelLinear`: the output features are split (weight rows, bias). The input is the
  same on every process (its gradient is summed over the group: `replicate`); the output is
  this process's block of the features, or all of them with `gather_output`.
* `RowParallelLinear`: the input features are split (weight columns). Each process multiplies
  its block of the input (a column-parallel layer's output) and the partial products are summed
  over the group (`all_reduce`); the bias is added once, after the sum.
* Head-parallel attention: q, k and v projections column-parallel (each process gets whole
  heads: the features of a head are contiguous), the attention itself on this process's heads
  (the module's head counts divided by the group size: `Heads`), the output projection
  row-parallel. A SiLU-gated MLP: gate and up column-parallel, down row-parallel.

`parallelize(model, plan)` converts a model built from `fuelgraph.nn` layers in place
(`llama_plan()` is the plan of `fuelgraph.models.LlamaForCausalLM`), e.g. for a Llama-style
model whose blocks hold `wq, wk, wv, wo, gate, up, down` and head counts `heads` and
`kv_heads`:

    parallelize(model, {"blocks.*.w[qkv]": "column", "blocks.*.wo": "row",
                        "blocks.*.gate": "column", "blocks.*.up": "column",
                        "blocks.*.down": "row", "blocks.*": Heads("heads", "kv_heads"),
                        "head": "column_gather"})
    load_sharded(model, "full.safetensors")      # each process reads only its slices

Everything else (embeddings, norms) stays replicated: its gradients are already the same on
every process, because the collectives' backward rules sum the per-process contributions
where the forward split the work (see `fuelgraph.registry.collective`). The logits equal those
of the single-device model; so do the gradients of every weight (of its slice)."""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from ..checkpoint import _FROM_CODE
from ..errors import FuelGraphError
from ..ir.tensor import Tensor
from ..nn import functional as F
from ..nn.layers import Linear, _uniform
from ..nn.module import Module, Parameter
from ..registry.collective import all_gather, all_reduce, group_info, replicate, shard


@dataclass(frozen=True)
class Column:
    """Plan style: split a Linear's output features; `gather=True` all-gathers the output."""
    gather: bool = False


@dataclass(frozen=True)
class Row:
    """Plan style: split a Linear's input features and sum the partial outputs.
    `input_is_parallel=False`: the input is replicated and the layer takes its own block."""
    input_is_parallel: bool = True


class Heads:
    """Plan style: divide the named integer attributes of a module (its head counts) by the
    group size, so that its attention runs on this process's heads."""

    def __init__(self, *attrs: str):
        if not attrs or not all(isinstance(a, str) for a in attrs):
            raise FuelGraphError("Heads: give the names of the attributes to divide")
        self.attrs = attrs

    def __repr__(self):
        return f"Heads{self.attrs}"


_STYLES = {"column": Column(), "column_gather": Column(True), "row": Row(),
           "row_shard_input": Row(False)}


def _block(t: Tensor, axis: int, g) -> Tensor:
    n = t.shape[axis] // g.size
    idx = (slice(None),) * axis + (slice(g.rank * n, (g.rank + 1) * n),)
    return t.detach()[idx]


def _check_split(what, size, g):
    if size % g.size:
        raise FuelGraphError(f"{what}: {size} is not divisible by the group size {g.size}")


class ColumnParallelLinear(Module):
    """y = x @ weight.T + bias with the output features split over `group`: this process holds
    weight [out_features / size, in_features] (rows rank*n .. (rank+1)*n of the full weight) and
    that block of the bias. x [..., in_features] (the same on every process) ->
    [..., out_features / size], or [..., out_features] with gather_output. Initialized as
    nn.Linear(in_features, out_features) would be, then sliced (equal on every process for
    equal seeds, and equal to the single-device layer)."""
    shard_axes = {"weight": 0, "bias": 0}

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group="world",
                 device="cpu", dtype=dt.float32):
        super().__init__()
        g = group_info(group)
        _check_split(f"ColumnParallelLinear: out_features", out_features, g)
        self._setup(in_features, out_features, gather_output, g)
        b = 1.0 / np.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_block(_uniform((out_features, in_features), b, dtype, device),
                                       0, g))
        self.bias = Parameter(_block(_uniform((out_features,), b, dtype, device), 0, g)) \
            if bias else None

    def _setup(self, in_features, out_features, gather_output, g):
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, g.name

    @classmethod
    def from_linear(cls, lin: Linear, gather_output=False, group="world"):
        """The column-parallel form of `lin` (its weights sliced; no random draw)."""
        g = group_info(group)
        _check_split(f"ColumnParallelLinear: out_features", lin.out_features, g)
        m = cls.__new__(cls)
        Module.__init__(m)
        m._setup(lin.in_features, lin.out_features, gather_output, g)
        m.weight = Parameter(_block(lin.weight, 0, g), lin.weight.requires_grad)
        m.bias = Parameter(_block(lin.bias, 0, g), lin.bias.requires_grad) \
            if lin.bias is not None else None
        return m

    def forward(self, x):
        y = F.linear(replicate(x, self.group), self.weight, self.bias)
        return all_gather(y, -1, self.group, grad="shard") if self.gather_output else y

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features} " \
               f"(local {self.weight.shape[0]}), bias={self.bias is not None}, " \
               f"gather_output={self.gather_output}, group={self.group!r}"


class RowParallelLinear(Module):
    """y = x @ weight.T + bias with the input features split over `group`: this process holds
    weight [out_features, in_features / size] (columns rank*n .. (rank+1)*n) and the whole bias.
    x [..., in_features / size] (this process's block, e.g. a column-parallel layer's output;
    with input_is_parallel=False the whole x, of which the layer takes its block) ->
    [..., out_features], the same on every process (the partial products summed over the
    group, then the bias added)."""
    shard_axes = {"weight": 1}

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True,
                 group="world", device="cpu", dtype=dt.float32):
        super().__init__()
        g = group_info(group)
        _check_split(f"RowParallelLinear: in_features", in_features, g)
        self._setup(in_features, out_features, input_is_parallel, g)
        b = 1.0 / np.sqrt(in_features) if in_features else 0.0
        self.weight = Parameter(_block(_uniform((out_features, in_features), b, dtype, device),
                                       1, g))
        self.bias = Parameter(_uniform((out_features,), b, dtype, device)) if bias else None

    def _setup(self, in_features, out_features, input_is_parallel, g):
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, g.name

    @classmethod
    def from_linear(cls, lin: Linear, input_is_parallel=True, group="world"):
        """The row-parallel form of `lin` (its weight sliced; no random draw)."""
        g = group_info(group)
        _check_split(f"RowParallelLinear: in_features", lin.in_features, g)
        m = cls.__new__(cls)
        Module.__init__(m)
        m._setup(lin.in_features, lin.out_features, input_is_parallel, g)
        m.weight = Parameter(_block(lin.weight, 1, g), lin.weight.requires_grad)
        m.bias = Parameter(lin.bias.detach(), lin.bias.requires_grad) \
            if lin.bias is not None else None
        return m

    def forward(self, x):
        if not self.input_is_parallel:
            x = shard(x, -1, self.group)
        y = all_reduce(F.linear(x, self.weight), "sum", self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in_features={self.in_features} (local {self.weight.shape[1]}), " \
               f"out_features={self.out_features}, bias={self.bias is not None}, " \
               f"group={self.group!r}"


def parallelize(model: Module, plan: dict, group="world") -> Module:
    """Convert `model` in place for tensor parallelism over `group` and return it. `plan` maps
    module-name patterns (fnmatch, e.g. "blocks.*.wq") to a style: "column" / Column(),
    "column_gather" / Column(gather=True), "row" / Row(), "row_shard_input" /
    Row(input_is_parallel=False) for nn.Linear layers (replaced by their parallel form, holding
    this process's slice of the current weights), or Heads("attr", ...) for the modules whose
    head counts must be divided. A pattern's wildcards match within one dotted component
    ("blocks.*.wq" matches "blocks.3.wq"; "blocks.*" matches "blocks.3" only). Every pattern
    must match at least one module."""
    g = group_info(group)
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        style = _STYLES.get(style, style) if isinstance(style, str) else style
        if not isinstance(style, (Column, Row, Heads)):
            raise FuelGraphError(f"parallelize: unknown style {style!r} for {pattern!r}; "
                                 f"expected one of {sorted(_STYLES)}, Column, Row or Heads")
        hits = [n for n in modules if n and _matches(pattern, n)]
        if not hits:
            raise FuelGraphError(f"parallelize: pattern {pattern!r} matches no module")
        for name in hits:
            m = modules[name]
            if isinstance(style, Heads):
                for a in style.attrs:
                    v = getattr(m, a, None)
                    if isinstance(v, bool) or not isinstance(v, int):
                        raise FuelGraphError(f"parallelize: {name}.{a} is {v!r}, expected an "
                                             f"int (a head count)")
                    _check_split(f"parallelize: {name}.{a}", v, g)
                    setattr(m, a, v // g.size)
                continue
            if type(m) is not Linear:
                raise FuelGraphError(f"parallelize: {name} is a {type(m).__name__}; {style} "
                                     f"applies to fuelgraph.nn.Linear layers")
            new = ColumnParallelLinear.from_linear(m, style.gather, g.name) \
                if isinstance(style, Column) else \
                RowParallelLinear.from_linear(m, style.input_is_parallel, g.name)
            parent, _, child = name.rpartition(".")
            modules[parent]._modules[child] = new     # in place: a Sequential keeps its order
    return model


def llama_plan(tie_word_embeddings: bool = False) -> dict:
    """The tensor-parallel plan of `fuelgraph.models.LlamaForCausalLM` (Hugging Face names):
    q/k/v and gate/up projections column-parallel, o and down projections row-parallel, the
    attention's head counts (`hq`, `hkv`) divided, and an untied output head column-parallel
    with gathered logits (a tied head stays replicated with the embedding). Training and
    full-sequence forwards only: the paged KV cache of `generate` is not split."""
    plan = {"model.layers.*.self_attn.q_proj": "column",
            "model.layers.*.self_attn.k_proj": "column",
            "model.layers.*.self_attn.v_proj": "column",
            "model.layers.*.self_attn.o_proj": "row",
            "model.layers.*.self_attn": Heads("hq", "hkv"),
            "model.layers.*.mlp.gate_proj": "column",
            "model.layers.*.mlp.up_proj": "column",
            "model.layers.*.mlp.down_proj": "row"}
    if not tie_word_embeddings:
        plan["lm_head"] = "column_gather"
    return plan


def _matches(pattern: str, name: str) -> bool:
    """fnmatch per dotted component: "blocks.*.wq" matches "blocks.3.wq", "blocks.*" matches
    "blocks.3" (a wildcard never spans a dot)."""
    ps, ns = pattern.split("."), name.split(".")
    return len(ps) == len(ns) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(ps, ns))


def load_sharded(model: Module, checkpoint, group="world", strict: bool = True, ignore=()):
    """Load a full (single-device) checkpoint into a tensor-parallel `model`: each parameter of
    a parallel layer gets this process's slice along the layer's split axis, everything else
    the whole tensor. `checkpoint`: a dict name -> tensor/array (e.g. a single-device model's
    state_dict()), the path of a safetensors file, or a Hugging Face checkpoint directory
    (model.safetensors, or the shards of model.safetensors.index.json); files are
    memory-mapped, so each process reads only its slices. `ignore`: checkpoint keys ending in
    one of these are skipped (e.g. "rotary_emb.inv_freq"). Returns (missing, unexpected) as
    load_state_dict."""
    g = group_info(group)
    src = _SafetensorsFiles(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else \
        _DictSource(checkpoint)
    modules = dict(model.named_modules())
    state = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in src:
            continue
        owner, _, local = name.rpartition(".")
        axis = getattr(modules.get(owner), "shard_axes", {}).get(local)
        full = src.shape(name)
        want = list(t.shape)
        if axis is not None:
            want[axis] *= g.size
        if list(full) != want:
            raise FuelGraphError(f"load_sharded: {name} has shape {tuple(full)} in the "
                                 f"checkpoint, expected {tuple(want)}"
                                 + (f" (the full tensor of a {g.size}-way split)" if axis is not
                                    None else ""))
        if axis is None:
            state[name] = src.read(name)
        else:
            n = t.shape[axis]
            state[name] = src.read(name, axis, g.rank * n, (g.rank + 1) * n)
    extra = [k for k in src.keys() if k not in state and not k.endswith(tuple(ignore))]
    if strict and extra:
        raise FuelGraphError(f"load_sharded: unexpected keys {extra}")
    return model.load_state_dict(state, strict=strict)


class _DictSource:
    def __init__(self, state: dict):
        if not isinstance(state, dict):
            raise FuelGraphError(f"load_sharded: expected a dict or a safetensors path, got "
                                 f"{type(state).__name__}")
        self.state = state

    def __contains__(self, k):
        return k in self.state

    def keys(self):
        return list(self.state)

    def shape(self, k):
        return tuple(self.state[k].shape)

    def read(self, k, axis=None, lo=0, hi=0):
        v = self.state[k]
        if axis is None:
            return v
        idx = (slice(None),) * axis + (slice(lo, hi),)
        if isinstance(v, Tensor):
            return v.detach()[idx]
        return np.ascontiguousarray(np.asarray(v)[idx])


class _SafetensorsFiles:
    """A safetensors file, or a checkpoint directory of them: key -> its file."""

    def __init__(self, path):
        p = os.fspath(path)
        if os.path.isdir(p):
            index = os.path.join(p, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            else:
                names = sorted(n for n in os.listdir(p) if n.endswith(".safetensors"))
            if not names:
                raise FuelGraphError(f"load_sharded: no .safetensors file in {p}")
            files = [_SafetensorsFile(os.path.join(p, n)) for n in names]
        else:
            files = [_SafetensorsFile(p)]
        self.of = {k: f for f in files for k in f.keys()}

    def __contains__(self, k):
        return k in self.of

    def keys(self):
        return list(self.of)

    def shape(self, k):
        return self.of[k].shape(k)

    def read(self, k, axis=None, lo=0, hi=0):
        return self.of[k].read(k, axis, lo, hi)


class _SafetensorsFile:
    """A safetensors file read through a memory map: a slice reads only its own pages."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise FuelGraphError(f"load_sharded: cannot read {self.path} ({e})") from None
        self.base = 8 + n
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}

    def __contains__(self, k):
        return k in self.entries

    def keys(self):
        return list(self.entries)

    def shape(self, k):
        return tuple(self.entries[k]["shape"])

    def read(self, k, axis=None, lo=0, hi=0):
        e = self.entries[k]
        d = _FROM_CODE.get(e["dtype"])
        if d is None:
            raise FuelGraphError(f"load_sharded: {k} has dtype {e['dtype']}, which fuelgraph "
                                 f"does not support")
        a0, a1 = e["data_offsets"]
        shape = tuple(e["shape"])
        if a1 - a0 != int(np.prod(shape, dtype=np.int64)) * d.itemsize:
            raise FuelGraphError(f"load_sharded: {self.path}: tensor {k} has {a1 - a0} bytes "
                                 f"for shape {list(shape)}")
        if a1 == a0:
            a = np.zeros(shape, d.np)
        else:
            a = np.memmap(self.path, dtype=d.np, mode="r", offset=self.base + a0, shape=shape)
        if axis is not None:
            a = a[(slice(None),) * axis + (slice(lo, hi),)]
        return np.array(a, order="C")
