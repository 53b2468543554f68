"""Generated Triton glue kernels (backends/cuda/glue_codegen.py, kernels/glue.py): every glue
region of random programs (hypothesis) run through its generated kernel against the reference
mode (`lower_all`, one NumPy call per primitive) on the region's own inputs; the row kernel; the
disk cache (a second load and a second process reuse the source and Triton's binary); what the
generator declines. Kernel tests run on a GPU or, tiny, under TRITON_INTERPRET=1 (the CPU
interpreter has no libdevice, so the generated source then uses tl.* stand-ins: exp/log/tanh/
erf/sin/cos/pow there are NumPy's); API tests go through fuelgraph on device="cuda" (GPU)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from .cuda_oracle import DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS, on_gpu, torch

import fuelgraph as fg  # noqa: E402
from fuelgraph.backends.glue import Unsupported, build_program  # noqa: E402
from fuelgraph.backends.cuda import glue_codegen  # noqa: E402
from fuelgraph.ir import ops  # noqa: E402
from fuelgraph.ir.node import toposort  # noqa: E402
from fuelgraph.ir.tensor import Tensor  # noqa: E402

from glue_programs import glue_program  # noqa: E402

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import glue as K

SETTINGS = settings(max_examples=12 if INTERPRET else 60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ROOT = Path(__file__).resolve().parents[3]


def to_torch(a):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEV)
    return torch.from_numpy(np.ascontiguousarray(a).copy()).to(DEV)


def to_numpy(t):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def glue_nodes(outs):
    res = fg.optimize(outs)
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)
            and fg.default_registry().entry(n.op.id).family == "glue"]


def run_regions(outs, tol):
    """Each glue region of `outs`: its generated kernel on its inputs vs its recipe."""
    checked = 0
    for n in glue_nodes(outs):
        e = fg.default_registry().entry(n.op.id)
        try:
            launcher = K.GlueLauncher(build_program(e.body), interpret=INTERPRET)
        except Unsupported:
            continue
        ins = [t.numpy() for t in fg.realize([Tensor(s) for s in n.srcs], lower_all=True)]
        ref = [t.numpy() for t in fg.realize([Tensor(n.out(i)) for i in range(n.nout)],
                                             lower_all=True)]
        got = launcher(*[to_torch(a) for a in ins])
        got = got if isinstance(got, tuple) else (got,)
        for g, r in zip(got, ref):
            g = to_numpy(g)
            assert g.dtype == r.dtype and g.shape == r.shape
            if r.dtype.kind in "iub":
                np.testing.assert_array_equal(g, r)
                continue
            g64, r64 = g.astype(np.float64), r.astype(np.float64)
            np.testing.assert_array_equal(np.isnan(g64), np.isnan(r64))
            fin = np.isfinite(r64)
            np.testing.assert_array_equal(g64[~fin & ~np.isnan(r64)], r64[~fin & ~np.isnan(r64)])
            scale = np.abs(r64[fin]).max() if fin.any() else 0.0
            np.testing.assert_allclose(g64[fin], r64[fin], rtol=tol, atol=tol * scale + 1e-30)
        checked += 1
    return checked


@KERNEL_TESTS
@pytest.mark.parametrize("kind", ["float32", "int32", "bool"])
def test_random_regions_match_the_reference(kind):
    @SETTINGS
    @given(glue_program(kind, max_ops=5))
    def run(prog):
        outs, desc = prog
        run_regions(outs, 1e-5 if INTERPRET else 2e-5)
    run()


@KERNEL_TESTS
def test_random_bf16_regions_within_rounding():
    @SETTINGS
    @given(glue_program("bfloat16", max_ops=3, reductions=False))
    def run(prog):
        outs, desc = prog
        run_regions(outs, 2 ** -6)
    run()


@KERNEL_TESTS
@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16, fg.float16])
def test_norm_with_weight_and_residual_row_kernel(dtype):
    rng = np.random.default_rng(0)
    x, r = (fg.tensor(rng.standard_normal((10, 96)).astype(np.float32)).astype(dtype)
            for _ in range(2))
    w = fg.tensor(rng.standard_normal(96).astype(np.float32)).astype(dtype)
    xf = x.astype(fg.float32)
    y = (xf * ((xf * xf).sum(-1, keepdim=True) * (1.0 / 96) + 1e-6).sqrt() * w.astype(fg.float32)
         ).astype(dtype) + r
    assert run_regions([y], 1e-5 if dtype == fg.float32 else 2 ** -6) >= 1


@KERNEL_TESTS
def test_swiglu_residual_elementwise_kernel_bf16():
    rng = np.random.default_rng(1)
    g, u, r = (fg.tensor(rng.standard_normal((33, 70)).astype(np.float32)).astype(fg.bfloat16)
               for _ in range(3))
    assert run_regions([g.silu() * u + r], 2 ** -6) == 1


@KERNEL_TESTS
def test_source_is_cached_on_disk_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FUELGRAPH_CACHE_DIR", str(tmp_path))
    x = fg.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    (n,) = glue_nodes([(x * 0.25).tanh() * x + 7.0])
    prog = build_program(fg.default_registry().entry(n.op.id).body)
    src = glue_codegen.generate(prog, INTERPRET) + f"# {tmp_path.name}\n"   # unique per test
    before = dict(K.STATS)
    K.load_source(src)
    files = list((tmp_path / "glue").glob("*.py"))
    assert len(files) == 1 and K.STATS["written"] == before["written"] + 1
    name = files[0].stem
    del sys.modules[name]                  # as a fresh process would: read back, not rewritten
    K.load_source(src)
    assert K.STATS["written"] == before["written"] + 1
    assert K.STATS["imported"] == before["imported"] + 2


def test_generator_declines_float64_and_one_huge_row():
    x = fg.tensor(np.ones((2, 3)))                      # float64
    (n,) = glue_nodes([(x * 2.0).exp() + x])
    with pytest.raises(Unsupported):
        glue_codegen.generate(build_program(fg.default_registry().entry(n.op.id).body))
    big = fg.tensor(np.ones(glue_codegen.WIDE_ROW + 1, np.float32))
    (n,) = glue_nodes([((big - 1.0) * big).sum()])     # a full reduction: one program per row
    with pytest.raises(Unsupported, match="too few programs"):
        glue_codegen.generate(build_program(fg.default_registry().entry(n.op.id).body))


@KERNEL_TESTS
@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16])
def test_looped_rows_kernel(monkeypatch, dtype):
    """Rows wider than MAX_ROW loop over column chunks, one pass per level of reductions
    (here: a max, then a sum that reads it, then the outputs); tiny MAX_ROW and chunk so that
    the interpreter runs several chunks with a ragged last one."""
    monkeypatch.setattr(glue_codegen, "MAX_ROW", 8)
    monkeypatch.setattr(glue_codegen, "LOOP_BLOCK", 4)
    monkeypatch.setattr(K, "MAX_ROW", 8)
    monkeypatch.setattr(K, "LOOP_BLOCK", 4)
    rng = np.random.default_rng(8)
    x = fg.tensor(rng.standard_normal((5, 19)).astype(np.float32)).astype(dtype)
    w = fg.tensor(rng.standard_normal(19).astype(np.float32)).astype(dtype)
    xf = x.astype(fg.float32)
    s = xf - xf.max(-1, keepdim=True)
    lse = s.exp().sum(-1, keepdim=True).log()
    y = ((s - lse) * w.astype(fg.float32)).astype(dtype)          # log-softmax, weighted
    nodes = glue_nodes([y, lse])
    assert any(build_program(fg.default_registry().entry(n.op.id).body).n == 19 for n in nodes)
    assert run_regions([y, lse], 1e-5 if dtype == fg.float32 else 2 ** -6) >= 1


def test_generated_source_reads_broadcasts_once_per_tile():
    rng = np.random.default_rng(2)
    x = fg.tensor(rng.standard_normal((8, 64)).astype(np.float32))
    w = fg.tensor(rng.standard_normal(64).astype(np.float32))
    (n,) = glue_nodes([x * (x * x).sum(-1, keepdim=True) * w + 1.0])
    src = glue_codegen.generate(build_program(fg.default_registry().entry(n.op.id).body))
    assert "mask=cmask" in src                  # the weight: one [1, BLOCK_N] load per tile
    assert "libdevice" in src and "tl.sum(" in src and "tl.store(out0 + i" in src


# ----------------------------------------------------------------------------- on the GPU
@on_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_glue_through_fuelgraph_on_cuda(dtype):
    d = getattr(fg, dtype)
    rng = np.random.default_rng(3)
    g, u, r = (fg.tensor(rng.standard_normal((256, 384)).astype(np.float32)).astype(d).to("cuda")
               for _ in range(3))
    y = g.silu() * u + r
    rep = fg.explain(y)
    assert rep.backend == "cuda" and len(rep.glue) == 1
    got, ref = fg.realize([y])[0].numpy(), fg.realize([y], lower_all=True)[0].numpy()
    tol = 1e-5 if dtype == "float32" else 2 ** -6
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=tol, atol=tol)


@on_gpu
def test_gradients_through_glue_on_cuda():
    rng = np.random.default_rng(4)
    x = fg.tensor(rng.standard_normal((64, 128)).astype(np.float32), requires_grad=True)
    w = fg.tensor(rng.standard_normal(128).astype(np.float32), requires_grad=True)
    xc, wc = x.to("cuda"), w.to("cuda")
    y = (xc * ((xc * xc).mean(-1, keepdim=True) + 1e-6).rsqrt() * wc).tanh().sum()
    gx, gw = fg.grad(y, [xc, wc])
    assert fg.explain([gx, gw]).glue
    for a, b in zip(fg.realize([gx, gw]), fg.realize([gx, gw], lower_all=True)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


@on_gpu
def test_second_process_reuses_the_compiled_kernel(tmp_path):
    script = textwrap.dedent("""
        import time, numpy as np, fuelgraph as fg
        from fuelgraph.backends.cuda.kernels import glue as K
        x = fg.tensor(np.ones((512, 1000), np.float32)).to("cuda")
        y = (x * 0.5).tanh() * x + 3.0
        t0 = time.perf_counter(); fg.realize([y]); dt = time.perf_counter() - t0
        print(dt, K.STATS["written"])
    """)
    env = dict(os.environ, FUELGRAPH_CACHE_DIR=str(tmp_path / "fg"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, check=True).stdout.split()
    assert first[1] == "1" and second[1] == "0", (first, second)   # no source written again


def _compile_for_sm90(prog):
    """Compile the GPU flavour of `prog`'s source for an H100/H200 (sm_90) ahead of time: no
    GPU needed, so the real (libdevice) source is checked here too, not only the interpreter's."""
    import importlib.util
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from fuelgraph.backends.cuda.glue_codegen import tl_dtype
    from fuelgraph.backends.cuda.kernels.glue import launch_config
    src = glue_codegen.generate(prog, interpret=False)
    path = Path(tempfile.mkdtemp()) / "glue_aot.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("glue_aot", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int1": "i1",
             "int32": "i32", "int64": "i64", "uint8": "u8", "uint32": "u32"}
    metas = list(prog.inputs) + [(s, d) for _, s, d in prog.outputs]
    names = [f"in{k}" for k in range(len(prog.inputs))] + \
        [f"out{k}" for k in range(len(prog.outputs))]
    sig = {nm: "*" + short[tl_dtype(d)[3:]] for nm, (_, d) in zip(names, metas)}
    _, meta = launch_config(prog)
    consts = {k: v for k, v in meta.items() if k != "num_warps"}
    sig.update({k: "constexpr" for k in consts})
    src_ast = triton.compiler.ASTSource(fn=mod.glue_kernel, signature=sig, constexprs=consts)
    return triton.compile(src_ast, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta["num_warps"]})


@pytest.mark.skipif(INTERPRET, reason="@triton.jit is interpreted under TRITON_INTERPRET")
def test_gpu_sources_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    rng = np.random.default_rng(7)
    bf = fg.bfloat16
    g, u, r = (fg.tensor(rng.standard_normal((8, 24)).astype(np.float32)).astype(bf)
               for _ in range(3))
    w = fg.tensor(rng.standard_normal(24).astype(np.float32)).astype(bf)
    i = fg.tensor(rng.integers(-9, 9, (8, 24)).astype(np.int32))
    xf = g.astype(fg.float32)
    cases = [(g.silu() * u + r).erf().tanh(),                                    # elementwise
             (xf * ((xf * xf).mean(-1, keepdim=True) + 1e-6).rsqrt()).astype(bf) * w + r,
             fg.where((i // 3 > 1) | (i % 4 == 0), i << 2, i >> 1),             # ints, bools
             (g.astype(fg.float32).max(-1, keepdim=True) - xf).exp().sum(-1, keepdim=True)]
    wide = fg.tensor(rng.standard_normal((2, 20000)).astype(np.float32))       # looped rows
    ws = wide - wide.max(-1, keepdim=True)
    cases.append(ws - ws.exp().sum(-1, keepdim=True).log())
    kinds = set()
    for y in cases:
        for n in glue_nodes([y]):
            prog = build_program(fg.default_registry().entry(n.op.id).body)
            assert _compile_for_sm90(prog)
            kinds.add(prog.n is not None)
    assert kinds == {True, False}          # elementwise, row and looped-row kernels
