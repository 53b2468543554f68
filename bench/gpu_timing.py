"""GPU timing for ratios between kernels (bench_cuda_attention.py's row 5 and --methods).

Why row 5 is timed interleaved (H200, session 11, bench --methods with a clock trace): under
load the H200 sits at its software power cap (nvidia-smi reason 0x4) and its SM clock moves
between 1710 and 1980 MHz from one 100 ms sample to the next, so two kernels timed one after
the other (do_bench in turn) see different clocks: window 1024 / plain causal measured 1.126,
1.124, 1.133 and 1.143 that way, softcap 50 0.999 to 1.096, while interleaved call by call
it measured 1.081, 1.077, 1.089, 1.094, 1.091 and softcap 1.125, 1.124, 1.125, 1.125 in four
runs. A kernel timed alone also settles at its own clock: softcap 50 (fewer tensor-core
cycles a second) ran 1.198 ms alone and 1.260 ms interleaved with the others, plain causal
1.123 and 1.120; interleaving compares the kernels at one clock.

A ratio of two separate timings carries the clock and temperature drift between them (a
setting timed later in a run can lose ~5% to drift alone). `interleaved_ms` times every
function once a round, call by call, the order reversed every other round, each call timed
by its own CUDA events after an L2 flush (as triton's do_bench: cold L2, the flush outside
the timed window), with the CPU left to run ahead of the GPU (no synchronisation between
calls, so no launch gap inside a timed window): the per-round ratios compare calls made
microseconds apart.

`paired_ms` (batches of back-to-back calls, alternating) is kept for comparison. Before
session 11 its first call after each batch pair's synchronisation started on an idle GPU, so
that batch's timed window also held the host's time for the call (0.12-0.22 ms for a
flash_attn call); the batches alternate which function pays it and the upper median of the
ratios picked a batch where the second function had: window 1.140 against 1.09 interleaved.
Each batch pair now starts queued behind a GPU spin (head_start_ms). `ahead_ms` is do_bench
with every launch queued behind a GPU spin and `host_ms` the host's time a call: with the
host at 0.12-0.22 ms a call, do_bench's own windows held no waits; its spread is the clock's."""
from __future__ import annotations

import time

import torch

#: bytes zeroed between timed calls: more than the H200's 50 MB L2 (do_bench's 256 MB)
FLUSH_BYTES = 256 * 1024 * 1024
#: spin cycles a second (the H200's top SM clock, 1980 MHz: a spin lasts at least as asked)
SPIN_HZ = 2.0e9


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def gpu_sleep(ms):
    """Keep the GPU busy for about `ms` (a spin kernel), so that the host's launches queue up
    behind it and the GPU never waits for them inside a timed window."""
    torch.cuda._sleep(int(ms * 1e-3 * SPIN_HZ))


def host_ms(fn, calls=20):
    """The host's time a call of fn (its launches queued behind a GPU spin, so none waits)."""
    fn()
    torch.cuda.synchronize()
    gpu_sleep(calls * 5.0)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return ms


def ahead_ms(fn, reps=100, flush=True):
    """do_bench's median (an L2 flush, then one call timed by its own events, `reps` times)
    with every launch queued behind a GPU spin first: the timed windows hold GPU time only,
    however long the host takes a call."""
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu_sleep(reps * 2.0 * max(host_ms(fn, 5), 0.05))
    events = []
    for _ in range(reps):
        if flush:
            cache.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return median([s.elapsed_time(e) for s, e in events])


def interleaved_ms(fns, rounds=60, warmup=3, flush=True, head_start_ms=30.0):
    """{name: [ms of each round]} for the functions of the dict `fns`, timed call by call, one
    call each a round (order reversed every other round), with an L2 flush before each call
    (flush=False: back to back) outside its events; the launches start queued behind a GPU
    spin of head_start_ms (the host then stays ahead while a round's GPU time exceeds its
    host time)."""
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    if head_start_ms:
        gpu_sleep(head_start_ms)
    events = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            if flush:
                cache.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fns[n]()
            end.record()
            events[n].append((start, end))
    torch.cuda.synchronize()
    return {n: [s.elapsed_time(e) for s, e in ev] for n, ev in events.items()}


def ratio_stats(times, base, name):
    """(median of the per-round time ratios name / base, ratio of the medians)."""
    per_round = [b / a for a, b in zip(times[base], times[name])]
    return median(per_round), median(times[name]) / median(times[base])


def paired_ms(fa, fb, batches, iters=4, detail=False, head_start_ms=2.0):
    """(ms of fa, ms of fb, upper median over batches of fb's time / fa's): `batches` batches
    of `iters` back-to-back calls of each, timed with CUDA events, the two alternating (which
    goes first flips every batch). detail: also the ratios of the batches where fa went
    first and where fb did. head_start_ms: each batch pair's launches queued behind a GPU
    spin that long (0: the first call's host time lands in its batch, as before session 11:
    window 1024 / plain causal 1.055 in the batches where plain went first, 1.150 where the
    window did; with the spin 1.092 / 1.107)."""
    fa(), fb()
    ta, tb, ratio = [], [], []
    for i in range(batches):
        if head_start_ms:
            gpu_sleep(head_start_ms)
        times = []
        for fn in ((fa, fb) if i % 2 == 0 else (fb, fa)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        a, b = (x[0].elapsed_time(x[1]) / iters for x in (times if i % 2 == 0 else times[::-1]))
        ta.append(a)
        tb.append(b)
        ratio.append(b / a)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    if detail:
        return med(ta), med(tb), med(ratio), ratio[0::2], ratio[1::2]
    return med(ta), med(tb), med(ratio)
