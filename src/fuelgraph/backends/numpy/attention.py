"""NumPy kernels for FLASH_ATTN (12) and FLASH_ATTN_BACKWARD (0x111: dq, dk and dv in one pass;
FLASH_ATTN_BACKWARD_Q/K/V (22-24) lower to it).

The work is tiled like FlashAttention: the rows of a query block (for every query head that
shares a key/value head, so grouped-query attention reads each key block once and copies no
k/v) against blocks of keys, with an online softmax in the forward (exponents relative to a
per-row base that moves only when a tile's row sum grows past 2^40: no max pass over the tiles)
and recomputed probabilities from the saved row log-sum-exp in the backward.
Scores are never held for more than one (query block, key block) tile; every product is one
batched BLAS call over a chunk of heads. Tiles wholly outside the mask are skipped, tiles
wholly inside it are not masked, the rest are masked from per-row admissible key intervals
(the causal / window / k_len constraints are all intervals [lo_i, hi_i) of keys).

Compute is float32 for float32/bfloat16/float16 inputs and float64 for float64; outputs are
rounded once. Work units (head chunk x query block) run on the shared thread pool; each pool
thread limits OpenBLAS to one thread of its own while it runs (BLAS calls from several threads
otherwise contend for one BLAS pool), so the kernels use the cores once and no more.
"""
from __future__ import annotations

import collections
import math
import threading

import numpy as np

from ...errors import FuelGraphError
from ...registry.attention import FLASH_ATTN_BACKWARD
from ...registry.core import FusedOps
from ..base import Cost, kernel
from .common import NUM_THREADS, _get_pool, acc_dtype, blas_single, new_output, store, to_acc

#: elements of one score tile (heads x rows x keys); 2^18 float32 = 1 MiB stays in L2
TILE_ELEMS = 1 << 18
#: keys per tile and (folded) query rows per tile
BLOCK_K = 256
BLOCK_ROWS = 128
#: below this many score elements (Sq * L * B * Hq) everything runs on the calling thread
PARALLEL_MIN = 1 << 20


def _run_parallel(groups, work) -> None:
    """work(group) for every group; the calling thread takes the first."""
    groups = [g for g in groups if g]
    if len(groups) <= 1:
        # single-threaded BLAS here too: a tile's batched GEMMs are small, and OpenBLAS's own
        # threads on them cost more than they give (measured: 5-50x slower on a shared 2-core
        # machine with FUELGRAPH_NUM_THREADS=1 and two BLAS threads)
        for g in groups:
            blas_single(lambda: work(g))
        return
    err = np.geterr()

    def run(g):
        with np.errstate(**err):
            blas_single(lambda: work(g))
    futures = [_get_pool().submit(run, g) for g in groups[1:]]
    try:
        run(groups[0])
    finally:
        for f in futures:
            f.result()


# ---- problem setup --------------------------------------------------------------------------
class _Problem:
    """Shapes, the live key count, per-row admissible key intervals [lo, hi) and the inputs in
    the compute dtype, heads grouped by key/value head: q-like arrays are [B*Hkv, G, Sq, X],
    keys and values [B*Hkv, L, D + 1] with a last column of ones.

    That column lets one GEMM do a per-row subtraction as well: with a query row extended by
    -c_i, (k_j, 1) . (q_i, -c_i) = q_i . k_j - c_i, so the forward gets its scores relative to
    the running max, and the backward its scores minus the saved log-sum-exp (and
    dO_i . v_j - delta_i), without another pass over the tile; with values extended by 1 the
    P V product also yields the row sums of P. A softcap (tanh between the product and the
    shift) takes the explicit path."""

    def __init__(self, op, q, k, v, opt, p, values_ext=True, fold=True):
        """values_ext: the folded layout also extends the values (the backward's dP - delta
        GEMM); fold=False: never fold (the forward, whose shift is 0 but for rare rows).
        Scores stay in natural units (not base 2 for NumPy's faster exp2): the backward
        recomputes them bit for bit, so exp(s - lse) is consistent to the last digit."""
        self.op = op
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        self.B, self.Hq, self.Hkv, self.Sq, self.Sk, self.D = B, Hq, Hkv, Sq, Sk, D
        self.G = G = Hq // Hkv
        self.BH = B * Hkv
        self.acc = acc = acc_dtype(q.dtype)
        alibi = opt[0] if p["has_alibi"] else None
        if p["k_len_input"]:
            L = int(np.asarray(opt[-1]))
            if not 0 <= L <= Sk:
                raise FuelGraphError(f"{op}: k_len = {L} is outside [0, Sk = {Sk}]")
        else:
            L = Sk if p["k_len"] is None else int(p["k_len"])
        self.L = L
        self.off = L - Sq
        a = np.arange(Sq, dtype=np.int64) + self.off
        lo = np.zeros(Sq, np.int64)
        hi = np.full(Sq, L, np.int64)
        if p["causal"]:
            hi = np.minimum(hi, a + 1)
        if p["window_size_right"] is not None:
            hi = np.minimum(hi, a + int(p["window_size_right"]) + 1)
        if p["window_size_left"] is not None:
            lo = np.maximum(lo, a - int(p["window_size_left"]))
        self.lo, self.hi = lo, np.maximum(hi, lo)        # empty rows: lo == hi
        self._masks, self._has_keys = {}, {}
        self.scale = float(p["softmax_scale"])
        self.cap = None if p["softcap"] is None else float(p["softcap"])
        # shifts folded into the GEMMs: costs extended copies of q, dO, k and v and GEMMs
        # with K = D + 1 (OpenBLAS runs them ~25% slower than K = D), which pays only when the
        # inputs are converted anyway; in the compute dtype the units read q and dO in place
        # and subtract the shifts (one backward, B4 Hq8 Hkv4 S256 D64 causal, one thread:
        # 20.4-21.8 ms folded, 17.6-18.6 ms not)
        self.fold = fold and self.cap is None and acc != q.dtype
        # scores are (q * qmul) @ k^T, then cap * tanh(.) with a softcap
        self.qmul = acc.type(self.scale / self.cap if self.cap else self.scale)
        self.slopes = None
        if alibi is not None:
            sl = np.broadcast_to(np.asarray(alibi, np.float32).reshape(-1, Hq), (B, Hq))
            self.slopes = sl.astype(acc).reshape(self.BH, 1, G, 1)
        plain = lambda x: to_acc(x[:, :, :L].reshape(self.BH, L, D), acc)  # noqa: E731
        if self.fold:
            self.kx = self._ext(k)
            self.k = self.kx[..., :D]
            self.vx = self._ext(v) if values_ext else None
            self.v = self.vx[..., :D] if values_ext else plain(v)
        else:
            self.k, self.v = plain(k), plain(v)
        # tile: rows x keys x heads ~ TILE_ELEMS; few rows (decoding) get long key blocks
        self.bq = min(max(8, BLOCK_ROWS // G), max(Sq, 1))
        rows = G * self.bq
        self.hc = max(1, min(self.BH, TILE_ELEMS // (rows * BLOCK_K)))
        self.bk = max(1, min(16, TILE_ELEMS // (self.hc * rows * BLOCK_K))) * BLOCK_K

    def _ext(self, x):
        """[B, Hkv, Sk, D] -> live keys [B*Hkv, L, D + 1] in acc, last column 1."""
        out = np.empty((self.BH, self.L, self.D + 1), self.acc)
        out[..., self.D] = 1
        out[..., :self.D] = x[:, :, :self.L].reshape(self.BH, self.L, self.D)
        return out

    def q_like(self, x, mul=None, extra=None):
        """[B, Hq, Sq, D] -> [B*Hkv, G, Sq, D (+1)] in acc, times mul; with `extra`
        ([B, Hq, Sq]) a last column -extra (+inf there reads as 0: those rows are masked)."""
        D = x.shape[-1]
        out = np.empty((self.BH, self.G, self.Sq, D + (extra is not None)), self.acc)
        q4 = x.reshape(self.BH, self.G, self.Sq, D)
        if mul is not None:
            np.multiply(to_acc(q4, self.acc), mul, out=out[..., :D])
        else:
            out[..., :D] = q4
        if extra is not None:
            e = extra.reshape(self.BH, self.G, self.Sq)
            np.negative(np.where(np.isinf(e), 0, e), out=out[..., D])
        return out

    def row_like(self, x):
        """[B, Hq, Sq] -> [B*Hkv, G, Sq] in acc."""
        return to_acc(x, self.acc).reshape(self.BH, self.G, self.Sq)

    def q_source(self, x, scaled=True):
        """(x [B, Hq, Sq, X] as [B*Hkv, G, Sq, X], the factor `q_rows` still applies or None):
        a view when x is in the compute dtype (each unit then scales its own rows: no q-sized
        copy), else converted (and scaled: qmul, with `scaled`) once by `q_like`."""
        if x.dtype == self.acc:
            return x.reshape(self.BH, self.G, self.Sq, x.shape[-1]), \
                (self.qmul if scaled else None)
        return self.q_like(x, self.qmul if scaled else None), None

    def q_rows(self, src, h0, h1, i0, i1, name):
        """The contiguous rows [hc, G*nq, X] of one unit of a `q_source` (times its factor) in
        this thread's scratch buffer `name`."""
        a, mul = src
        rows = _array(name, (h1 - h0, self.G, i1 - i0, a.shape[-1]), self.acc)
        if mul is None:
            np.copyto(rows, a[h0:h1, :, i0:i1])
        else:
            np.multiply(a[h0:h1, :, i0:i1], mul, out=rows)
        return rows.reshape(h1 - h0, -1, a.shape[-1])

    def rows_output(self, units):
        """An uninitialised [B*Hkv, G, Sq, D] output whose rows outside every unit (query
        blocks without an admissible key) are zero."""
        out = new_output((self.BH, self.G, self.Sq, self.D), self.acc)
        done = {u[2] for u in units}
        for i0 in range(0, self.Sq, self.bq):
            if i0 not in done:
                out[:, :, i0:min(i0 + self.bq, self.Sq)] = 0
        return out

    def has_keys(self, i0, i1):
        """[G * nq] bool: the rows of a unit (g * nq + i) that have an admissible key."""
        got = self._has_keys.get(i0)
        if got is None:
            got = self._has_keys[i0] = np.tile(self.hi[i0:i1] > self.lo[i0:i1], self.G)
        return got

    # -- tiling --
    def units(self):
        """(h0, h1, i0, i1) work units: head chunks x query blocks with a live key."""
        bq, hc = self.bq, self.hc
        out = []
        for i0 in range(0, self.Sq, bq):
            i1 = min(i0 + bq, self.Sq)
            if not np.any(self.hi[i0:i1] > self.lo[i0:i1]):
                continue
            for h0 in range(0, self.BH, hc):
                out.append((h0, min(h0 + hc, self.BH), i0, i1))
        return out

    def tiles(self, i0, i1):
        """(j0, j1, None or (m0, m1, outside-mask [m1 - m0, 1, nq])) of the key blocks rows
        i0:i1 see: a partial block masks only its keys m0:m1 (relative to j0) that some row
        excludes, e.g. the diagonal's keys of a causal block (the block tests are vectorized
        over blocks: a Python loop of small NumPy calls per block cost ~5% of a forward)."""
        lo, hi = self.lo[i0:i1], self.hi[i0:i1]
        live = hi > lo
        jstart, jend = int(lo[live].min()), int(hi[live].max())
        j0s = np.arange(jstart, jend, self.bk)
        j1s = np.minimum(j0s + self.bk, jend)
        masked = ((hi[None, :] <= j0s[:, None]) | (lo[None, :] >= j1s[:, None])).all(1)
        whole = ((lo[None, :] <= j0s[:, None]) & (hi[None, :] >= j1s[:, None])).all(1)
        out = []
        for j0, j1, m, w in zip(j0s.tolist(), j1s.tolist(), masked.tolist(), whole.tolist()):
            if m:
                continue                                        # wholly masked
            if w:
                out.append((j0, j1, None))                      # wholly admissible
                continue
            lo_max, hi_min = int(lo.max()), int(hi.min())
            m0 = j0 if lo_max > j0 else max(j0, hi_min)
            m1 = j1 if hi_min < j1 else min(j1, lo_max)
            out.append((j0, j1, (m0 - j0, m1 - j0, self._mask(m0, m1, lo, hi))))
        return out

    def _mask(self, m0, m1, lo, hi):
        """outside [m1 - m0, 1, nq]: keys m0:m1 against rows with intervals [lo, hi); kept by
        pattern relative to m0 (every diagonal block of a causal mask has the same one)."""
        key = (m1 - m0, (lo - m0).tobytes(), (hi - m0).tobytes())
        mask = self._masks.get(key)
        if mask is None:
            j = np.arange(m0, m1)[:, None]
            mask = self._masks[key] = ((j < lo) | (j >= hi))[:, None, :]
        return mask

    def score_tile(self, qb, h0, h1, i0, i1, j0, j1, outside, buf, tmp, want_tanh=True):
        """Transposed scores of keys j0:j1 against the rows qb ([hc, R = G*nq, D (+1)], times
        qmul) into buf: s [hc, nk, R], a query per column (per-row statistics are then
        reductions over axis 1 and broadcasts of contiguous vectors). With the folded layout qb
        carries the shift column; with a softcap s is cap * tanh(product). Then the ALiBi bias
        and -inf outside the mask. Returns (s, tanh or None: with want_tanh a copy of the
        softcap's tanh)."""
        hc, nq, nk = h1 - h0, i1 - i0, j1 - j0
        R = qb.shape[1]
        s = buf[:hc * nk * R].reshape(hc, nk, R)
        keys = self.kx if qb.shape[2] > self.D else self.k
        np.matmul(keys[h0:h1, j0:j1], qb.transpose(0, 2, 1), out=s)
        t = None
        if self.cap is not None:
            np.tanh(s, out=s)
            t = s.copy() if want_tanh else None
            s *= self.acc.type(self.cap)
        s4 = s.reshape(hc, nk, self.G, nq)
        if self.slopes is not None:
            dist = np.abs(np.arange(j0, j1)[:, None] - self.off - np.arange(i0, i1)[None, :])
            b = tmp[:s.size].reshape(s4.shape)
            np.multiply(self.slopes[h0:h1], dist.astype(self.acc)[:, None, :], out=b)
            s4 -= b
        if outside is not None:
            m0, m1, mask = outside
            np.copyto(s4[:, m0:m1], -np.inf, where=mask)
        return s, t


def _rows(a4, h0, h1, i0, i1):
    """[BH, G, Sq, X] -> contiguous [hc, G*nq, X] rows of one unit."""
    blk = a4[h0:h1, :, i0:i1]
    return np.ascontiguousarray(blk).reshape(h1 - h0, -1, *a4.shape[3:])


def _thread_groups(pb, units, nthr, by_head):
    """Split units over threads: whole head chunks per thread (by_head), or units dealt by
    their work (admissible pairs), largest first, to the least loaded thread (causal masks
    make query blocks unequal). Empty groups are dropped."""
    if nthr <= 1 or len(units) <= 1:
        return [units] if units else []
    if by_head:
        heads = sorted({(u[0], u[1]) for u in units})
        own = {h: n % nthr for n, h in enumerate(heads)}
        groups = [[u for u in units if own[(u[0], u[1])] == t] for t in range(nthr)]
    else:
        span = pb.hi - pb.lo
        work = [(u[1] - u[0]) * int(span[u[2]:u[3]].sum()) for u in units]
        load, groups = [0] * nthr, [[] for _ in range(nthr)]
        for n in sorted(range(len(units)), key=lambda n: -work[n]):
            t = load.index(min(load))
            groups[t].append(units[n])
            load[t] += work[n]
    return [g for g in groups if g]


def _threads(pb) -> int:
    work = pb.BH * pb.G * pb.Sq * max(pb.L, 1)
    return NUM_THREADS if work >= PARALLEL_MIN else 1


_local = threading.local()


def _buffer(name, n, dtype):
    """A flat scratch array of at least n elements of `dtype`, private to the calling thread and
    kept between calls: fresh arrays of a few MiB fault their pages in on every call (~1-2 us
    per 4 KiB page on the VM, a third of a forward when nothing else freed memory before)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (name, np.dtype(dtype).char)
    a = bufs.get(key)
    if a is None or a.size < n:
        a = bufs[key] = np.empty(max(n, 1), dtype)
    return a[:n]


def _array(name, shape, dtype):
    """`_buffer` as an array of `shape` (contents undefined)."""
    return _buffer(name, math.prod(shape), dtype).reshape(shape)


def _scratch(pb, n):
    return [_buffer(f"tile{i}", TILE_ELEMS * 2, pb.acc) for i in range(n)]


# ---- costs ----------------------------------------------------------------------------------
def attention_cost(products):
    """Cost of `products` [Sq x L x D] matrix products (halved by a causal mask) plus the bytes
    of q, k, v and one q-sized output per product beyond the first."""
    def cost(shapes, params=None):
        (B, Hq, Sq, D), (_, Hkv, Sk, _) = shapes[0], shapes[1]
        L = Sk if params is None or params.k_len is None else params.k_len
        frac = 0.5 if params is not None and params.causal else 1.0
        flops = 2.0 * B * Hq * Sq * L * D * products * frac
        return Cost(flops, 4.0 * (B * Hq * Sq * D * (1 + products) + 2 * B * Hkv * Sk * D))
    return cost


# ---- forward --------------------------------------------------------------------------------
#: the forward keeps exponents relative to a stale running max while a tile's max exceeds it
#: by at most this much (exp(8) ~ 3e3: no float32 overflow); larger jumps rescale
RESCALE_AT = 8.0
#: the folded forward (no max pass): a row moves its base once a tile's sum of exponentials
#: passes SUM_LIMIT (or overflows); a unit with a live row whose total stays below SUM_FLOOR
#: (terms near float32's smallest normals) is computed again from true maxima
SUM_LIMIT = 2.0 ** 40
SUM_FLOOR = 2.0 ** -60


@kernel(FusedOps.FLASH_ATTN, "numpy", cost=attention_cost(2))
def flash_attn(q, k, v, *opt, softmax_scale, causal=False, window_size_left=None,
               window_size_right=None, softcap=None, k_len=None, has_alibi=False,
               k_len_input=False):
    """FLASH_ATTN: q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] (one float dtype), then the optional
    alibi_slopes (float32 [Hq] | [B, Hq]) and k_len (0-d integer array) inputs the flags name
    -> (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32 / float64).

    Bottom-right aligned masks (query row i at key position i + L - Sq); causal keeps keys
    j <= that position, the windows keep j within [pos - left, pos + right]; softcap
    c * tanh(s / c) then ALiBi -slope * |pos - j|; only keys < L are read. A row with no
    admissible key gives out = 0 and lse = +inf. Raises FuelGraphError when a run-time k_len
    is outside [0, Sk]."""
    pb = _Problem("flash_attn", q, k, v, opt, _params(
        softmax_scale, causal, window_size_left, window_size_right, softcap, k_len,
        has_alibi, k_len_input), fold=False)
    G, D = pb.G, pb.D
    units = pb.units()
    out = pb.rows_output(units)
    lse = np.full((pb.BH, G, pb.Sq), np.inf, pb.acc)
    qs = pb.q_source(q)

    # threads take units from one queue, the most work first (causal masks make query blocks
    # unequal): a thread whose core another process takes meanwhile simply takes fewer
    span = pb.hi - pb.lo
    queue = collections.deque(sorted(
        units, key=lambda u: -(u[1] - u[0]) * int(span[u[2]:u[3]].sum())))

    def work(_):
        bufs = _scratch(pb, 2)
        while True:
            try:
                h0, h1, i0, i1 = queue.popleft()
            except IndexError:
                return
            if not _forward_unit_fast(pb, qs, h0, h1, i0, i1, *bufs, out, lse):
                _forward_unit(pb, qs, h0, h1, i0, i1, *bufs, out, lse)

    with np.errstate(all="ignore"):
        _run_parallel([[t] for t in range(min(_threads(pb), len(units)))], work)
    # [B*Hkv, G, Sq, D] is [B, Hq, Sq, D] (query head h = kv head * G + g): no copy needed
    return _narrow(out.reshape(q.shape), q.dtype), lse.reshape(q.shape[:3])


def _add_pv(p, vb, o, pv, first):
    """o (+)= p^T-tile @ v: the first tile writes o, later ones add through the scratch pv."""
    if first:
        np.matmul(p.transpose(0, 2, 1), vb, out=o)
    else:
        np.matmul(p.transpose(0, 2, 1), vb, out=pv)
        o += pv


def _finish_rows(o, l, base, out, lse, h0, h1, i0, i1, G):
    """Normalise o [hc, R, D] by its row sums l and store it and the rows' log-sum-exp
    (base + log l; rows with no admissible key: output 0, lse +inf) into out / lse."""
    hc, nq, D = h1 - h0, i1 - i0, o.shape[-1]
    live = l > 0
    if live.all():
        np.divide(o.reshape(hc, G, nq, D), l.reshape(hc, G, nq, 1), out=out[h0:h1, :, i0:i1])
        ls = base + np.log(l)
    else:
        o *= np.where(live, 1 / np.where(live, l, 1), 0)[..., None]
        ls = np.where(live, base + np.log(np.where(live, l, 1)), np.inf)
        out[h0:h1, :, i0:i1] = o.reshape(hc, G, nq, D)
    lse[h0:h1, :, i0:i1] = ls.reshape(hc, G, nq)


def _forward_unit_fast(pb, qs, h0, h1, i0, i1, buf, tmp, out, lse) -> bool:
    """The forward without a max pass: exponents relative to a per-row base that starts at 0
    (and, folded, lives in the GEMM's shift column). A tile's row sums bound its largest term,
    so a row whose sum passes SUM_LIMIT (rare: scores above ~28) has that tile's scores
    computed again and shifted by their true max. Per tile: one GEMM, exp, a row sum and the
    P V GEMM. Returns False (nothing written) when a live row ends with its sum below
    SUM_FLOOR (scores all far below 0): the caller then runs `_forward_unit`."""
    acc, D, ext = pb.acc, pb.D, pb.fold
    hc = h1 - h0
    qb = pb.q_rows(qs, h0, h1, i0, i1, "q")              # [hc, R, D (+1: -base)]
    R = qb.shape[1]
    base = np.zeros((hc, R), acc)
    shifted = False                                      # some base is not 0 (unfolded)
    o = _array("o", (hc, R, D), acc)
    l = np.zeros((hc, R), acc)
    pv = _array("pv", (hc, R, D), acc)
    rs = np.empty_like(l)
    rs3 = rs[:, None, :]
    ones = np.ones((1, max(pb.bk, 1)), acc)
    first = True
    for j0, j1, outside in pb.tiles(i0, i1):
        s, _ = pb.score_tile(qb, h0, h1, i0, i1, j0, j1, outside, buf, tmp, False)
        if shifted:
            s -= base[:, None, :]
        np.exp(s, out=s)
        np.matmul(ones[:, :j1 - j0], s, out=rs3)         # row sums: a GEMV beats sum(axis=1)
        big = ~(rs <= SUM_LIMIT)                         # also inf / nan sums
        if big.any():
            s, _ = pb.score_tile(qb, h0, h1, i0, i1, j0, j1, outside, buf, tmp, False)
            if shifted:
                s -= base[:, None, :]
            shift = np.where(big, s.max(1), 0)
            s -= shift[:, None, :]
            if not first:
                alpha = np.exp(-shift)
                o *= alpha[..., None]
                l *= alpha
            base += shift
            if ext:
                np.negative(base, out=qb[..., D])
            else:
                shifted = True
            np.exp(s, out=s)
            np.matmul(ones[:, :j1 - j0], s, out=rs3)
        l += rs
        _add_pv(s, pb.v[h0:h1, j0:j1], o, pv, first)
        first = False
    if first or (pb.has_keys(i0, i1) & (l < SUM_FLOOR)).any():
        return False
    _finish_rows(o, l, base, out, lse, h0, h1, i0, i1, pb.G)
    return True


def _forward_unit(pb, qs, h0, h1, i0, i1, buf, tmp, out, lse):
    """Online softmax over the key tiles of rows i0:i1 of heads h0:h1. `base` is the shift
    (the running max, or 0 while a row has seen no admissible key); o accumulates
    exp(s - base) @ v and l the row sums (a reduction of the tile: a ones column in the values
    would make the P V product an N = D + 1 GEMM, which BLAS runs markedly slower)."""
    acc, D, ext = pb.acc, pb.D, pb.fold
    hc = h1 - h0
    qb = pb.q_rows(qs, h0, h1, i0, i1, "q")              # [hc, R, D (+1)]
    R = qb.shape[1]
    base = np.zeros((hc, R), acc)
    empty = np.ones((hc, R), bool)
    o = np.zeros((hc, R, D), acc)
    l = np.zeros((hc, R), acc)
    pv = np.empty_like(o)
    rs = np.empty_like(l)
    first = True
    for j0, j1, outside in pb.tiles(i0, i1):
        s, _ = pb.score_tile(qb, h0, h1, i0, i1, j0, j1, outside, buf, tmp, False)
        if not ext:
            s -= base[:, None, :]
        mx = s.max(1)                                    # relative to base
        seen = mx > -np.inf
        need = (mx > RESCALE_AT) | (empty & seen)
        if need.any():
            shift = np.where(need, mx, 0)
            s -= shift[:, None, :]
            if not first:
                alpha = np.exp(-shift)
                o *= alpha[..., None]
                l *= alpha
            base += shift
            empty &= ~seen
            if ext:
                np.negative(base, out=qb[..., D])
        np.exp(s, out=s)
        l += np.sum(s, axis=1, out=rs)
        _add_pv(s, pb.v[h0:h1, j0:j1], o, pv, first)
        first = False
    _finish_rows(o, l, base, out, lse, h0, h1, i0, i1, pb.G)


# ---- backward -------------------------------------------------------------------------------
def _backward(q, k, v, grad_out, lse, delta, opt, p):
    """(dq, dk, dv)."""
    pb = _Problem("flash_attn_backward", q, k, v, opt, p)
    acc, D, L = pb.acc, pb.D, pb.L
    units = pb.units()
    dq = pb.rows_output(units)
    if pb.fold:
        qs = pb.q_like(q, pb.qmul, lse), None             # [q * qmul, -lse]
        dos = pb.q_like(grad_out, None, delta), None      # [dO, -delta]
        lse4 = delta4 = None
    else:
        qs, dos = pb.q_source(q), pb.q_source(grad_out, scaled=False)
        lse4 = pb.row_like(lse)[..., None]
        delta4 = pb.row_like(delta)[..., None]
    nthr = _threads(pb)
    by_head = len({(u[0], u[1]) for u in units}) >= nthr
    groups = _thread_groups(pb, units, nthr, by_head)
    # dk / dv accumulate over query blocks: one buffer per thread unless threads own heads
    nbuf = 1 if by_head else max(1, len(groups))
    dks = [_zeros((pb.BH, L, D), acc) for _ in range(nbuf)]
    dvs = [_zeros((pb.BH, L, D), acc) for _ in range(nbuf)]
    # d score / d (q.k) = scale (times 1 - tanh^2 with a softcap); dk uses qs = q * qmul
    kmul = acc.type(pb.scale / float(pb.qmul))

    def work(part):
        t = 0 if by_head else next(n for n, g in enumerate(groups) if g is part)
        bufs = _scratch(pb, 3)
        for h0, h1, i0, i1 in part:
            _backward_unit(pb, h0, h1, i0, i1, qs, dos, lse4, delta4, *bufs, dq, dks[t],
                           dvs[t])

    with np.errstate(all="ignore"):
        _run_parallel(groups, work)
    grads = [_narrow(dq.reshape(q.shape), q.dtype)]
    for bufs, mul in ((dks, kmul), (dvs, None)):
        tot = bufs[0]
        for b in bufs[1:]:
            tot += b
        if mul is not None:
            tot *= mul
        if L == pb.Sk:
            grads.append(_narrow(tot.reshape(k.shape), k.dtype))
            continue
        res = np.zeros(k.shape, k.dtype)
        store(res[:, :, :L], tot.reshape(pb.B, pb.Hkv, L, D))
        grads.append(res)
    return tuple(grads)


def _zeros(shape, dtype):
    out = new_output(shape, dtype)
    out.fill(0)
    return out


def _narrow(a, dtype):
    if a.dtype == dtype:
        return a
    res = np.empty(a.shape, dtype)
    store(res, a)
    return res


def _backward_unit(pb, h0, h1, i0, i1, qs, dos, lse4, delta4, buf, dbuf, tmp, dq, dk, dv):
    """Recompute the probabilities of each key tile of rows i0:i1 (heads h0:h1) from the saved
    lse and accumulate: dv += P^T dO, dS = P (dP - delta), dq += dS k, dk += dS^T q (all in the
    transposed tile layout [hc, nk, R])."""
    hc, D = h1 - h0, pb.D
    qb = pb.q_rows(qs, h0, h1, i0, i1, "q")              # [hc, R, D (+1)], times qmul
    dob = pb.q_rows(dos, h0, h1, i0, i1, "do")           # [hc, R, D (+1)]
    if not pb.fold:
        lseb = _rows(lse4, h0, h1, i0, i1).reshape(hc, 1, -1)     # [hc, 1, R]
        deltab = _rows(delta4, h0, h1, i0, i1).reshape(hc, 1, -1)
    dqb = _array("dq", (hc, qb.shape[1], D), pb.acc)
    dq_part = _array("dq_part", dqb.shape, pb.acc)
    dobv, qbv = dob[..., :D], qb[..., :D]
    first = True
    for j0, j1, outside in pb.tiles(i0, i1):
        s, t = pb.score_tile(qb, h0, h1, i0, i1, j0, j1, outside, buf, tmp)
        if not pb.fold:
            s -= lseb
        np.exp(s, out=s)                                 # probabilities
        nk = j1 - j0
        part = tmp[:hc * nk * D].reshape(hc, nk, D)
        np.matmul(s, dobv, out=part)
        dv[h0:h1, j0:j1] += part
        ds = dbuf[:s.size].reshape(s.shape)
        if pb.fold:                                      # dP - delta in the GEMM
            np.matmul(pb.vx[h0:h1, j0:j1], dob.transpose(0, 2, 1), out=ds)
        else:
            np.matmul(pb.v[h0:h1, j0:j1], dob.transpose(0, 2, 1), out=ds)
            ds -= deltab
        ds *= s
        if t is not None:                                # times 1 - tanh^2
            np.multiply(t, t, out=t)
            np.subtract(1, t, out=t)
            ds *= t
        if first:
            np.matmul(ds.transpose(0, 2, 1), pb.k[h0:h1, j0:j1], out=dqb)
            first = False
        else:
            np.matmul(ds.transpose(0, 2, 1), pb.k[h0:h1, j0:j1], out=dq_part)
            dqb += dq_part
        np.matmul(ds, qbv, out=part)
        dk[h0:h1, j0:j1] += part
    if first:                                            # no live key tile
        dqb[...] = 0
    # times the softmax scale as it is stored (each query row belongs to one unit)
    np.multiply(dqb.reshape(hc, pb.G, i1 - i0, D), pb.acc.type(pb.scale),
                out=dq[h0:h1, :, i0:i1])


def _params(softmax_scale, causal, window_size_left, window_size_right, softcap, k_len,
            has_alibi, k_len_input):
    return dict(softmax_scale=softmax_scale, causal=causal, window_size_left=window_size_left,
                window_size_right=window_size_right, softcap=softcap, k_len=k_len,
                has_alibi=has_alibi, k_len_input=k_len_input)


@kernel(FLASH_ATTN_BACKWARD, "numpy", cost=attention_cost(5))
def flash_attn_backward(q, k, v, grad_out, lse, delta, *opt, softmax_scale, causal=False,
                        window_size_left=None, window_size_right=None, softcap=None, k_len=None,
                        has_alibi=False, k_len_input=False):
    """FLASH_ATTN_BACKWARD (0x111, what FLASH_ATTN_BACKWARD_Q/K/V lower to): (dq, dk, dv) in one
    pass over the tiles. Inputs q, k, v, grad_out (like q), lse and delta ([B, Hq, Sq] float32
    / float64: the forward's row log-sum-exp and sum_d grad_out * out), then the forward's
    optional inputs; params as the forward. dk and dv are summed over the query heads of each
    key/value head and are zero for keys >= k_len. Raises FuelGraphError when a run-time k_len
    is outside [0, Sk]."""
    return _backward(q, k, v, grad_out, lse, delta, opt,
                     _params(softmax_scale, causal, window_size_left, window_size_right,
                             softcap, k_len, has_alibi, k_len_input))
