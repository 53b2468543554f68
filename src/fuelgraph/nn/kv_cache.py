"""`PagedKVCache`: a block-pool key/value cache for autoregressive decoding with `paged_attn`.

    import numpy as np
    import fuelgraph as fg, fuelgraph.functional as F
    from fuelgraph.nn import PagedKVCache

    B, Hq, Hkv, D = 4, 8, 2, 64
    cache = PagedKVCache(num_blocks=256, block_size=16, num_kv_heads=Hkv, head_dim=D,
                         max_blocks_per_seq=64, dtype=fg.float32, device="cpu")
    seqs = cache.add_sequences(B)                 # ids of B new, empty sequences
    rng = np.random.default_rng(0)
    for n_new in (12, 1, 1, 1):                   # a 12-token prompt, then three decode steps
        cache.extend(seqs, n_new)                 # room for n_new more tokens per sequence
        q, k, v = (fg.tensor(rng.standard_normal((B, h, n_new, D)).astype(np.float32))
                   for h in (Hq, Hkv, Hkv))       # the new tokens' q/k/v, [B, heads, n_new, D]
        cache.write(seqs, k, v)                   # one fused scatter each into the k and v pools
        out = cache.attention(seqs, q)            # F.paged_attn over every cached token
        print(out.shape)                          # (4, 8, n_new, 64)
    cache.free(seqs)                              # their blocks return to the pool

The pool of each layer is `[num_blocks, block_size, Hkv, D]` for k and for v, allocated once on
the device (`device="cuda"` keeps it in GPU memory); block tables are shared by the layers (they
hold the same tokens). Blocks are handed out from a free list as sequences grow, so a sequence's
blocks are scattered over the pool; `free` returns them. `extend` does the bookkeeping for one
step: it allocates blocks, computes the pool slot of every new token (vectorised: no Python loop
per token) and uploads the batch's context lengths and slot mapping once, and its block table
when it changed (a decode step that starts no new block reuses the last one);
`write` and `attention` (or `inputs`, which hands `paged_attn` its arguments) reuse them for
every layer. `extend_steps(seqs, n)` prepares the next n one-token steps at once (one upload;
a decode loop then does no cache work per token).

The pools are mutable state owned by the cache: `write` runs the cache-write kernel in place on
them (graph inputs are immutable values, so a lazy write would copy the whole pool each step).
Tensors returned by `attention` / `inputs` read the pool when they are realized: realize a step's
outputs before the next `write` (a decode loop does, since the next token depends on them).

Inside a traced step (`fuelgraph.jit`) the write is part of the graph instead: `pools(layer)` are
the pools as persistent tensor handles (like parameters), `step_tensors(seqs)` this step's slot
mapping, block table and context lengths as tensors (run-time inputs of the trace), and
`append(layer, k_rows, v_rows, slot_mapping)` rebinds the handles to the written pools. The
traced plan then overwrites the pool buffers in place and every later step replays it with the
new index tensors (see `fuelgraph.models.llama`):

    step = fg.jit(lambda q, k, v, slots, table, lens: ...)   # append, then paged_attn
    cache.extend(seqs, 1)
    out = step(q, k, v, *cache.step_tensors(seqs))
"""
from __future__ import annotations

import numpy as np

from .. import dtype as dt
from ..api import bind_buffer, rebind
from ..backends import backend_name, get_backend, select_kernel
from ..errors import FuelGraphError
from ..interop import from_dlpack, from_torch
from ..ir import ops
from ..ir.tensor import _DATA, OWNER, Tensor, _leaf, _normalize_device
from ..registry.paged import PAGED_CACHE_WRITE, paged_attn, paged_cache_write_kv
from ..runtime.executor import realize_raw


class PagedKVCache:
    """Block-pool KV cache for `num_layers` attention layers.

    num_blocks, block_size: the pool; num_kv_heads (Hkv), head_dim (D); max_blocks_per_seq: the
    width of a block table (a sequence holds at most max_blocks_per_seq * block_size tokens);
    max_seqs: how many sequences may be live at once; dtype: one of the four float dtypes;
    index_dtype: int32 or uint32 for the block tables, context lengths and slot mappings."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 max_blocks_per_seq: int, num_layers: int = 1, max_seqs: int = 256,
                 dtype=dt.float32, device="cpu", index_dtype=dt.int32):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("max_blocks_per_seq", max_blocks_per_seq), ("num_layers", num_layers),
                        ("max_seqs", max_seqs)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise FuelGraphError(f"PagedKVCache: {name} must be an int >= 1, got {v!r}")
        self.dtype, self.index_dtype = dt.as_dtype(dtype), dt.as_dtype(index_dtype)
        if not self.dtype.is_float:
            raise FuelGraphError(f"PagedKVCache: dtype must be a float dtype, got {self.dtype.name}")
        if self.index_dtype not in (dt.int32, dt.uint32):
            raise FuelGraphError(f"PagedKVCache: index_dtype must be int32 or uint32, got "
                                 f"{self.index_dtype.name}")
        self.device = _normalize_device(device)
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.max_blocks_per_seq, self.num_layers = int(max_blocks_per_seq), int(num_layers)
        self.max_seqs = int(max_seqs)
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # tensor handles owning the pool buffers: persistent state a traced step reads and
        # rebinds (like a parameter), so its plan writes the pools in place
        self._pools = [(self._handle(shape), self._handle(shape)) for _ in range(self.num_layers)]
        self._pad = int(np.iinfo(self.index_dtype.np).max)
        self._tables = np.full((self.max_seqs, self.max_blocks_per_seq), self._pad,
                               self.index_dtype.np)
        self._lens = np.zeros(self.max_seqs, np.int64)
        self._live = np.zeros(self.max_seqs, bool)
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))   # pop() hands out 0, 1, ...
        self._step = None
        self._writer = None
        self._table_version = 0       # bumped whenever a block table changes
        self._table_dev = None        # (ids and version, the table on the device) last uploaded

    # ---- allocation -----------------------------------------------------------------------
    def _zeros(self, shape):
        if self.device == "cpu":
            return np.zeros(shape, self.dtype.np)
        import torch
        return torch.zeros(shape, dtype=self.dtype.torch, device=self.device)

    def _handle(self, shape) -> Tensor:
        t = _leaf(self._zeros(shape), self.dtype, self.device, False)
        OWNER[t.value.node] = (t, "value")
        return t

    def _buffer(self, t: Tensor):
        """The buffer a pool handle holds now (a lazy append made outside a traced step is
        computed first, into a buffer of the handle's own)."""
        node = t.value.node
        if not isinstance(node.op, ops.Input):
            bind_buffer(t, get_backend(self.device).copy(realize_raw([t])[0]))
            node = t.value.node
        return _DATA[node]

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def add_sequences(self, n: int) -> np.ndarray:
        """Ids of `n` new, empty sequences."""
        free = np.flatnonzero(~self._live)
        if n > free.size:
            raise FuelGraphError(f"PagedKVCache: {n} new sequences requested, {free.size} of "
                                 f"max_seqs = {self.max_seqs} are free")
        ids = free[:n]
        self._live[ids] = True
        self._lens[ids] = 0
        return ids.copy()

    def _ids(self, seqs) -> np.ndarray:
        ids = np.asarray(seqs, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.max_seqs or not self._live[ids].all()):
            raise FuelGraphError(f"PagedKVCache: {ids.tolist()} are not all live sequence ids")
        if np.unique(ids).size != ids.size:
            raise FuelGraphError(f"PagedKVCache: sequence ids {ids.tolist()} repeat")
        return ids

    def context_lens(self, seqs) -> np.ndarray:
        """Cached tokens of each sequence (host copy)."""
        return self._lens[self._ids(seqs)].copy()

    def _grow(self, ids, n_new: int):
        """Allocate the blocks that n_new more tokens of each sequence `ids` need and record
        them in the host block tables -> (old lengths, new lengths, blocks allocated); the
        lengths themselves are left to the caller."""
        bs = self.block_size
        old = self._lens[ids]
        new = old + n_new
        have, need = -(-old // bs), -(-new // bs)
        if need.size and need.max() > self.max_blocks_per_seq:
            b = int(np.argmax(need))
            raise FuelGraphError(f"PagedKVCache.extend: sequence {int(ids[b])} would hold "
                                 f"{int(new[b])} tokens, more than max_blocks_per_seq * "
                                 f"block_size = {self.max_blocks_per_seq * bs}")
        count = need - have
        total = int(count.sum())
        if total > len(self._free_blocks):
            raise FuelGraphError(f"PagedKVCache.extend: {total} more blocks needed, "
                                 f"{len(self._free_blocks)} free (free finished sequences or "
                                 f"allocate a larger pool)")
        if total:
            got = np.array(self._free_blocks[len(self._free_blocks) - total:][::-1], np.int64)
            del self._free_blocks[len(self._free_blocks) - total:]
            rows = np.repeat(ids, count)
            cols = np.repeat(have, count) + (np.arange(total) - np.repeat(np.cumsum(count) - count,
                                                                          count))
            self._tables[rows, cols] = got
            self._table_version += 1
        return old, new, total

    def extend(self, seqs, n_new: int):
        """Make room for `n_new` more tokens in each sequence of `seqs`: allocate the blocks they
        need, advance their lengths and prepare this step's slot mapping, block table and context
        lengths (uploaded to the device once, shared by every layer's write and attention)."""
        ids = self._ids(seqs)
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or n_new < 1:
            raise FuelGraphError(f"PagedKVCache.extend: n_new must be an int >= 1, got {n_new!r}")
        old, new, _ = self._grow(ids, n_new)
        self._lens[ids] = new
        pos = old[:, None] + np.arange(n_new)[None, :]                         # [B, n_new]
        bs = self.block_size
        blocks = self._tables[ids[:, None], pos // bs].astype(np.int64)
        slots = (blocks * bs + pos % bs).reshape(-1).astype(self.index_dtype.np)
        # the block table of these sequences is uploaded again only when it changed (a block
        # was handed out or freed, or other sequences): most decode steps reuse the last one
        key = (ids.tobytes(), self._table_version)
        table = self._table_dev[1] if self._table_dev is not None and \
            self._table_dev[0] == key else None
        idt = self.index_dtype.np
        if self.device == "cpu":
            if table is None:
                table = self._to_device(self._tables[ids])
            lens, slots = self._to_device(new.astype(idt)), self._to_device(slots)
        else:                         # one upload: slots, lengths and (if new) table together
            parts = [slots, new.astype(idt)] + ([] if table is not None else
                                                [self._tables[ids].reshape(-1)])
            packed = self._to_device(np.concatenate(parts))
            ns, B = slots.size, ids.size
            slots, lens = packed[:ns], packed[ns:ns + B]
            if table is None:
                table = packed[ns + B:].view(B, self.max_blocks_per_seq)
            # valid by construction: spare paged_attn and the cache write their checks' syncs
            from ..backends.cuda.kernels.paged import assume_valid
            from ..backends.cuda.kernels.paged_cache import assume_valid_slots
            assume_valid(lens, table, n_new, self.num_blocks, bs, int(new.max(initial=0)),
                         int(new.sum()))
            assume_valid_slots(slots, self.num_blocks * bs)
        self._table_dev = (key, table)
        self._step = (ids.tobytes(), n_new, slots, table, lens)

    def extend_steps(self, seqs, n_steps: int):
        """`extend(seqs, 1)` for the next `n_steps` one-token decode steps at once: allocates
        their blocks now, advances the lengths by n_steps and returns every step's inputs as
        device buffers (one upload): slot mappings [n_steps, B], the block table [B,
        max_blocks_per_seq] (valid for all of them) and context lengths [n_steps, B]; row i is
        what `step_tensors` would give after the (i+1)-th extend. A decode loop that knows how
        many tokens it will make spends no host work on the cache per token."""
        ids = self._ids(seqs)
        if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 1:
            raise FuelGraphError(f"PagedKVCache.extend_steps: n_steps must be an int >= 1, got "
                                 f"{n_steps!r}")
        old, new, _ = self._grow(ids, n_steps)
        self._lens[ids] = new
        bs, idt, B = self.block_size, self.index_dtype.np, ids.size
        pos = old[None, :] + np.arange(n_steps)[:, None]                       # [n_steps, B]
        slots = self._tables[ids[None, :], pos // bs].astype(np.int64) * bs + pos % bs
        packed = self._to_device(np.concatenate([slots.reshape(-1).astype(idt),
                                                 (pos + 1).reshape(-1).astype(idt),
                                                 self._tables[ids].reshape(-1)]))
        n = n_steps * B
        slots, lens = packed[:n].reshape(n_steps, B), packed[n:2 * n].reshape(n_steps, B)
        table = packed[2 * n:].reshape(B, self.max_blocks_per_seq)
        self._table_dev = ((ids.tobytes(), self._table_version), table)
        self._step = (ids.tobytes(), 1, slots[-1], table, lens[-1])
        return slots, table, lens

    def free(self, seqs):
        """Release sequences: their blocks return to the pool, their ids may be reused."""
        ids = self._ids(seqs)
        t = self._tables[ids]
        used = t[t != self._pad].astype(np.int64)
        self._free_blocks.extend(int(b) for b in used[::-1])
        self._tables[ids] = self._pad
        self._table_version += 1
        self._lens[ids] = 0
        self._live[ids] = False
        self._step = None

    # ---- the step's inputs ---------------------------------------------------------------
    def _to_device(self, a):
        a = np.ascontiguousarray(a)
        if self.device == "cpu":
            a.flags.writeable = False
            return a
        import torch
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _current(self, ids, what):
        st = self._step
        if st is None or st[0] != ids.tobytes():
            raise FuelGraphError(f"PagedKVCache.{what}: call extend(seqs, n_new) for exactly these "
                                 f"sequences first (in this order)")
        return st

    def _leaf(self, buf) -> Tensor:
        return from_dlpack(buf) if self.device == "cpu" else from_torch(buf)

    def _write_kernel(self):
        """The backend's cache-write kernel, called directly on the pool so it writes in place."""
        if self._writer is None:
            shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            impl = select_kernel(int(PAGED_CACHE_WRITE), backend_name(self.device),
                                 [shape, (1,) + shape[2:], (1,)],
                                 [self.dtype, self.dtype, self.index_dtype])
            if impl is None:
                raise FuelGraphError(f"PagedKVCache: no cache-write kernel for "
                                     f"{self.dtype.name} on {self.device}")
            self._writer = impl.kernel
        return self._writer

    def _layer(self, layer):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < self.num_layers:
            raise FuelGraphError(f"PagedKVCache: layer {layer!r} out of range [0, "
                                 f"{self.num_layers})")
        return self._pools[layer]

    def write(self, seqs, k: Tensor, v: Tensor, layer: int = 0):
        """Store the k and v of the step's new tokens, `[B, Hkv, n_new, D]` each (B =
        len(seqs)), into this layer's pools, in place: one fused scatter per pool (on a GPU, one
        launch for both pools, reading k and v in their layout)."""
        ids = self._ids(seqs)
        _, n_new, slots, _, _ = self._current(ids, "write")
        want = (ids.size, self.num_kv_heads, n_new, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or tuple(t.shape) != want or t.dtype != self.dtype:
                got = f"{tuple(t.shape)} {t.dtype.name}" if isinstance(t, Tensor) else type(t).__name__
                raise FuelGraphError(f"PagedKVCache.write: {name} is {got}, expected {want} "
                                     f"{self.dtype.name} on {self.device}")
            if t.device != self.device:
                raise FuelGraphError(f"PagedKVCache.write: {name} lives on {t.device}, the cache "
                                     f"on {self.device}")
        if self.device != "cpu":      # both pools in one launch, reading k/v's layout as is
            from ..backends.cuda.kernels.paged_cache import paged_cache_write_kv
            kb, vb = realize_raw([k, v])
            paged_cache_write_kv(*(self._buffer(p) for p in self._layer(layer)), kb, vb, slots)
            return
        rows = [t.permute(0, 2, 1, 3).reshape(ids.size * n_new, self.num_kv_heads, self.head_dim)
                for t in (k, v)]
        bufs = [b.contiguous() if hasattr(b, "is_contiguous") else np.ascontiguousarray(b)
                for b in realize_raw(rows)]
        for pool, buf in zip(self._layer(layer), bufs):     # slots are valid by construction
            self._write_kernel()(self._buffer(pool), buf, slots, check=False)

    def inputs(self, seqs, layer: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(k_cache, v_cache, block_table, context_lens) of this step for `paged_attn`."""
        ids = self._ids(seqs)
        _, _, _, table, lens = self._current(ids, "inputs")
        kp, vp = self._layer(layer)
        return (self._leaf(self._buffer(kp)), self._leaf(self._buffer(vp)), self._leaf(table),
                self._leaf(lens))

    def attention(self, seqs, q: Tensor, layer: int = 0, alibi_slopes=None, softmax_scale=None,
                  softcap=None) -> Tensor:
        """`paged_attn` of q `[B, Hq, n_new, D]` (the step's new tokens) over every cached token
        of each sequence, causal among the new ones. Returns `[B, Hq, n_new, D]`."""
        return paged_attn(q, *self.inputs(seqs, layer), alibi_slopes=alibi_slopes,
                          softmax_scale=softmax_scale, softcap=softcap)


    # ---- traced steps (the write as part of the graph) ----------------------------------------
    def pools(self, layer: int = 0) -> tuple[Tensor, Tensor]:
        """This layer's (k, v) pools `[num_blocks, block_size, Hkv, D]` as the cache's persistent
        tensor handles: what a traced step reads, and `append` rebinds."""
        return self._layer(layer)

    def step_tensors(self, seqs) -> tuple[Tensor, Tensor, Tensor]:
        """(slot_mapping [B * n_new], block_table [B, max_blocks_per_seq], context_lens [B]) of
        the step prepared by `extend`, as new leaf tensors on the cache's device: the run-time
        inputs of a traced step (their shapes stay fixed while B and n_new do)."""
        ids = self._ids(seqs)
        _, _, slots, table, lens = self._current(ids, "step_tensors")
        return tuple(_leaf(b, self.index_dtype, self.device, False) for b in (slots, table, lens))

    def append(self, layer: int, k_rows: Tensor, v_rows: Tensor, slot_mapping: Tensor):
        """Record the write of new rows `[N, Hkv, D]` (k and v, N = B * n_new in the order of
        `slot_mapping`) into this layer's pools as graph ops: the pool handles are rebound to
        the written pools and returned, (k_pool, v_pool). Meant for a traced step, whose plan
        writes in place; outside one the next `write` / `inputs` computes the result (a copy of
        the pool)."""
        pools = self._layer(layer)
        written = paged_cache_write_kv(*pools, k_rows, v_rows, slot_mapping)
        for pool, new in zip(pools, written):
            rebind(pool, new.value)
        return pools
