"""Triton source for a glue region's `Program` (see `backends.glue`): one kernel, one pass over
memory. Pure string generation (no torch or triton import), so it can be read and tested
anywhere; `kernels/glue.py` compiles, caches and launches it.

Two shapes of kernel:
* elementwise (no reduction): a 1-D grid over the flat index, `BLOCK` elements per program;
* rows (reductions over rows of n <= `MAX_ROW` elements): [BLOCK_R, BLOCK_N] tiles holding
  whole rows in registers; a value that depends only on the row is a [BLOCK_R, 1] column, one
  that depends only on the column (a weight, a bias) a [1, BLOCK_N] row, so broadcast inputs are
  loaded once per tile.

Inputs are read through the strides their views give them (a broadcast bias is one load of n
values, not a materialized array); 16-bit floats are computed in float32 and rounded only where
the graph casts and when stored. Division and square roots are IEEE-rounded (`div_rn`,
`sqrt_rn`) and transcendental functions come from libdevice, as torch's kernels compute them
(regions whose outputs are all 16-bit floats use the fast approximate forms instead, see
FAST_MATH_FOR_HALF_OUTPUTS);
under the CPU interpreter (`TRITON_INTERPRET=1`, no libdevice) `tl.*` stand-ins are used.
Sizes are literals of the source: a source is specific to the region's shapes, and its hash
keys the disk cache."""
from __future__ import annotations

import math

import numpy as np

from ..glue import FULL, ROW, Program, Unsupported

#: widest row a rows kernel holds in registers; wider rows loop over column chunks of LOOP_BLOCK
#: (one pass per level of reductions, recomputing the elementwise values from the inputs)
MAX_ROW = 16384
LOOP_BLOCK = 4096
MAX_LOOPED_ROW = 1 << 24
#: a looped kernel runs one program per row: rows longer than this are left to torch's
#: multi-block reductions unless there are at least MIN_ROWS_FOR_WIDE of them (a full reduction
#: of a large tensor would otherwise stream it through one multiprocessor)
WIDE_ROW = 1 << 20
MIN_ROWS_FOR_WIDE = 128
#: regions whose every output is a 16-bit float use the fast approximate float32 maths (ex2-based
#: exp, approximate division and square root: errors of a few float32 ulps, far below a bf16 or
#: fp16 rounding) instead of IEEE/libdevice, which can make a bf16 kernel compute-bound
FAST_MATH_FOR_HALF_OUTPUTS = True

_TL = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16",
       "int32": "tl.int32", "int64": "tl.int64", "uint8": "tl.uint8", "uint32": "tl.uint32",
       "bool": "tl.int1"}

_HELPERS = {
    "_maxnan": ("def _maxnan(a, b):\n"
                "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)\n"),
    "_minnan": ("def _minnan(a, b):\n"
                "    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)\n"),
    "_imax": "def _imax(a, b):\n    return tl.maximum(a, b)\n",
    "_imin": "def _imin(a, b):\n    return tl.minimum(a, b)\n",
    "_mul": "def _mul(a, b):\n    return a * b\n",
    # NumPy's float remainder: fmod, moved to the divisor's sign; a zero takes the divisor's sign
    "_frem": ("def _frem(a, b):\n"
              "    m = a % b\n"
              "    neg_b = b.to(tl.int32, bitcast=True) < 0\n"
              "    m = tl.where((m != 0) & ((m < 0) != (b < 0)), m + b, m)\n"
              "    return tl.where(m == 0, tl.where(neg_b, -0.0, 0.0), m)\n"),
    "_tanh_i": "def _tanh_i(x):\n    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)\n",
    "_pow_i": "def _pow_i(a, b):\n    return tl.exp(b * tl.log(a))\n",
}

_FLOAT_UNARY_GPU = {"exp": "libdevice.exp({})", "log": "libdevice.log({})",
                    "tanh": "libdevice.tanh({})", "erf": "libdevice.erf({})",
                    "sin": "libdevice.sin({})", "cos": "libdevice.cos({})"}
_FLOAT_UNARY_INTERP = {"exp": "tl.exp({})", "log": "tl.log({})", "tanh": "_tanh_i({})",
                       "erf": "tl.erf({})", "sin": "tl.sin({})", "cos": "tl.cos({})"}
_OPS = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^",
        "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def tl_dtype(d) -> str:
    return _TL[d.name]


def _literal(value, d) -> str:
    """`value` as stored in dtype `d`, written as Python source."""
    if d.kind == "b":
        return "1" if value else "0"
    if d.is_int:
        with np.errstate(all="ignore"):
            return str(int(np.asarray(value).astype(d.np)))
    with np.errstate(all="ignore"):
        v = float(np.asarray(value, dtype=np.float64).astype(d.np).astype(np.float32))
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


def check_supported(prog: Program) -> None:
    """Raise Unsupported for what the generated kernels do not cover (the region then runs as
    its recipe on the GPU): float64 anywhere, a few very long rows (see WIDE_ROW)."""
    if any(ins.dtype.name == "float64" for ins in prog.values) or \
            any(d.name == "float64" for _, d in prog.inputs):
        raise Unsupported("float64")
    if prog.n and prog.n > MAX_LOOPED_ROW:
        raise Unsupported(f"rows of {prog.n} > {MAX_LOOPED_ROW}")
    if prog.n and prog.n > WIDE_ROW and prog.rows < MIN_ROWS_FOR_WIDE:
        raise Unsupported(f"{prog.rows} rows of {prog.n}: too few programs")


class _Gen:
    def __init__(self, prog: Program, interpret: bool):
        self.p, self.interp = prog, interpret
        self.lines: list[str] = []
        self.helpers: set = set()
        self.rows_kernel = prog.n is not None
        big = prog.numel >= 2 ** 31 or any(math.prod(s) >= 2 ** 31 for s, _ in prog.inputs)
        self.idx64 = big
        self.one_shape = "[1, 1]" if self.rows_kernel else "[1]"
        self.looped = self.rows_kernel and prog.n > MAX_ROW
        self.fast = FAST_MATH_FOR_HALF_OUTPUTS and not interpret and all(
            d.is_float and d.itemsize == 2 for _, _, d in prog.outputs)
        self.name: dict[int, str] = {}

    def emit(self, s: str):
        self.lines.append("    " + s)

    # ---- index expressions ----------------------------------------------------------------
    def offset(self, ld) -> tuple[str, set]:
        """(offset expression, {'r', 'c', 'i'} it uses) of load `ld`."""
        n = self.p.n
        parts, uses = [], set()
        for div, mod, stride in ld.terms:
            if not self.rows_kernel:
                e, u = ("i" if div == 1 else f"(i // {div})"), "i"
            elif ld.space == ROW:
                e, u = ("r" if div == 1 else f"(r // {div})"), "r"
            elif div % n == 0:
                e, u = ("r" if div == n else f"(r // {div // n})"), "r"
            elif mod is not None and n % (div * mod) == 0:
                e, u = ("c" if div == 1 else f"(c // {div})"), "c"
                if div * mod == n:
                    mod = None
            else:
                e, u = ("i" if div == 1 else f"(i // {div})"), "i"
            if mod is not None:
                e = f"({e} % {mod})"
            parts.append(e if stride == 1 else f"{e} * {stride}")
            uses.add(u)
        if "i" in uses and self.rows_kernel:
            uses |= {"r", "c"}
        return (" + ".join(parts) if parts else "0"), uses

    def mask_for(self, uses: set) -> str | None:
        if not uses:
            return None
        if not self.rows_kernel:
            return "mask"
        if uses >= {"r", "c"}:
            return "mask"
        return "rmask" if "r" in uses else "cmask"

    # ---- values ---------------------------------------------------------------------------
    def value(self, k: int, ins) -> str:
        a = [self.name.get(j, f"v{j}") for j in ins.args]
        cd = tl_dtype(ins.cd)
        op = ins.op
        if op == "load":
            ld = ins.kind
            off, uses = self.offset(ld)
            m = self.mask_for(uses)
            ptr = f"in{ld.input}" if off == "0" else f"in{ld.input} + ({off})"
            e = f"tl.load({ptr}, mask={m}, other=0)" if m else f"tl.load({ptr})"
            return e if ins.cd == ins.dtype else f"{e}.to({cd})"
        if op == "const":
            return f"tl.full({self.one_shape}, {_literal(ins.kind, ins.dtype)}, {cd})"
        if op in ("alias", "bcast"):
            return a[0]
        if op == "unary":
            return self.unary(ins.kind, a[0], ins)
        if op == "binary":
            return self.binary(ins.kind, a[0], a[1], ins)
        if op == "compare":
            return f"{a[0]} {_OPS[ins.kind]} {a[1]}"
        if op == "where":
            return f"tl.where({a[0]}, {a[1]}, {a[2]})"
        if op == "cast":
            src = self.p.values[ins.args[0]]
            t = ins.dtype
            if src.dtype != src.cd and t != src.dtype:      # from a 16-bit float: its value
                a = [f"{a[0]}.to({tl_dtype(src.dtype)}).to(tl.float32)"]
            if t.kind == "b":
                return f"{a[0]} != 0" if src.dtype.kind != "b" else a[0]
            if t.is_float and t.itemsize < 4:
                if src.dtype.kind == "b":           # 0 or 1: exact
                    return f"{a[0]}.to(tl.float32)"
                x = a[0] if src.dtype.is_float else f"{a[0]}.to(tl.float32)"
                return f"{x}.to({tl_dtype(t)}).to(tl.float32)"
            return f"{a[0]}.to({cd})"
        if op == "reduce":
            return self.reduce(ins.kind, a[0], ins)
        raise Unsupported(op)

    def unary(self, kind, x, ins) -> str:
        d = ins.cd
        if not d.is_float:
            if kind == "neg":
                return f"-{x}"
            if kind == "abs":
                return f"tl.abs({x})"
            if kind == "sign":
                neg = f"tl.where({x} < 0, -1, 0)" if d.kind == "i" else "0"
                return f"tl.where({x} > 0, 1, {neg}).to({tl_dtype(d)})"
            raise Unsupported(kind)
        one = f"tl.full({self.one_shape}, 1.0, tl.float32)"
        simple = {"neg": "-{}", "abs": "tl.abs({})", "sqrt": "tl.sqrt_rn({})",
                  "floor": "tl.floor({})", "recip": f"tl.div_rn({one}, {{}})",
                  "rsqrt": f"tl.div_rn({one}, tl.sqrt_rn({{}}))",
                  "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, {0} * 0.0))"}
        if self.fast:
            simple.update({"sqrt": "tl.sqrt({})", "recip": "1.0 / {}", "rsqrt": "tl.rsqrt({})",
                           "exp": "tl.exp({})", "log": "tl.log({})"})
        if kind in simple:
            return simple[kind].format(x)
        table = _FLOAT_UNARY_INTERP if self.interp else _FLOAT_UNARY_GPU
        if kind not in table:
            raise Unsupported(kind)
        if kind == "tanh" and self.interp:
            self.helpers.add("_tanh_i")
        return table[kind].format(x)

    def binary(self, kind, a, b, ins) -> str:
        d = ins.cd
        if kind in ("add", "sub", "mul", "and", "or", "xor"):
            return f"{a} {_OPS[kind]} {b}"
        if kind in ("maximum", "minimum"):
            fn = "tl.maximum" if kind == "maximum" else "tl.minimum"
            nan = ", propagate_nan=tl.PropagateNan.ALL" if d.is_float else ""
            return f"{fn}({a}, {b}{nan})"
        if d.is_float:
            if kind == "div":
                return f"{a} / {b}" if self.fast else f"tl.div_rn({a}, {b})"
            if kind == "pow":
                if self.interp:
                    self.helpers.add("_pow_i")
                    return f"_pow_i({a}, {b})"
                return f"libdevice.pow({a}, {b})"
            if kind == "rem":
                self.helpers.add("_frem")
                return f"_frem({a}, {b})"
            raise Unsupported(kind)
        signed = d.kind == "i"
        safe = f"tl.where({b} == 0, 1, {b})"
        if kind == "div":           # floor division; x // 0 is 0, as NumPy's
            q = f"({a} // {safe})"
            if signed:
                inexact = f"((({a} % {safe}) != 0) & (({a} < 0) != ({b} < 0)))"
                q = f"({q} - {inexact}.to({tl_dtype(d)}))"
            return f"tl.where({b} == 0, 0, {q})"
        if kind == "rem":           # remainder with the divisor's sign; x % 0 is 0
            m = f"({a} % {safe})"
            if signed:
                m = f"tl.where(({m} != 0) & (({m} < 0) != ({b} < 0)), {m} + {b}, {m})"
            return f"tl.where({b} == 0, 0, {m})"
        if kind in ("shl", "shr"):  # shifts by >= the width (or < 0) give 0 (or the sign fill)
            bits = d.itemsize * 8
            ok = f"(({b} >= 0) & ({b} < {bits}))" if signed else f"({b} < {bits})"
            sb = f"tl.where({ok}, {b}, 0)"
            if kind == "shl":
                return f"tl.where({ok}, {a} << {sb}, 0)"
            fill = f"tl.where({a} < 0, -1, 0)" if signed else "0"
            return f"tl.where({ok}, {a} >> {sb}, {fill})"
        raise Unsupported(kind)

    def reduce(self, kind, x, ins) -> str:
        d = ins.cd
        if d.is_float:
            ident = {"sum": "0.0", "prod": "1.0", "max": 'float("-inf")', "min": 'float("inf")'}
        else:
            info = np.iinfo(d.np)
            ident = {"sum": "0", "prod": "1", "max": str(int(info.min)), "min": str(int(info.max))}
        masked = f"tl.where(mask, {x}, {ident[kind]})"
        if kind == "sum":
            return f"tl.sum({masked}, axis=1, keep_dims=True).to({tl_dtype(d)})"
        fn = {"prod": "_mul", "max": "_maxnan" if d.is_float else "_imax",
              "min": "_minnan" if d.is_float else "_imin"}[kind]
        self.helpers.add(fn)
        return f"tl.reduce({masked}, 1, {fn}, keep_dims=True)"

    # ---- the kernel -------------------------------------------------------------------------
    def source(self) -> str:
        p = self.p
        n_in, n_out = len(p.inputs), len(p.outputs)
        args = [f"in{k}" for k in range(n_in)] + [f"out{k}" for k in range(n_out)]
        if self.looped:
            self.looped_body()
            return self.module(args, "BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr")
        if self.rows_kernel:
            head = ["r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]",
                    "c = tl.arange(0, BLOCK_N)[None, :]",
                    f"rmask = r < {p.rows}",
                    f"cmask = c < {p.n}",
                    "mask = rmask & cmask"]
            if self.idx64:
                head.append("r = r.to(tl.int64)")
            head.append(f"i = r * {p.n} + c")
            consts = "BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr"
        else:
            pid = "tl.program_id(0).to(tl.int64)" if self.idx64 else "tl.program_id(0)"
            head = [f"i = {pid} * BLOCK + tl.arange(0, BLOCK)", f"mask = i < {p.numel}"]
            consts = "BLOCK: tl.constexpr"
        for h in head:
            self.emit(h)
        stores = {}
        for j, (v, shape, d) in enumerate(p.outputs):
            stores.setdefault(v, []).append((j, d))
        for k, ins in enumerate(p.values):
            self.emit(f"v{k} = {self.value(k, ins)}")
            for j, d in stores.get(k, ()):
                self.store(j, k, ins, d)
        return self.module(args, consts)

    def module(self, args, consts) -> str:
        out = ["import triton", "import triton.language as tl"]
        if not self.interp:
            out.append("from triton.language.extra.cuda import libdevice")
        out.append("")
        for h in sorted(self.helpers):
            out += ["", "@triton.jit", _HELPERS[h].rstrip()]
        out += ["", "", "@triton.jit", f"def glue_kernel({', '.join(args)}, {consts}):"]
        return "\n".join(out + self.lines) + "\n"

    def looped_body(self):
        """Rows wider than MAX_ROW: reductions of level 1 (reading no row value) are accumulated
        over column chunks in a first loop, those of level 2 (reading level-1 row values) in a
        second, ...; a last loop computes and stores the full-size outputs. Elementwise values
        are recomputed from the inputs in each loop that needs them (inputs stay in L2)."""
        p = self.p
        vals = p.values
        level = []
        for ins in vals:
            lv = max((level[a] for a in ins.args), default=0)
            level.append(lv + 1 if ins.op == "reduce" else lv)
        passes = max((level[k] for k, ins in enumerate(vals) if ins.op == "reduce"), default=0)
        stores: dict = {}
        for j, (v, shape, d) in enumerate(p.outputs):
            stores.setdefault(v, []).append((j, d))
        full = [ins.space == FULL for ins in vals]
        self.emit("r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
        self.emit(f"rmask = r < {p.rows}")
        if self.idx64:
            self.emit("r = r.to(tl.int64)")

        def emit_rows(lv):
            for k, ins in enumerate(vals):
                if not full[k] and ins.op != "reduce" and level[k] == lv:
                    self.emit(f"v{k} = {self.value(k, ins)}")
                    self.name[k] = f"v{k}"
                    for j, d in stores.get(k, ()):
                        self.store(j, k, ins, d)

        def needed(roots):
            need, stack = set(), list(roots)
            while stack:
                k = stack.pop()
                if k in need or not full[k]:
                    continue
                need.add(k)
                stack.extend(vals[k].args)
            return sorted(need)

        def loop(pas, roots, body_tail):
            self.emit(f"for start in range(0, {p.n}, BLOCK_N):")
            self.emit("    c = start + tl.arange(0, BLOCK_N)[None, :]")
            self.emit(f"    cmask = c < {p.n}")
            self.emit("    mask = rmask & cmask")
            self.emit(f"    i = r * {p.n} + c")
            for k in needed(roots):
                self.name[k] = f"v{k}_{pas}"
                self.emit(f"    v{k}_{pas} = {self.value(k, vals[k])}")
            body_tail()
            for k in needed(roots):
                self.name.pop(k, None)

        emit_rows(0)
        for pas in range(1, passes + 1):
            reds = [k for k, ins in enumerate(vals) if ins.op == "reduce" and level[k] == pas]
            for k in reds:
                ident, _, dt = self.reduce_parts(vals[k])
                self.emit(f"acc{k} = tl.full([BLOCK_R, BLOCK_N], {ident}, {dt})")

            def tail(reds=reds):
                for k in reds:
                    ident, combine, _ = self.reduce_parts(vals[k])
                    x = self.name[vals[k].args[0]]
                    masked = f"tl.where(mask, {x}, {ident})"
                    step = f"acc{k} + {masked}" if combine is None else \
                        f"{combine}(acc{k}, {masked})"
                    self.emit(f"    acc{k} = {step}")
            loop(pas, [vals[k].args[0] for k in reds], tail)
            for k in reds:
                _, combine, dt = self.reduce_parts(vals[k])
                if combine is None:
                    self.emit(f"v{k} = tl.sum(acc{k}, axis=1, keep_dims=True).to({dt})")
                else:
                    self.emit(f"v{k} = tl.reduce(acc{k}, 1, {combine}, keep_dims=True)")
                self.name[k] = f"v{k}"
                for j, d in stores.get(k, ()):
                    self.store(j, k, vals[k], d)
            emit_rows(pas)
        outs = [v for v in stores if full[v]]
        if outs:
            def tail():
                for v in outs:
                    for j, d in stores[v]:
                        self.store(j, v, vals[v], d, indent="    ")
            loop(passes + 1, outs, tail)

    def reduce_parts(self, ins):
        """(identity literal, combine helper or None for a sum, accumulator dtype)."""
        d = ins.cd
        if d.is_float:
            ident = {"sum": "0.0", "prod": "1.0", "max": 'float("-inf")', "min": 'float("inf")'}
        else:
            info = np.iinfo(d.np)
            ident = {"sum": "0", "prod": "1", "max": str(int(info.min)), "min": str(int(info.max))}
        combine = None if ins.kind == "sum" else {
            "prod": "_mul", "max": "_maxnan" if d.is_float else "_imax",
            "min": "_minnan" if d.is_float else "_imin"}[ins.kind]
        if combine:
            self.helpers.add(combine)
        return ident[ins.kind], combine, tl_dtype(d)

    def store(self, j, k, ins, d, indent=""):
        if self.rows_kernel:
            if ins.space == ROW:
                off, m, shape = "r", "rmask", "[BLOCK_R, 1]"
            else:
                off, m, shape = "i", "mask", "[BLOCK_R, BLOCK_N]"
        else:
            off, m, shape = "i", "mask", "[BLOCK]"
        val = f"tl.broadcast_to({self.name.get(k, f'v{k}')}, {shape})"
        if d != ins.cd:
            val = f"{val}.to({tl_dtype(d)})"
        self.emit(f"{indent}tl.store(out{j} + {off}, {val}, mask={m})")


def generate(prog: Program, interpret: bool = False) -> str:
    """The Triton source of `prog`'s kernel `glue_kernel(in0.., out0.., <block constexprs>)`."""
    check_supported(prog)
    return _Gen(prog, interpret).source()
