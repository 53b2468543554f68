#!/usr/bin/env python3
"""Compile the state-space scan kernels for sm_90 on a machine without a GPU and report
registers, spill stack, shared memory and the SASS of the main loop (instructions a thread,
most frequent opcodes), per launch option. The selective-scan forward is bound by the MUFU
unit (8 issue cycles a warp per exponential on sm_90) against the loop's other instructions:
compare MUFU * 8 with the loop's length. Use it to compare variants before a GPU session.

    python3 bench/sass_ssm.py
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import triton
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from sass_common import TARGET, loop_stats  # noqa: E402
from fuelgraph.backends.cuda.kernels import ssm as KS  # noqa: E402
from fuelgraph.backends.cuda.kernels import ssm_ssd as KD  # noqa: E402


def compile_report(name, kern, ptr_types, cons, warps, stages, unspecialized=()):
    sig = {n: ptr_types.get(n, "i32") for n in kern.arg_names if n not in cons}
    # every pointer and integer of the benchmark shape is a multiple of 16 (as the launcher's
    # specialization sees them), except the kernel's do_not_specialize arguments
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if n not in unspecialized}
    try:
        k = triton.compile(ASTSource(kern, sig, cons, attrs=attrs), target=TARGET,
                           options=dict(num_warps=warps, num_stages=stages))
    except Exception as exc:  # noqa: BLE001
        print(f"{name:44s} FAILED {str(exc)[-600:]!r}")
        return
    regs, stack, n, ops = loop_stats(k.asm["cubin"])
    top = " ".join(f"{op}:{c}" for op, c in ops.most_common(10))
    print(f"{name:44s} regs {regs:3d} stack {stack:4d} smem {k.metadata.shared:6d} loop {n:5d}"
          f"  {top}", flush=True)


def ssd(cfg=None, cb=False):
    cfg = cfg or KD.ssd_fwd_config(4, 4096, 80, 64, 128)
    bf = "*bf16"
    p = {n: bf for n in ("x_ptr", "b_ptr", "c_ptr", "z_ptr", "st_ptr", "h0_ptr", "hl_ptr",
                         "d_ptr", "y_ptr")}
    p.update(dtp_ptr="*fp32", acum_ptr="*fp32", cb_ptr="*bf16")
    op = triton.language.bfloat16
    cons = dict(Q=cfg.q, BK=cfg.bk, BP=cfg.sbp or cfg.bp, BN=cfg.bn, HAS_INIT=False,
                REVERSE=False,
                HAS_Z=False, F32_PREC="ieee", OP_T=op)
    compile_report(f"ssd state {tuple(cfg)}", KD._ssd_state_kernel, p, cons, cfg.swarps,
                   cfg.sstages)
    cons = dict(Q=cfg.q, BM=cfg.bm, BK=cfg.bk, BP=cfg.bp, BN=128, HAS_D=False, D_PER_P=False,
                HAS_Z=False, F32_PREC="ieee", OP_T=op)
    compile_report(f"ssd scan {tuple(cfg)} cb={cb}", KD._ssd_scan_kernel, p,
                   dict(cons, HAS_CB=cb), cfg.warps, cfg.stages)
    if cb:
        compile_report(f"ssd cb bm={cfg.bm}", KD._ssd_cb_kernel, p,
                       dict(Q=cfg.q, BM=cfg.bm, BN=64, F32_PREC="ieee", OP_T=op), 4, 2)



def ss_fwd(cfg, D=4096, N=16):
    """selective_scan forward, bfloat16 u / delta, float32 b / c (widened on the host),
    softplus on, per (T, BD, warps, poly); 'loop' is one tile of T steps for BD / 32 / warps
    channels a thread, N states each."""
    cfg = KS.SSFwdConfig(*cfg)
    p = {n: "*bf16" for n in ("u_ptr", "dl_ptr", "d_ptr", "z_ptr", "bias_ptr", "y_ptr")}
    p.update(a_ptr="*fp32", b_ptr="*fp32", c_ptr="*fp32", h_ptr="*fp32")
    split = cfg.bd < 32 * cfg.warps         # as the launcher decides
    cons = dict(D=D, T=cfg.t, BD=cfg.bd, BN=N, HAS_D=False, HAS_Z=False, HAS_BIAS=False,
                SOFTPLUS=True, POLY=0 if split else cfg.poly, EVEN_L=True, ASM=True,
                PF=bool(cfg.pf), POLY_J=cfg.poly * 4 // N if split else 0)
    compile_report(f"selective_scan fwd {tuple(cfg)}", KS._ss_fwd_kernel, p, cons, cfg.warps,
                   1, unspecialized=("zero",))


def ssd_bwd(q=32, warps=8, stages=1):
    p = {n: "*bf16" for n in ("x_ptr", "dt_ptr", "a_ptr", "b_ptr", "c_ptr", "d_ptr", "z_ptr",
                              "bias_ptr", "gy_ptr", "st_ptr", "dst_ptr", "ys_ptr", "dx_ptr",
                              "ddt_ptr", "db_ptr", "dc_ptr", "dz_ptr")}
    p.update(da_ptr="*fp32", dd_ptr="*fp32", dbias_ptr="*fp32")
    cons = dict(Q=q, BP=64, BN=128, HAS_D=False, D_PER_P=False, HAS_Z=False, HAS_BIAS=True,
                SOFTPLUS=True, PREC="ieee", OP_T=triton.language.bfloat16)
    compile_report(f"ssd bwd q={q} warps={warps} stages={stages}", KD._ssd_bwd_kernel, p,
                   cons, warps, stages)


def ssd_bwd_split(kind, q=128, bm=64, bo=64, warps=4, stages=2, has_cb=False, N=128, P=64):
    """One of the split backward's rows kernels (0 dx, 1 dB, 2 dC) at the benchmark shape."""
    from fuelgraph.backends.cuda.kernels import ssm_ssd_bwd as KB
    p = {n: "*bf16" for n in ("u_ptr", "v_ptr", "w_ptr", "m_ptr", "r_ptr", "cb_ptr", "out_ptr",
                              "d_ptr", "st_ptr")}
    p.update({n: "*fp32" for n in ("rsum_ptr", "acum_ptr", "dtp_ptr", "dd_ptr",
                                   "dtot_ptr")})
    K = N if kind == 0 else P
    cons = dict(Q=q, BM=bm, BK=bm, BKU=K, BO=bo, KIND=kind, HAS_CB=has_cb, HAS_D=False,
                D_PER_P=False, PREC="ieee", OP_T=triton.language.bfloat16)
    compile_report(f"ssd bwd rows kind={kind} q={q} bm={bm} bo={bo} w={warps} s={stages}"
                   f"{' cb' if has_cb else ''}", KB._ssd_bwd_rows_kernel, p, cons, warps, stages)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bwd-only", action="store_true", help="only the backward kernels")
    args = ap.parse_args()
    if not args.bwd_only:
        for cfg in ((16, 64, 2, 0), (16, 64, 2, 1), (16, 64, 2, 2), (16, 16, 1, 0),
                    (16, 16, 1, 4)):
            ss_fwd(cfg)
        for cb in (False, True):
            ssd(cb=cb)
    # dx, dB, dC over all of N with b, c shared by the heads (cb: dx reads C B^T; dB, dC the
    # zcb=1 variants), then without (the default dB, dC), then variants
    for kind, bo, cb in ((0, 64, True), (1, 128, True), (2, 128, True), (0, 64, False),
                         (1, 128, False), (2, 128, False), (1, 64, True), (2, 64, True)):
        ssd_bwd_split(kind, bo=bo, has_cb=cb)
    for q, warps in ((32, 8), (16, 8), (64, 8)):
        ssd_bwd(q, warps, 1)


if __name__ == "__main__":
    main()
