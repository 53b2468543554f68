"""PagedKVCache: a decode loop (prompt, then one token per step) against dense attention over
each sequence's full k/v history; blocks freed by finished sequences are reused by new ones
(scattered physical blocks); several layers; int32/uint32 indices; 16-bit pools; the README
example; every error."""
import math

import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph import FuelGraphError
from fuelgraph.nn import PagedKVCache
from fuelgraph.ir.tensor import bound_data
from fuelgraph.nn import kv_cache as kv_mod
from fuelgraph.runtime.executor import realize_raw

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def dense_attention(q, k, v):
    """q [Hq, n, D] (the n newest tokens), k/v [L, Hkv, D] (the whole history) in float64,
    causal bottom-right."""
    q, k, v = (torch.tensor(np.asarray(a, np.float64)) for a in (q, k, v))
    hq, n, d = q.shape
    L, hkv, _ = k.shape
    k = k.permute(1, 0, 2).repeat_interleave(hq // hkv, 0)
    v = v.permute(1, 0, 2).repeat_interleave(hq // hkv, 0)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    s = s.masked_fill(torch.arange(L)[None] > (L - n + torch.arange(n))[:, None], -math.inf)
    return (torch.softmax(s, -1) @ v).numpy()


class Model:
    """Random per-token q/k/v for each sequence, remembering every sequence's k/v history."""

    def __init__(self, hq, hkv, d, dtype, seed=0):
        self.hq, self.hkv, self.d, self.np = hq, hkv, d, fg.dtype.as_dtype(dtype).np
        self.rng = np.random.default_rng(seed)
        self.hist = {}

    def step(self, seqs, n):
        B = len(seqs)
        q, k, v = (self.rng.standard_normal((B, h, n, self.d)).astype(self.np)
                   for h in (self.hq, self.hkv, self.hkv))
        for b, s in enumerate(seqs):
            hk, hv = self.hist.get(int(s), (np.zeros((0, self.hkv, self.d), self.np),) * 2)
            self.hist[int(s)] = (np.concatenate([hk, k[b].transpose(1, 0, 2)]),
                                 np.concatenate([hv, v[b].transpose(1, 0, 2)]))
        return q, k, v

    def reference(self, seqs, q):
        return np.stack([dense_attention(q[b], *self.hist[int(s)]) for b, s in enumerate(seqs)])


def _check(got, ref, dtype):
    got = np.asarray(got.numpy(), np.float64)
    tol = {"float32": 2e-5, "float64": 1e-12}.get(dtype, 3e-2)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,index,bs", [("float32", "int32", 4), ("float64", "uint32", 1),
                                            ("bfloat16", "int32", 16), ("float16", "uint32", 3)])
def test_decode_loop_with_reuse(device, dtype, index, bs):
    B, hq, hkv, d = 3, 4, 2, 16
    cache = PagedKVCache(num_blocks=64, block_size=bs, num_kv_heads=hkv, head_dim=d,
                         max_blocks_per_seq=40 // bs + 2, max_seqs=6, dtype=dtype,
                         device=device, index_dtype=index)
    m = Model(hq, hkv, d, dtype)
    seqs = cache.add_sequences(B)
    free0 = cache.free_blocks
    for n in (7, 1, 1, 3, 1):                       # prompt, decode, a 3-token chunk, decode
        cache.extend(seqs, n)
        q, k, v = m.step(seqs, n)
        cache.write(seqs, fg.tensor(k, device=device), fg.tensor(v, device=device))
        out = cache.attention(seqs, fg.tensor(q, device=device))
        assert out.shape == (B, hq, n, d) and out.dtype.name == dtype
        _check(out, m.reference(seqs, q), dtype)
    assert list(cache.context_lens(seqs)) == [13] * B
    assert free0 - cache.free_blocks == B * -(-13 // bs)
    cache.free(seqs[1:2])                            # finished: its blocks go back
    assert free0 - cache.free_blocks == (B - 1) * -(-13 // bs)
    newer = cache.add_sequences(2)                   # reuses the freed id and blocks
    assert seqs[1] in newer
    m.hist.pop(int(seqs[1]))
    batch = np.array([seqs[0], newer[0], seqs[2], newer[1]])
    for b in newer:                                  # prompts of the new sequences
        cache.extend([b], 5)
        q, k, v = m.step([b], 5)
        cache.write([b], fg.tensor(k, device=device), fg.tensor(v, device=device))
        _check(cache.attention([b], fg.tensor(q, device=device)), m.reference([b], q), dtype)
    for _ in range(2):                               # decode the mixed batch together
        cache.extend(batch, 1)
        q, k, v = m.step(batch, 1)
        cache.write(batch, fg.tensor(k, device=device), fg.tensor(v, device=device))
        _check(cache.attention(batch, fg.tensor(q, device=device)), m.reference(batch, q),
               dtype)
    cache.free(batch)
    assert cache.free_blocks == free0


@pytest.mark.parametrize("device", DEVICES)
def test_traced_step_writes_the_pools_in_place(device):
    """The write as part of a traced step (pools / step_tensors / append): one trace for every
    decode token, the pool buffers overwritten where they are, attention against the dense
    reference, and eager writes after it see what the traced ones wrote."""
    B, hq, hkv, d, bs = 2, 4, 2, 8, 4
    cache = PagedKVCache(num_blocks=16, block_size=bs, num_kv_heads=hkv, head_dim=d,
                         max_blocks_per_seq=8, max_seqs=2, num_layers=2, device=device)
    m = Model(hq, hkv, d, "float32", seed=3)
    seqs = cache.add_sequences(B)

    def step(q, k, v, slots, table, lens):
        rows = [t.permute(0, 2, 1, 3).reshape(-1, hkv, d) for t in (k, v)]
        kp, vp = cache.append(1, rows[0], rows[1], slots)
        return fg.functional.paged_attn(q, kp, vp, table, lens)
    traced = fg.jit(step)
    pool = cache.pools(1)[0]
    first = None
    for i, n in enumerate((5, 1, 1, 1, 1)):
        cache.extend(seqs, n)
        q, k, v = m.step(seqs, n)
        out = traced(*(fg.tensor(a, device=device) for a in (q, k, v)), *cache.step_tensors(seqs))
        _check(out, m.reference(seqs, q), "float32")
        buf = kv_mod._DATA[pool.value.node]
        first = buf if first is None else first
        same = buf.data_ptr() == first.data_ptr() if device == "cuda" else \
            np.shares_memory(buf, first)
        assert same, f"step {i}: the pool moved to a new buffer"
    assert traced.stats == {"traces": 2, "replays": 3}       # the prompt, then one decode trace
    cache.extend(seqs, 1)                                     # an eager step on the same pools
    q, k, v = m.step(seqs, 1)
    cache.write(seqs, fg.tensor(k, device=device), fg.tensor(v, device=device), layer=1)
    _check(cache.attention(seqs, fg.tensor(q, device=device), layer=1), m.reference(seqs, q),
           "float32")
    assert not np.any(cache.pools(0)[0].numpy())             # other layers untouched


def _host(buf):
    return buf.cpu().numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)


@pytest.mark.parametrize("device", DEVICES)
def test_extend_steps_prepares_every_step(device):
    """extend_steps(seqs, n): every step's slot mapping and lengths in one upload (the slot of
    token t of sequence b is where the block table puts it, no slot twice), blocks allocated
    across a block boundary, lengths and free blocks as n calls of extend(seqs, 1) leave them."""
    caches = [PagedKVCache(16, 4, 1, 8, max_blocks_per_seq=4, device=device) for _ in range(2)]
    seqs = [c.add_sequences(2) for c in caches]
    for c, s in zip(caches, seqs):
        c.extend(s, 3)
    slots, table, lens = caches[0].extend_steps(seqs[0], 6)      # lengths 4..9: 2 new blocks
    for _ in range(6):
        caches[1].extend(seqs[1], 1)
    slots, table, lens = _host(slots), _host(table), _host(lens)
    assert slots.shape == (6, 2) and lens.shape == (6, 2)
    np.testing.assert_array_equal(table, caches[0]._tables[seqs[0]])
    pos = 3 + np.arange(6)[:, None]
    want = table[[0, 1], pos // 4] * 4 + pos % 4
    np.testing.assert_array_equal(slots, want)
    assert len(set(slots.ravel().tolist())) == 12 and (table[:, :3] != caches[0]._pad).all()
    np.testing.assert_array_equal(lens, np.broadcast_to(pos + 1, (6, 2)))
    assert list(caches[0].context_lens(seqs[0])) == list(caches[1].context_lens(seqs[1]))
    assert caches[0].free_blocks == caches[1].free_blocks
    np.testing.assert_array_equal(caches[0].step_tensors(seqs[0])[0].numpy(), slots[-1])
    with pytest.raises(FuelGraphError, match="more than max_blocks_per_seq"):
        caches[0].extend_steps(seqs[0], 8)


@pytest.mark.parametrize("device", DEVICES)
def test_replayer_runs_a_traced_decode_step(device):
    """fg.jit's Replayer: the step's later tokens replayed on new argument buffers only (the
    inputs extend_steps made at once), the pools written in place, attention as the dense
    reference, the same step counted as replays (on the GPU: its CUDA graph)."""
    B, hq, hkv, d, bs = 2, 4, 2, 8, 4
    cache = PagedKVCache(num_blocks=16, block_size=bs, num_kv_heads=hkv, head_dim=d,
                         max_blocks_per_seq=8, max_seqs=2, device=device)
    m = Model(hq, hkv, d, "float32", seed=5)
    seqs = cache.add_sequences(B)

    def step(q, k, v, slots, table, lens):
        rows = [t.permute(0, 2, 1, 3).reshape(-1, hkv, d) for t in (k, v)]
        kp, vp = cache.append(0, rows[0], rows[1], slots)
        return fg.functional.paged_attn(q, kp, vp, table, lens)
    traced = fg.jit(step, cuda_graph=device == "cuda")
    for n in (5, 1):                                   # the prompt, then one decode call
        cache.extend(seqs, n)
        q, k, v = m.step(seqs, n)
        out = traced(*(fg.tensor(a, device=device) for a in (q, k, v)), *cache.step_tensors(seqs))
        _check(out, m.reference(seqs, q), "float32")
    rep = traced.replayer()
    pool = kv_mod._DATA[cache.pools(0)[0].value.node]
    slots, table, lens = cache.extend_steps(seqs, 4)   # lengths 7..10, a new block at 9
    for i in range(4):
        q, k, v = m.step(seqs, 1)
        bufs = realize_raw([fg.tensor(a, device=device) for a in (q, k, v)])
        (got,) = rep.run(bufs + [slots[i], table, lens[i]])
        ref = m.reference(seqs, q)
        np.testing.assert_allclose(np.asarray(_host(got), np.float64), ref,
                                   rtol=2e-5, atol=2e-5)
    assert traced.stats == {"traces": 2, "replays": 4}
    assert kv_mod._DATA[cache.pools(0)[0].value.node] is pool      # written where it was


def test_layers_have_their_own_pools_and_share_tables():
    cache = PagedKVCache(16, 4, 1, 8, max_blocks_per_seq=4, num_layers=2)
    m0, m1 = Model(2, 1, 8, "float32", 1), Model(2, 1, 8, "float32", 2)
    seqs = cache.add_sequences(2)
    for n in (5, 1):
        cache.extend(seqs, n)
        for layer, m in enumerate((m0, m1)):
            q, k, v = m.step(seqs, n)
            cache.write(seqs, fg.tensor(k), fg.tensor(v), layer=layer)
            _check(cache.attention(seqs, fg.tensor(q), layer=layer), m.reference(seqs, q),
                   "float32")
    k0, _, t0, l0 = cache.inputs(seqs, 0)
    k1, _, t1, l1 = cache.inputs(seqs, 1)
    assert not np.array_equal(k0.numpy(), k1.numpy())
    assert np.array_equal(t0.numpy(), t1.numpy()) and list(l0.numpy()) == [6, 6]


@pytest.mark.parametrize("device", DEVICES)
def test_block_table_uploaded_only_when_it_changes(device):
    """Decode steps that start no new block reuse the uploaded table; a new block, another
    set of sequences or a freed sequence uploads it again, with the right contents."""
    cache = PagedKVCache(16, 4, 1, 8, max_blocks_per_seq=4, device=device)
    seqs = cache.add_sequences(2)
    tables = []
    for n in (3, 1, 1, 1):                   # 3, 4 (same block), 5 (new block), 6
        cache.extend(seqs, n)
        tables.append(cache.step_tensors(seqs)[1])
    assert tables[1].value.node is not tables[0].value.node
    same = [bound_data(t.value.node) for t in tables]
    assert same[1] is same[0] and same[3] is same[2] and same[2] is not same[1]
    want = cache._tables[seqs]
    np.testing.assert_array_equal(tables[3].numpy(), want)
    assert (want[:, :2] != cache._pad).all() and (want[:, 2:] == cache._pad).all()
    one = seqs[:1]
    cache.extend(one, 1)                     # other sequences: a table of their own
    np.testing.assert_array_equal(cache.step_tensors(one)[1].numpy(), cache._tables[one])
    cache.free(seqs[1:])
    cache.extend(one, 1)
    np.testing.assert_array_equal(cache.step_tensors(one)[1].numpy(), cache._tables[one])


def test_inputs_feed_paged_attn_directly():
    import fuelgraph.functional as F
    cache = PagedKVCache(8, 4, 2, 8, max_blocks_per_seq=3)
    m = Model(4, 2, 8, "float32")
    seqs = cache.add_sequences(2)
    cache.extend(seqs, 6)
    q, k, v = m.step(seqs, 6)
    cache.write(seqs, fg.tensor(k), fg.tensor(v))
    kc, vc, table, lens = cache.inputs(seqs)
    assert kc.shape == (8, 4, 2, 8) and table.shape == (2, 3) and table.dtype == fg.int32
    out = F.paged_attn(fg.tensor(q), kc, vc, table, lens)
    _check(out, m.reference(seqs, q), "float32")


def test_readme_example_runs(capsys):
    lines = []
    for line in kv_mod.__doc__.splitlines()[1:]:           # the indented example block
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    code = "\n".join(lines)
    exec(compile(code, "README example", "exec"), {})
    assert capsys.readouterr().out.split() == ["(4,", "8,", "12,", "64)"] + ["(4,", "8,", "1,",
                                                                            "64)"] * 3


def test_errors():
    with pytest.raises(FuelGraphError, match="block_size must be an int >= 1"):
        PagedKVCache(8, 0, 2, 8, max_blocks_per_seq=2)
    with pytest.raises(FuelGraphError, match="dtype must be a float dtype"):
        PagedKVCache(8, 4, 2, 8, max_blocks_per_seq=2, dtype=fg.int32)
    with pytest.raises(FuelGraphError, match="index_dtype must be int32 or uint32"):
        PagedKVCache(8, 4, 2, 8, max_blocks_per_seq=2, index_dtype=fg.int64)
    cache = PagedKVCache(4, 4, 2, 8, max_blocks_per_seq=3, max_seqs=2)
    with pytest.raises(FuelGraphError, match="3 new sequences requested, 2 of max_seqs = 2"):
        cache.add_sequences(3)
    a, b = cache.add_sequences(2)
    with pytest.raises(FuelGraphError, match="not all live sequence ids"):
        cache.extend([a, 5], 1)
    with pytest.raises(FuelGraphError, match="repeat"):
        cache.extend([a, a], 1)
    with pytest.raises(FuelGraphError, match="more than max_blocks_per_seq \\* block_size = 12"):
        cache.extend([a], 13)
    cache.extend([a], 12)
    with pytest.raises(FuelGraphError, match="2 more blocks needed, 1 free"):
        cache.extend([b], 5)
    with pytest.raises(FuelGraphError, match="call extend\\(seqs, n_new\\) for exactly these"):
        cache.write([b], fg.zeros((1, 2, 1, 8)), fg.zeros((1, 2, 1, 8)))
    with pytest.raises(FuelGraphError, match="k is \\(1, 2, 1, 8\\) float32, expected "
                                             "\\(1, 2, 12, 8\\)"):
        cache.write([a], fg.zeros((1, 2, 1, 8)), fg.zeros((1, 2, 1, 8)))
    with pytest.raises(FuelGraphError, match="layer 1 out of range"):
        cache.inputs([a], layer=1)
    with pytest.raises(FuelGraphError, match="n_new must be an int >= 1"):
        cache.extend([a], 0)
    cache.free([a])
    assert cache.free_blocks == 4
    with pytest.raises(FuelGraphError, match="not all live"):
        cache.free([a])
