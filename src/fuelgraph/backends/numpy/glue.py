"""Generated glue kernels on NumPy: a region (see `backends.glue`) runs as one blocked
evaluation instead of one NumPy call per primitive over whole arrays. The iteration space is cut
into chunks of about `CHUNK` elements (whole rows for regions with reductions); each chunk
evaluates every primitive of the region with the same ufuncs as the primitive kernels, writing
into scratch buffers that are reused as values die, so intermediates stay in the core's cache
and no large temporary is ever allocated; chunks are split over the backend's thread pool.

Results: bit-identical to the primitive kernels for float32/float64/integer/bool values (same
ufuncs, same order; reductions are the same per-row NumPy reductions), and closer than them for
16-bit floats, which are computed in float32 and rounded where the graph casts to or from them
and when stored (the primitives round after every op).

Why not numexpr or numba: neither is a dependency of fuelgraph, numexpr has no bfloat16 and no
row reductions, and numba costs a compile per region and dtype; the blocked ufunc evaluation
needs nothing new and is measured in bench/bench_glue.py."""
from __future__ import annotations

import math

import numpy as np

from ..base import elementwise_cost, kernel_factory
from ..glue import FULL, ROW, Program, Unsupported, build_program
from .common import NUM_THREADS, PARALLEL_MIN_ELEMS, new_output, run_spans, store, to_acc
from .primitives import _BINARY, _COMPARE, _REDUCE, _UNARY, _erf

#: elements per chunk: 256 KiB of float32 per live value; a region's few live values stay in
#: L2. Measured (2 cores, silu(g) * u + r over 512x1024): 4K 21 ms, 16K 11 ms, 64K 6.4 ms, 256K
#: 10.6 ms per 5 runs: smaller chunks pay Python per ufunc call, larger ones leave the cache
CHUNK = 1 << 16


def _boundaries(prog: Program) -> list[int]:
    """Cuts 1 = c0 | c1 | ... | cm = numel of the flat F index (each divides the next) that the
    loads' index terms and the row length fall on where possible: the joint shape of the
    region is (cm/c(m-1), ..., c1/c0), which every load can be reshaped to without a copy."""
    cuts = [1, prog.numel]

    def insert(b):
        if b <= 1 or b >= prog.numel or b in cuts:
            return True
        k = next(i for i, c in enumerate(cuts) if c > b)
        if b % cuts[k - 1] == 0 and cuts[k] % b == 0:
            cuts.insert(k, b)
            return True
        return False

    if prog.n:
        insert(prog.n)
    for ins in prog.values:
        if ins.op != "load":
            continue
        scale = prog.n if ins.space == ROW else 1
        for div, mod, _ in ins.kind.terms:
            insert(div * scale)
            if mod is not None:
                insert(div * mod * scale)
    return cuts


class GlueEvaluator:
    """kernel(*inputs) -> output array(s) for one Program."""

    def __init__(self, prog: Program, chunk: int | None = None):
        self.prog = prog
        chunk = chunk or CHUNK
        cuts = _boundaries(prog) if prog.numel else [1]
        self.joint = tuple(cuts[k + 1] // cuts[k] for k in reversed(range(len(cuts) - 1)))
        nd = len(self.joint)
        trail = cuts.index(prog.n) if prog.n else 0          # the axes of one row
        self.trail = trail
        self.row_joint = self.joint[:nd - trail] + (1,) * trail
        self.red_axes = tuple(range(-trail, 0))
        # chunk: whole axes from k on (at most `chunk` elements, whole rows), a range of axis k-1
        k = nd
        while k > 0 and math.prod(self.joint[k - 1:]) <= chunk:
            k -= 1
        self.k = k = min(k, nd - trail)
        inner = math.prod(self.joint[k:])
        self.step = max(1, chunk // max(inner, 1)) if k > 0 else 0
        self.chunk_rows = self.step if k > 0 else 1
        # a value's scratch buffer is reused once its last reader ran; aliases (reshapes, row
        # broadcasts) read their source's buffer, so they extend its life
        owner = list(range(len(prog.values)))
        for i, ins in enumerate(prog.values):
            if ins.op in ("alias", "bcast"):
                owner[i] = owner[ins.args[0]]
        last_use = {}
        for i, ins in enumerate(prog.values):
            last_use[owner[i]] = max(last_use.get(owner[i], i), i)
            for a in ins.args:
                last_use[owner[a]] = i
        self.out_of = {}
        for j, (v, _, _) in enumerate(prog.outputs):
            self.out_of.setdefault(v, []).append(j)
        self.dies = [[] for _ in prog.values]
        for a, i in last_use.items():
            self.dies[i].append(a)
        self.flat_size = {sp: (self.chunk_rows * math.prod(self.shape_of((), sp)[self.k:])
                               if self.k else math.prod(self.shape_of((), sp)))
                          for sp in (FULL, ROW)}
        self.consts = {}
        with np.errstate(all="ignore"):
            for i, ins in enumerate(prog.values):
                if ins.op == "const":
                    c = np.asarray(ins.kind).astype(ins.dtype.np)
                    self.consts[i] = c.astype(ins.cd.np) if ins.cd != ins.dtype else c
        self.steps = self._compile()
        self._prepare_call()

    # ---- chunks ---------------------------------------------------------------------------
    def chunks(self) -> list[tuple]:
        k, joint = self.k, self.joint
        if k == 0:
            return [()]
        out = []
        for idx in np.ndindex(*joint[:k - 1]):
            for a in range(0, joint[k - 1], self.step):
                out.append(tuple(idx) + (slice(a, min(a + self.step, joint[k - 1])),))
        return out

    def shape_of(self, sl, space) -> tuple:
        base = self.joint if space == FULL else self.row_joint
        if not sl:
            return base
        return (sl[-1].stop - sl[-1].start,) + base[self.k:]

    # ---- the kernel ---------------------------------------------------------------------------
    def _prepare_call(self):
        """Everything a call needs that does not depend on the input buffers."""
        prog = self.prog
        self.empty = not (prog.numel and prog.rows)
        self.out_specs = [(shape, np.dtype(d.np)) for _, shape, d in prog.outputs]
        self.out_shapes = [self.joint if math.prod(shape) == prog.numel and
                           prog.values[v].space != ROW else self.row_joint
                           for v, shape, _ in prog.outputs]
        self.loads = []
        for i, ins in enumerate(prog.values):
            if ins.op != "load":
                continue
            ld = ins.kind
            target = self.joint if ld.space == FULL else self.row_joint
            if ld.terms == ((1, None, 1),):
                kind = "contiguous"                # a plain reshape
            elif not ld.terms:
                kind, target = "scalar", (1,) * len(target)
            else:
                kind = "strided"
            self.loads.append((i, ld.input, kind, ld.shape, ld.strides, target))
        self.chunk_list = self.chunks()
        self.whole_shapes = {FULL: self.joint, ROW: self.row_joint}
        # values computed straight into an output (no scratch buffer, no copy afterwards): the
        # first output of a computed value of the output's dtype and iteration space
        self.direct = {}
        for j, (v, shape, d) in enumerate(prog.outputs):
            ins = prog.values[v]
            space = ROW if ins.op == "reduce" else ins.space
            if v in self.direct or ins.op not in _DIRECT_OPS or ins.cd != ins.dtype or \
                    np.dtype(ins.cd.np) != self.out_specs[j][1] or space not in (FULL, ROW) or \
                    self.out_shapes[j] != self.whole_shapes[space]:
                continue
            self.direct[v] = j

    def __call__(self, *inputs):
        outs = [new_output(shape, d) for shape, d in self.out_specs]
        if not self.empty:
            out_views = [o.reshape(s) for o, s in zip(outs, self.out_shapes)]
            views = {}
            for i, k, kind, shape, strides, target in self.loads:
                buf = inputs[k]
                if kind != "strided":
                    views[i] = buf.reshape(target)
                else:
                    views[i] = _strided_view(buf, shape, strides).reshape(target)
            chunks = self.chunk_list
            nthr = min(NUM_THREADS, len(chunks))
            if len(chunks) == 1:
                self._run_whole(views, out_views)
            elif nthr <= 1 or self.prog.numel < PARALLEL_MIN_ELEMS:
                self._run(views, out_views, chunks)
            else:
                bounds = [len(chunks) * i // nthr for i in range(nthr + 1)]
                spans = [(bounds[i], bounds[i + 1]) for i in range(nthr)]
                run_spans(lambda c0, c1: self._run(views, out_views, chunks[c0:c1]), spans,
                          self.prog.numel)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run_whole(self, views, out_views):
        """One chunk (a small region): fresh arrays, dropped as soon as they are dead."""
        shapes = self.whole_shapes
        vals: list = [None] * len(self.steps)

        direct = self.direct

        def alloc(i, dtype, space):
            j = direct.get(i)
            return np.empty(shapes[space], dtype) if j is None else out_views[j]

        for i, (step, outs, dies) in enumerate(self.steps):
            v = vals[i] = step(vals, (), views, alloc, shapes)
            for j in outs:
                if direct.get(i) == j:
                    continue
                dst = out_views[j]
                if dst.shape == np.shape(v):
                    store(dst, v)
                else:
                    dst[...] = v
            for d in dies:
                vals[d] = None

    def workspace_bytes(self) -> int:
        """Scratch a call holds at its peak beyond its outputs (for the memory plan): the
        largest set of live chunk-sized values (a value's buffer is reused once it is dead),
        per thread that runs chunks."""
        prog = self.prog
        size: dict = {}
        for i, ins in enumerate(prog.values):
            space = ROW if ins.op == "reduce" else ins.space
            if space not in (FULL, ROW):
                continue
            item = np.dtype(ins.cd.np).itemsize
            if i in self.direct:                     # computed in its output: no scratch
                continue
            if ins.op in ("unary", "binary", "compare", "where", "reduce") or \
                    (ins.op == "load" and ins.cd != ins.dtype):
                size[i] = self.flat_size[space] * item
            elif ins.op == "cast":                   # astype temporaries on 16-bit casts
                size[i] = self.flat_size[space] * (item + ins.dtype.itemsize)
        live = peak = 0
        for i, (_, _, dies) in enumerate(self.steps):
            live += size.get(i, 0)
            peak = max(peak, live)
            live -= sum(size.get(d, 0) for d in dies)
        chunks = self.chunk_list
        threads = min(NUM_THREADS, len(chunks)) if len(chunks) > 1 and \
            prog.numel >= PARALLEL_MIN_ELEMS else 1
        return peak * threads

    def _run(self, views, out_views, chunks):
        pool: dict = {}
        steps = self.steps
        direct = self.direct
        for sl in chunks:
            shapes = {FULL: self.shape_of(sl, FULL), ROW: self.shape_of(sl, ROW)}
            vals: list = [None] * len(steps)
            owned: dict = {}

            def scratch(i, dtype, space, _sl=sl):
                j = direct.get(i)
                if j is not None:
                    return out_views[j][_sl] if _sl else out_views[j]
                key = (dtype, space)
                free = pool.setdefault(key, [])
                flat = free.pop() if free else np.empty(self.flat_size[space], dtype)
                owned[i] = (key, flat)
                shape = shapes[space]
                return flat[:math.prod(shape)].reshape(shape)

            for i, (step, outs, dies) in enumerate(steps):
                v = vals[i] = step(vals, sl, views, scratch, shapes)
                for j in outs:
                    if direct.get(i) == j:
                        continue
                    dst = out_views[j][sl] if sl else out_views[j]
                    if dst.shape == np.shape(v):
                        store(dst, v)
                    else:
                        dst[...] = v
                for d in dies:
                    got = owned.pop(d, None)
                    if got is not None:
                        pool[got[0]].append(got[1])
                    vals[d] = None

    def _compile(self):
        """One closure per instruction, all decisions taken once: step(vals, slicer, views,
        scratch, shapes) -> the value."""
        steps = []
        for i, ins in enumerate(self.prog.values):
            steps.append((_step(i, ins, self), tuple(self.out_of.get(i, ())), tuple(self.dies[i])))
        return steps


def _strided_view(buf, shape, strides):
    """A read-only view of buf with element strides: the ndarray constructor over a
    C-contiguous buffer (~1 us) rather than as_strided (~4 us; a decode step's small regions
    make a few dozen such views)."""
    st = tuple(s * buf.itemsize for s in strides)
    if buf.flags.c_contiguous and buf.size:
        try:
            v = np.ndarray(shape, buf.dtype, buffer=buf, strides=st)
        except (TypeError, ValueError):
            pass
        else:
            v.flags.writeable = False
            return v
    return np.lib.stride_tricks.as_strided(buf, shape, st, writeable=False)


#: instructions that write their value through `scratch` (so into an output when direct)
_DIRECT_OPS = ("unary", "binary", "compare", "reduce")


def _step(i, ins, ev):
    op, args, space = ins.op, ins.args, ins.space
    cd = np.dtype(ins.cd.np)
    if op == "load":
        whole = not ins.kind.terms       # a scalar (a [1, ...] view): the same in every chunk
        def load(vals, sl, views, scratch, shapes):
            v = views[i][sl] if sl and not whole else views[i]
            return v if v.dtype == cd else to_acc(v, cd)
        return load
    if op == "const":
        c = ev.consts[i]
        return lambda vals, sl, views, scratch, shapes: c
    a0 = args[0] if args else None
    if op in ("alias", "bcast"):
        return lambda vals, sl, views, scratch, shapes: vals[a0]
    if op == "unary":
        kind = ins.kind
        return lambda vals, sl, views, scratch, shapes: _unary(kind, vals[a0],
                                                               scratch(i, cd, space))
    if op == "binary":
        f = np.floor_divide if ins.kind == "div" and cd.kind in "iu" else _BINARY[ins.kind]
        a1 = args[1]
        return lambda vals, sl, views, scratch, shapes: f(vals[a0], vals[a1],
                                                          out=scratch(i, cd, space))
    if op == "compare":
        f, a1 = _COMPARE[ins.kind], args[1]
        return lambda vals, sl, views, scratch, shapes: f(vals[a0], vals[a1],
                                                          out=scratch(i, cd, space))
    if op == "where":                       # one pass (np.where has no out=)
        a1, a2 = args[1], args[2]
        return lambda vals, sl, views, scratch, shapes: np.where(vals[a0], vals[a1], vals[a2])
    if op == "cast":
        src = ev.prog.values[a0]
        if ins.cd != ins.dtype:             # to a 16-bit float: round, compute on in float32
            half = ins.dtype.np
            return lambda vals, sl, views, scratch, shapes: \
                np.asarray(vals[a0]).astype(half).astype(cd)
        if src.cd != src.dtype:             # from a 16-bit float: the rounded value widens
            half = src.dtype.np
            return lambda vals, sl, views, scratch, shapes: \
                np.asarray(vals[a0]).astype(half).astype(cd)

        def cast(vals, sl, views, scratch, shapes):
            v = scratch(i, cd, space)
            np.copyto(v, vals[a0], casting="unsafe")
            return v
        return cast
    if op == "reduce":
        f = _REDUCE[ins.kind]
        int_sum = ins.kind == "sum" and cd.kind in "iub"
        axes = ev.red_axes

        def reduce(vals, sl, views, scratch, shapes):
            x = vals[a0]
            if x.shape != shapes[FULL]:
                x = np.broadcast_to(x, shapes[FULL])
            out = scratch(i, cd, ROW)
            if int_sum:
                return np.sum(x, axis=axes, keepdims=True, dtype=cd, out=out)
            return f(x, axis=axes, keepdims=True, out=out)
        return reduce
    raise Unsupported(op)                   # pragma: no cover - build_program rejects it


def _unary(kind, x, out):
    if kind == "rsqrt":                         # as the primitive: 1 / sqrt(x)
        np.sqrt(x, out=out)
        return np.divide(1.0, out, out=out)
    if kind == "recip":
        return np.divide(1.0, x, out=out)
    if kind == "erf":
        r = _erf(x)
        np.copyto(out, r)
        return out
    return _UNARY[kind](x, out=out)


def _binary(kind, a, b, out):
    if kind == "div" and out.dtype.kind in "iu":
        return np.floor_divide(a, b, out=out)
    return _BINARY[kind](a, b, out=out)


def _cost(prog):
    def cost(shapes, params=None):
        c = elementwise_cost(shapes)
        return type(c)(c.flops * max(1, len(prog.values)), c.bytes)
    return cost


@kernel_factory("glue", "numpy")
def glue_kernel(entry):
    """The blocked evaluator of a glue region (None when the region holds something it does
    not compute: the region then runs as its recipe)."""
    try:
        prog = build_program(entry.body)
    except Unsupported:
        return None
    ev = GlueEvaluator(prog)
    ws = ev.workspace_bytes()
    return {"kernel": ev, "cost": _cost(prog), "name": f"numpy.{entry.name}",
            "precision": "fp32 for 16-bit, else T",
            "workspace": lambda shapes, dtypes, params: ws}

