"""The paged family on the CUDA backend. Kernel level (a GPU, or TRITON_INTERPRET=1 on tiny CPU
shapes): the Triton kernels against the float64 dense reference -- decode and chunked-prefill
paths, GQA/MQA, ALiBi, softcap, int32/uint32 indices, the split-K path and its merge, the
index-data check (raised before the launch, once per buffer version), the NaN rows written when
that check is skipped (CUDA-graph capture), the cache write. API level (a GPU): the ops through
fuelgraph on device="cuda", float64 lowered to the recipe, PagedKVCache on the GPU."""
import math

import numpy as np
import pytest

from .cuda_oracle import HAS_CUDA, INTERPRET, KERNEL_TESTS, assert_lowered_on_cuda, on_gpu, torch

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph import FuelGraphError  # noqa: E402
from oracle import assert_flash_rule  # noqa: E402
from registry.test_paged import make_case, paged_reference  # noqa: E402

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import paged as K
    from fuelgraph.backends.cuda.kernels.common import _GRAPH_COUNTERS
    from fuelgraph.backends.cuda.kernels import paged_cache as KC

DEV = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True, scope="module")
def _one_prefill_config_per_flag_set():
    """No autotuning of the prefill kernel in tests (it shares flash_attn's configs and switch):
    one compile per flag set; the benchmark tunes."""
    if not (HAS_CUDA or INTERPRET):
        yield
        return
    from fuelgraph.backends.cuda.kernels import attention as A
    old, A.TUNE = A.TUNE, False
    yield
    A.TUNE = old


TD = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dev(case, dtype):
    out = {}
    for k, v in case.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        if k in ("q", "k_cache", "v_cache"):
            t = t.to(TD[dtype])
        out[k] = t.to(DEV)
    return out


def run(dc, **kw):
    args = [dc[k] for k in ("q", "k_cache", "v_cache", "block_table", "context_lens")]
    if "alibi_slopes" in dc:
        args.append(dc["alibi_slopes"])
    kw.setdefault("softmax_scale", 1 / math.sqrt(dc["q"].shape[3]))
    return K.paged_attn(*args, **kw)


def dense_same_dtype(dc, softcap=None, scale=None):
    """torch on the device in the kernel's dtype: the same-dtype reference of the 16-bit rule
    (SDPA on the keys gathered densely, or the plain formula when there is a softcap)."""
    q, kc, vc = dc["q"], dc["k_cache"], dc["v_cache"]
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = kc.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(B, hq, sq, d, dtype=torch.float64)
    for b in range(B):
        n = int(dc["context_lens"][b].long())
        if n == 0:
            continue
        j = torch.arange(n, device=q.device)
        idx = dc["block_table"][b].long()[j // bs] * bs + j % bs
        k = kc.reshape(-1, hkv, d)[idx].permute(1, 0, 2).repeat_interleave(hq // hkv, 0)
        v = vc.reshape(-1, hkv, d)[idx].permute(1, 0, 2).repeat_interleave(hq // hkv, 0)
        pos = (n - sq + torch.arange(sq, device=q.device))[:, None]
        bias = torch.zeros(hq, sq, n, dtype=torch.float32, device=q.device)
        if "alibi_slopes" in dc:
            sl = dc["alibi_slopes"].reshape(-1, hq)[-1 if dc["alibi_slopes"].dim() == 1 else b]
            bias = bias - sl[:, None, None] * (pos - j).abs()
        bias = bias.masked_fill(j > pos, -math.inf)
        if softcap is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q[b], k, v, attn_mask=bias.to(q.dtype), scale=scale)
        else:
            s = (q[b] @ k.transpose(-1, -2)).float() * scale
            s = softcap * torch.tanh(s / softcap) + bias
            o = torch.softmax(s, -1).to(q.dtype) @ v
        out[b] = o.double().cpu()
    return out.numpy()


def check(case, dtype, **kw):
    dc = to_dev(case, dtype)
    got = run(dc, **{k: v for k, v in kw.items() if k != "exact"})
    assert got.dtype == TD[dtype] and got.shape == dc["q"].shape
    got = got.double().cpu().numpy()
    qs = {k: (dc[k].double().cpu().numpy() if k in ("q", "k_cache", "v_cache") else v)
          for k, v in case.items()}
    ref = paged_reference(qs["q"], qs["k_cache"], qs["v_cache"], case["block_table"],
                          case["context_lens"], case.get("alibi_slopes"),
                          kw.get("softmax_scale"), kw.get("softcap"))
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * max(np.abs(ref).max(), 1))
    else:
        # the interpreter narrows float32 to bfloat16 by truncation (the GPU rounds to
        # nearest): allow that one extra ulp there
        slack = 2.0 ** -8 if INTERPRET and dtype == "bfloat16" else 1e-6
        assert_flash_rule(got, ref, dense_same_dtype(dc, kw.get("softcap"),
                                                     kw.get("softmax_scale")), slack)
    return got


TINY = {   # interpreter-sized cases
    "decode_gqa": dict(hq=4, hkv=2, d=16, bs=4, lens=(9, 0, 5)),
    "decode_mqa_bs1": dict(hq=4, hkv=1, d=16, bs=1, lens=(6, 3, 1)),
    "prefill_gqa": dict(hq=4, hkv=2, sq=5, d=16, bs=4, lens=(9, 5, 0)),
    "prefill_g3_d12": dict(hq=6, hkv=2, sq=3, d=12, bs=2, lens=(7, 3, 4)),
}
LARGE = {  # GPU-sized cases: Hq 32 / Hkv 8, D 128, block 16
    "decode_b4": dict(B=4, hq=32, hkv=8, d=128, bs=16, lens=(1000, 17, 0, 2049)),
    "prefill_b2": dict(B=2, hq=32, hkv=8, sq=96, d=128, bs=16, lens=(700, 96)),
    "decode_mqa_d64": dict(B=3, hq=16, hkv=1, d=64, bs=16, lens=(300, 1, 5000)),
    "prefill_bs1_d64": dict(B=2, hq=8, hkv=2, sq=128, d=64, bs=1, lens=(300, 128)),
    "prefill_sq256": dict(B=2, hq=32, hkv=8, sq=256, d=128, bs=16, lens=(1100, 0)),
}
CASES = dict(TINY, **(LARGE if HAS_CUDA else {}))


@pytest.mark.parametrize("dtype", list(TD))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, dtype):
    case = make_case(np.random.default_rng(len(name)), **CASES[name])
    check(case, dtype)


@pytest.mark.parametrize("dtype", list(TD))
def test_alibi_softcap_uint32(dtype):
    case = make_case(np.random.default_rng(1), sq=3, d=16, lens=(9, 3, 0), index="uint32",
                     alibi=True, alibi_per_batch=True)
    check(case, dtype, softcap=2.0, softmax_scale=0.3)
    case = make_case(np.random.default_rng(2), d=16, lens=(9, 3, 0), alibi=True)
    check(case, dtype)


@pytest.mark.parametrize("n_split", [2, 3, None])
def test_split_k_merge(n_split):
    """Keys split over several programs; the merge weights each partial by its max. Splits
    past a sequence's end are skipped (their partials are never read)."""
    case = make_case(np.random.default_rng(3), B=2, hq=4, hkv=2, d=16, bs=4, lens=(23, 2),
                     mb=8, alibi=True)
    for dtype in ("float32", "bfloat16"):
        dc = to_dev(case, dtype)
        whole = run(dc, n_split=1)
        split = run(dc, n_split=n_split or 4, softcap=None)
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(split.float(), whole.float(), rtol=tol, atol=tol)
    check(case, "float32", n_split=3)
    case = make_case(np.random.default_rng(4), B=2, hq=4, hkv=2, sq=3, d=16, bs=4,
                     lens=(14, 3), mb=5)
    check(case, "float32", n_split=2)


PREFILL = {   # the FlashAttention-style prefill kernel, forced on interpreter-sized cases
    "gqa_bs4": dict(hq=4, hkv=2, sq=5, d=16, bs=4, lens=(40, 5, 0)),
    "mqa_bs1_d12": dict(hq=3, hkv=1, sq=7, d=12, bs=1, lens=(26, 9, 7)),
    "bs16_decode": dict(hq=4, hkv=2, sq=1, d=16, bs=16, lens=(50, 1, 17)),
    "bs32_long_chunk": dict(B=2, hq=2, hkv=2, sq=20, d=16, bs=32, lens=(45, 20)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_kernel(name, dtype):
    """Key tiles gathered over several pages (block 1/4) or within one (16/32), wholly
    admissible middle tiles and masked diagonal tiles, GQA/MQA, D not a power of two."""
    case = make_case(np.random.default_rng(len(name) + 20), **PREFILL[name])
    check(case, dtype, prefill=True)


def test_prefill_kernel_alibi_softcap_uint32():
    case = make_case(np.random.default_rng(21), sq=6, d=16, lens=(30, 6, 0), index="uint32",
                     alibi=True, alibi_per_batch=True)
    check(case, "float32", prefill=True, softcap=2.0, softmax_scale=0.3)
    case = make_case(np.random.default_rng(22), sq=4, d=16, lens=(35, 4, 9), alibi=True)
    check(case, "float32", prefill=True)


@pytest.mark.parametrize("group_heads", [2, 4])
def test_prefill_kernel_group_heads(group_heads):
    """Several query heads of a group per prefill program (each gathered k/v tile serving
    them): GQA and MQA groups, a group of 3 (falls back to 1 head), ALiBi per head."""
    case = make_case(np.random.default_rng(26), hq=8, hkv=2, sq=5, d=16, bs=4, lens=(40, 5, 0),
                     alibi=True)
    check(case, "float32", prefill=True, group_heads=group_heads)
    case = make_case(np.random.default_rng(27), B=2, hq=4, hkv=1, sq=7, d=12, bs=1,
                     lens=(26, 9))
    check(case, "bfloat16", prefill=True, group_heads=group_heads, block_m=16, block_n=16)
    case = make_case(np.random.default_rng(28), B=2, hq=6, hkv=2, sq=3, d=16, bs=2, lens=(7, 3))
    check(case, "float32", prefill=True, group_heads=group_heads)


def test_prefill_kernel_row_gather_and_int64_offsets(monkeypatch):
    """The wholly admissible tiles gathered row by row (page_tiles=False), and both kernels
    with int64 pool offsets (what pools of 2**31 elements or more use)."""
    case = make_case(np.random.default_rng(30), hq=4, hkv=2, sq=5, d=16, bs=4, lens=(40, 5, 0))
    check(case, "float32", prefill=True, page_tiles=False)
    monkeypatch.setattr(K, "INT32_OFFSETS_BELOW", 0)
    monkeypatch.setattr(K, "_LAUNCHES", {})       # launches configured before: int32 offsets
    check(case, "float32", prefill=True)
    check(case, "float32", prefill=False, n_split=2)


@pytest.mark.parametrize("prefetch", [False, True])
def test_decode_index_prefetch_and_merge_chunk(prefetch):
    """Block ids read one key tile ahead or in the tile's own iteration; the fused merge
    taking 2 or all splits per step."""
    case = make_case(np.random.default_rng(29), B=2, hq=4, hkv=2, d=16, bs=4, lens=(37, 5),
                     mb=10)
    check(case, "float32", prefetch_index=prefetch, n_split=1)
    check(case, "float32", prefetch_index=prefetch, n_split=3, merge_chunk=2)
    check(case, "bfloat16", prefetch_index=prefetch, n_split=3, merge_chunk=4)


@pytest.mark.parametrize("early_ids,merge_group", [(True, False), (False, True), (True, True)])
def test_decode_early_ids_and_group_merge(early_ids, merge_group):
    """The first tile's block ids requested before the length is known (ids past the length,
    table padding among them, never reach a k/v load or the id check), and the fused merge of a
    decode step taking a tile's query-head rows together: groups of 4 and of 3 (a masked row),
    uneven split counts, a length-0 sequence, more splits than its unrolled steps (falls back
    to the row merge), Sq > 1 (row merge)."""
    kw = dict(prefetch_index=True, early_ids=early_ids, merge_group=merge_group)
    case = make_case(np.random.default_rng(31), B=2, hq=8, hkv=2, d=16, bs=4, lens=(37, 5),
                     mb=10, alibi=True)
    check(case, "float32", n_split=3, **kw)
    check(case, "bfloat16", n_split=5, merge_chunk=2, **kw)
    check(case, "float32", programs_per_sm=3, **kw)
    case = make_case(np.random.default_rng(32), B=3, hq=6, hkv=2, d=12, bs=2, lens=(23, 0, 2),
                     mb=12)
    check(case, "float32", n_split=4, **kw)
    check(case, "float32", n_split=12, merge_chunk=1, **kw)
    case = make_case(np.random.default_rng(33), B=2, hq=4, hkv=2, sq=3, d=16, bs=4,
                     lens=(14, 3), mb=5)
    check(case, "float32", n_split=2, **kw)


@pytest.mark.parametrize("kv_evict", ["", "evict_first"])
def test_decode_kv_ahead_and_eviction_policy(kv_evict):
    """The k/v tiles loaded one key tile ahead into registers (kv_ahead) and the k/v loads'
    eviction policy: split and unsplit, uneven lengths (a tile past the length, a length-0
    sequence), key tiles narrower than a page, ALiBi."""
    kw = dict(kv_ahead=True, kv_evict=kv_evict)
    case = make_case(np.random.default_rng(34), B=3, hq=8, hkv=2, d=16, bs=4, lens=(37, 0, 5),
                     mb=10, alibi=True)
    check(case, "float32", n_split=1, **kw)
    check(case, "bfloat16", n_split=3, **kw)
    check(case, "float32", n_split=2, block_n=16, early_ids=False, kv_evict=kv_evict)
    case = make_case(np.random.default_rng(35), B=2, hq=4, hkv=1, d=16, bs=32, lens=(70, 9),
                     mb=3)
    check(case, "float32", n_split=2, block_n=16, **kw)      # tiles narrower than a page


def test_few_programs_launch_defaults(monkeypatch):
    """Launches with fewer (sequence, kv head, tile) triples than SMs take FEW_PROGRAMS_LAUNCH's
    defaults (kv_ahead and its policy among them); explicit knobs still win."""
    monkeypatch.setattr(K, "FEW_PROGRAMS_LAUNCH", dict(kv_ahead=True, kv_evict="evict_first",
                                                      block_n=16, maxnreg=168))
    monkeypatch.setattr(K, "FEW_PROGRAMS_MIN_KEYS", 0)
    monkeypatch.setattr(K, "_LAUNCHES", {})
    case = make_case(np.random.default_rng(39), B=2, hq=4, hkv=1, d=16, bs=4, lens=(29, 6),
                     mb=8)
    check(case, "float32", n_split=2)
    check(case, "float32", n_split=2, kv_ahead=False)


def test_decode_kv_ahead_nan_rows(monkeypatch):
    """kv_ahead with the check skipped: a live block id outside the pool poisons its row."""
    monkeypatch.setattr(K, "_capturing", lambda: True)
    case = make_case(np.random.default_rng(36), B=2, d=16, bs=4, lens=(11, 6), mb=3)
    case["block_table"] = case["block_table"].copy()
    case["block_table"][0, 2] = 10 ** 6                          # live entry outside the pool
    for ns in (1, 2):
        got = run(to_dev(case, "float32"), n_split=ns, kv_ahead=True, block_n=16).cpu().numpy()
        assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


def test_captured_launches_take_counters_from_the_graph_pool(monkeypatch):
    """A launch configured while a CUDA graph is captured (faked) takes its arrival counters
    from the pool an eager launch zeroed (no memset in the graph), a distinct aligned range per
    launch, left at zero by the run; with the pool used up, fresh zeroed counters."""
    case = make_case(np.random.default_rng(40), B=2, hq=4, hkv=2, d=16, bs=4, lens=(70, 9),
                     mb=20)
    kw = dict(n_split=3, block_n=16)                  # 3 splits of 32 keys, here and on a GPU
    check(case, "float32", **kw)                      # eager: creates the pool
    dev = torch.empty(0, device=DEV).device
    pool = _GRAPH_COUNTERS[(dev.type, dev.index)]
    monkeypatch.setattr(K, "_capturing", lambda: True)
    start = pool[1]
    for _ in range(2):
        check(case, "float32", **kw)
    assert pool[1] == start + 2 * 4 and start % 4 == 0           # grid (4, 1): 4 counters each
    assert int(pool[0].abs().sum()) == 0
    used, pool[1] = pool[1], pool[0].numel()
    try:
        check(case, "float32", **kw)
    finally:
        pool[1] = used


def test_graph_warm_up_sizes_the_launch_as_its_capture(monkeypatch):
    """Under fuelgraph's CUDA-graph warm-up (GRAPH_CAPTURE) the launch is configured without
    the length statistics, as the capture (which cannot sync) will be, so the capture loads no
    kernel variant the warm-up did not run; invalid lengths still raise in the warm-up."""
    from fuelgraph.backends.cuda.backend import _graph_capture
    monkeypatch.setattr(K, "_LAUNCHES", {})
    seen = []
    configure = K._configure
    monkeypatch.setattr(K, "_configure", lambda *a: (seen.append(a[5]), configure(*a))[1])
    case = make_case(np.random.default_rng(41), B=2, hq=4, hkv=2, d=16, bs=4, lens=(70, 9),
                     mb=20)
    check(case, "float32")
    with _graph_capture():
        check(case, "float32")
        bad = dict(case, context_lens=np.array([70, 99], case["context_lens"].dtype))
        with pytest.raises(FuelGraphError, match="paged_attn: "):
            run(to_dev(bad, "float32"))
    assert seen[0] == (70, 79) and seen[1] is None


@on_gpu
def test_split_kernel_in_cuda_graphs():
    """Two graphs capturing split launches (counters from the pool, distinct ranges), replayed
    in turn and repeatedly, after the data changed in place, equal eager calls."""
    case = make_case(np.random.default_rng(41), B=1, hq=32, hkv=8, d=128, bs=16, lens=(20000,))
    dc = to_dev(case, "bfloat16")
    calls = [lambda: run(dc), lambda: run(dc, kv_ahead=False, n_split=16)]
    want = [c().float() for c in calls]
    graphs, outs = [], []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(c())
        graphs.append(g)
    for _ in range(3):
        for g, o, w in zip(graphs, outs, want):
            g.replay()
            torch.testing.assert_close(o.float(), w, rtol=0, atol=0)
    dc["q"].mul_(-1.0)
    for g, o, c in zip(graphs, outs, calls):
        g.replay()
        torch.testing.assert_close(o.float(), c().float(), rtol=0, atol=0)


def test_split_merge_in_a_second_launch():
    """The unfused merge (benchmark variant) agrees with the fused one."""
    case = make_case(np.random.default_rng(23), B=2, hq=4, hkv=2, d=16, bs=4, lens=(23, 0),
                     mb=8)
    check(case, "float32", n_split=3, fused_merge=False)
    check(case, "float32", n_split=3)
    check(case, "float32", n_split=3)       # the fused merge's counters were reset
    long = make_case(np.random.default_rng(24), B=2, hq=2, hkv=1, d=16, bs=4, lens=(330, 40),
                     mb=84)
    check(long, "float32", n_split=21)      # more splits than one merge chunk


@on_gpu
def test_many_splits_on_gpu():
    """B1 long context: up to 128 splits merged in chunks by the last arriving program, three
    launches in a row (the arrival counters reset themselves), against the unsplit kernel."""
    case = make_case(np.random.default_rng(25), B=1, hq=32, hkv=8, d=128, bs=16, lens=(9000,))
    dc = to_dev(case, "bfloat16")
    whole = run(dc, n_split=1).float()
    for ns in (None, 64, 128):
        for _ in range(3):
            torch.testing.assert_close(run(dc, n_split=ns).float(), whole, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(run(dc, n_split=ns, early_ids=True, merge_group=True,
                                           prefetch_index=True).float(), whole, rtol=2e-2,
                                       atol=2e-2)
    check(case, "bfloat16")
    check(case, "bfloat16", early_ids=True, merge_group=True, programs_per_sm=3)


@on_gpu
@pytest.mark.parametrize("kw", [
    dict(), dict(n_split=128), dict(maxnreg=168, programs_per_sm=3),
    dict(block_n=32, programs_per_sm=3), dict(block_n=32)])
def test_kv_ahead_on_gpu(kw):
    """kv_ahead with evict_first on a GPU-sized B1 long context (the defaults, which take it from
    16384 keys; split 128 ways; a register cap for 3 programs per SM; 32-key tiles), against
    the float64 reference (one case per test: they spread over test workers)."""
    case = make_case(np.random.default_rng(37), B=1, hq=32, hkv=8, d=128, bs=16, lens=(20000,))
    check(case, "bfloat16", **dict(dict(kv_ahead=True, kv_evict="evict_first"), **kw))


@on_gpu
def test_kv_ahead_on_gpu_uneven_lengths():
    case = make_case(np.random.default_rng(38), B=4, hq=32, hkv=8, d=128, bs=16,
                     lens=(3000, 17, 0, 700))
    check(case, "bfloat16", kv_ahead=True, kv_evict="evict_first")
    check(case, "float32", kv_ahead=True)


def test_split_heuristic_uneven_lengths():
    """One long sequence among short ones splits finer than the work average asks for."""
    dev = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    lens = [8192] + [200] * 63
    kps, ns = K._splits(64, 8, 1, 8192, (8192, sum(lens)), 64, dev)
    assert kps <= 8192 // K.UNEVEN_SPLITS and kps * ns >= 8192


def test_split_heuristic():
    """Few long sequences split; many sequences do not; the splits always cover the table."""
    dev = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    slots = K.num_sms(dev) * K.PROGRAMS_PER_SM
    kps, ns = K._splits(1, 8, 1, 32768, (32768, 32768), 64, dev)
    assert ns > 1 and kps * ns >= 32768 and kps % 64 == 0
    kps, ns = K._splits(4 * slots, 8, 1, 4096, (4096, 4 * slots * 4096), 64, dev)
    assert ns == 1 and kps == 4096
    kps, ns = K._splits(2, 8, 1, 8192, None, 64, dev)      # lengths unknown: capacity
    assert kps * ns >= 8192


def test_split_heuristic_programs_per_sm(monkeypatch):
    """More resident programs per SM assumed: more, shorter splits (B1 on 132 SMs)."""
    monkeypatch.setattr(K, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    assert K._splits(1, 8, 1, 32768, (32768, 32768), 64, dev, 2) == (1024, 32)
    assert K._splits(1, 8, 1, 32768, (32768, 32768), 64, dev, 3) == (704, 47)
    assert K._splits(1, 8, 1, 32768, (32768, 32768), 32, dev, 3) == (672, 49)


def test_prefetch_rule():
    """Block ids are read ahead when the programs are few or their lengths uneven; many
    programs of equal length rely on occupancy instead (and are sized for more programs)."""
    dev = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    sms = K.num_sms(dev)
    assert K._use_prefetch(1, 1, 1, (32768, 32768), dev) and sms > 1
    assert not K._use_prefetch(sms, 8, 1, (4096, sms * 4096), dev)
    assert K._use_prefetch(sms, 8, 1, (8192, 8192 + (sms - 1) * 200), dev)
    assert not K._use_prefetch(sms, 8, 1, None, dev)


@pytest.mark.parametrize("lens,bad,msg", [
    ((5, 2), None, r"context_lens\[1\] = 2 is smaller than the 3 new"),
    ((5, 13), None, r"context_lens\[1\] = 13 exceeds max_blocks \* block_size"),
    ((5, 3), (1, 0, 40), r"block_table\[1, 0\] = 40 is not a block of the pool"),
])
def test_invalid_data_raises_before_launch(lens, bad, msg):
    case = make_case(np.random.default_rng(5), B=2, sq=3, d=16, lens=(5, 3), mb=3)
    case["context_lens"] = np.asarray(lens, np.int32)
    if bad:
        case["block_table"] = case["block_table"].copy()
        case["block_table"][bad[0], bad[1]] = bad[2]
    with pytest.raises(FuelGraphError, match="paged_attn: " + msg):
        run(to_dev(case, "float32"))


def test_check_runs_once_per_buffer_version(monkeypatch):
    case = make_case(np.random.default_rng(6), B=2, d=16, lens=(5, 3), mb=3)
    dc = to_dev(case, "float32")
    run(dc)
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(1) or
                        real(self, *a, **k))
    run(dc)
    assert calls == []                                       # memo hit: no sync
    alias = dict(dc, context_lens=dc["context_lens"].detach(),
                 block_table=dc["block_table"][:, :])
    run(alias)
    assert calls == []                                       # aliases of the same memory too
    fresh = dict(dc, context_lens=dc["context_lens"].clone(),
                 block_table=dc["block_table"].clone())
    K.assume_valid(fresh["context_lens"], fresh["block_table"], 1, dc["k_cache"].shape[0],
                   dc["k_cache"].shape[1], 5, 8)
    run(fresh)
    assert calls == []                                       # vouched for by the caller
    run(dict(dc, context_lens=dc["context_lens"].clone()))
    assert calls                                             # new memory: checked
    dc["context_lens"][1] = 99                               # in-place change: checked again
    with pytest.raises(FuelGraphError, match="exceeds"):
        run(dc)


@pytest.mark.parametrize("split,prefill", [(1, False), (2, False), (1, True)])
def test_nan_rows_when_the_check_is_skipped(split, prefill, monkeypatch):
    """While a CUDA graph is captured the check cannot sync; the kernels then write NaN rows
    for a sequence with invalid data (and never read outside the pool) instead of a number."""
    monkeypatch.setattr(K, "_capturing", lambda: True)
    case = make_case(np.random.default_rng(7), B=3, sq=2, d=16, lens=(6, 5, 6), mb=3)
    case["context_lens"] = np.array([1, 13, 6], np.int32)      # too short, too long, fine
    case["block_table"] = case["block_table"].copy()
    case["block_table"][2, 1] = 10 ** 6                          # live entry outside the pool
    got = run(to_dev(case, "float32"), n_split=split, prefill=prefill).cpu().numpy()
    assert np.isnan(got).all()
    case["block_table"][2, 1] = case["block_table"][2, 0]
    got = run(to_dev(case, "float32"), n_split=split, prefill=prefill).cpu().numpy()
    assert np.isnan(got[:2]).all() and np.isfinite(got[2]).all()


def test_supports():
    from fuelgraph import dtype as dt
    s = [(2, 8, 1, 128), (4, 16, 2, 128), (4, 16, 2, 128), (2, 4), (2,)]
    assert K.supports_paged_attn(s, [dt.bfloat16] * 3 + [dt.int32] * 2)
    assert not K.supports_paged_attn(s, [dt.float64] * 3 + [dt.int32] * 2)
    big = [(2, 8, 1, 512)] + s[1:]
    assert not K.supports_paged_attn(big, [dt.float32] * 3 + [dt.int32] * 2)


@pytest.mark.parametrize("index", [torch.int32, torch.uint32])
def test_cache_write(index):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 4, 2, 8, generator=g).to(DEV)
    new = torch.randn(3, 2, 8, generator=g).to(DEV)
    skip = torch.iinfo(index).max if index != torch.uint32 else 2 ** 32 - 1
    slots = torch.tensor([11, skip, 0], dtype=torch.int64).to(index).to(DEV)
    want = cache.clone().reshape(12, 2, 8)
    want[11], want[0] = new[0], new[2]
    out = torch.empty_like(cache)
    r = KC.paged_cache_write(cache, new, slots, out=out)
    assert r is out and torch.equal(out.reshape(12, 2, 8), want)
    r = KC.paged_cache_write(cache, new, slots)
    assert r is cache and torch.equal(cache.reshape(12, 2, 8), want)
    with pytest.raises(FuelGraphError, match="paged_cache_write: slot_mapping writes slot 0"):
        KC.paged_cache_write(cache, new, torch.tensor([0, 0, 1], dtype=torch.int32, device=DEV))


def test_cache_write_skips_the_check_of_slots_known_valid(monkeypatch):
    """Slots a caller declared valid (assume_valid_slots) are not checked again (a sync each);
    a later in-place change to them is."""
    calls = []
    monkeypatch.setattr(KC, "check_slots", lambda *a: calls.append(a))
    cache, new = torch.zeros(2, 4, 1, 8).to(DEV), torch.ones(2, 1, 8).to(DEV)
    slots = torch.tensor([5, 1], dtype=torch.int32).to(DEV)
    KC.assume_valid_slots(slots, 8)
    KC.paged_cache_write(cache, new, slots)
    assert calls == [] and cache.reshape(8, 1, 8)[5].eq(1).all()
    slots.add_(1)                                   # a new version: checked again
    KC.paged_cache_write(cache, new, slots)
    assert len(calls) == 1
    KC.assume_valid_slots(slots, 4)                 # another pool size: checked
    KC.paged_cache_write(cache, new, slots)
    assert len(calls) == 2


@pytest.mark.parametrize("n_new", [1, 3])
def test_cache_write_kv(n_new):
    """k and v [B, Hkv, n_new, D] (a transposed view: strided) into both pools in one launch."""
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(4, 4, 3, 8, generator=g).to(DEV) for _ in range(2))
    kn, vn = (torch.randn(2, n_new, 3, 8, generator=g).to(DEV).transpose(1, 2) for _ in range(2))
    slots = torch.tensor([5, 14, 2, 9, 0, 15][:2 * n_new - 1] + [2 ** 31 - 1],
                         dtype=torch.int32).to(DEV)
    wk, wv = kc.clone().reshape(16, 3, 8), vc.clone().reshape(16, 3, 8)
    for r, s in enumerate(slots.tolist()[:-1]):
        b, t = divmod(r, n_new)
        wk[s], wv[s] = kn[b, :, t], vn[b, :, t]
    KC.paged_cache_write_kv(kc, vc, kn, vn, slots)
    assert torch.equal(kc.reshape(16, 3, 8), wk) and torch.equal(vc.reshape(16, 3, 8), wv)


def test_cache_write_kv_op():
    """PAGED_CACHE_WRITE_KV's kernel: rows [N, Hkv, D] of k and v into both pools, in place,
    the skip value honoured; invalid slots raise."""
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(3, 4, 2, 8, generator=g).to(DEV) for _ in range(2))
    kn, vn = (torch.randn(3, 2, 8, generator=g).to(DEV) for _ in range(2))
    slots = torch.tensor([7, 2 ** 31 - 1, 0], dtype=torch.int32).to(DEV)
    wk, wv = kc.clone().reshape(12, 2, 8), vc.clone().reshape(12, 2, 8)
    wk[7], wk[0], wv[7], wv[0] = kn[0], kn[2], vn[0], vn[2]
    rk, rv = KC.paged_cache_write_kv_op(kc, vc, kn, vn, slots)
    assert rk is kc and rv is vc
    assert torch.equal(kc.reshape(12, 2, 8), wk) and torch.equal(vc.reshape(12, 2, 8), wv)
    with pytest.raises(FuelGraphError, match="outside the pool"):
        KC.paged_cache_write_kv_op(kc, vc, kn, vn, torch.tensor([12, 1, 0], dtype=torch.int32,
                                                                 device=DEV))


# ---- API level (a GPU) --------------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_paged_attn_on_cuda(dtype):
    case = make_case(np.random.default_rng(8), hq=8, hkv=2, sq=3, d=64, bs=16,
                     lens=(40, 3, 0), alibi=True, dtype="float32")
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[dtype]
    ts = {k: fg.from_torch(torch.from_numpy(v).to("cuda").to(tdt) if k in ("q", "k_cache",
                                                                         "v_cache")
                           else torch.from_numpy(v).to("cuda"))
          for k, v in case.items()}
    out = F.paged_attn(**ts, softcap=5.0)
    if dtype == "float64":
        assert_lowered_on_cuda(out, "paged_attn")
    got = np.asarray(out.numpy(), np.float64)
    ref = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_table"],
                          case["context_lens"], case["alibi_slopes"], softcap=5.0)
    tol = {"float32": 1e-5, "bfloat16": 3e-2, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


@on_gpu
def test_cache_write_on_cuda_in_place_and_functional():
    rng = np.random.default_rng(9)
    cache = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)
    new = rng.standard_normal((2, 2, 8)).astype(np.float32)
    slots = np.array([21, 3], np.int32)
    want = cache.copy().reshape(24, 2, 8)
    want[21], want[3] = new
    c = fg.tensor(cache, device="cuda")
    out = F.paged_cache_write(c * 1.0, fg.tensor(new, device="cuda"),
                              fg.tensor(slots, device="cuda"))
    np.testing.assert_array_equal(out.numpy().reshape(24, 2, 8), want)
    np.testing.assert_array_equal(c.numpy(), cache)


@on_gpu
def test_kv_cache_on_cuda():
    from fuelgraph.nn import PagedKVCache
    cache = PagedKVCache(32, 16, 2, 64, max_blocks_per_seq=8, dtype=fg.bfloat16, device="cuda")
    seqs = cache.add_sequences(3)
    rng = np.random.default_rng(10)
    hist_k, hist_v = [[] for _ in range(3)], [[] for _ in range(3)]
    for n in (20, 1, 1):
        cache.extend(seqs, n)
        q, k, v = (torch.from_numpy(rng.standard_normal((3, h, n, 64)).astype(np.float32))
                   .to("cuda").bfloat16() for h in (8, 2, 2))
        cache.write(seqs, fg.from_torch(k), fg.from_torch(v))
        out = cache.attention(seqs, fg.from_torch(q)).to_torch()
        for b in range(3):
            hist_k[b].append(k[b])
            hist_v[b].append(v[b])
            kk, vv = torch.cat(hist_k[b], 1), torch.cat(hist_v[b], 1)
            L = kk.shape[1]
            mask = torch.arange(L, device="cuda")[None] <= (L - n + torch.arange(n, device="cuda"))[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b].double(), kk.double(), vv.double(), attn_mask=mask, enable_gqa=True)
            torch.testing.assert_close(out[b].double(), ref, rtol=3e-2, atol=3e-2)
