"""SSD_CHUNK_SCAN backward split into kernels of moderate size, each tiled over (batch, chunk,
head, block of rows, block of P or N), so that a long chunk (256 steps: few stored states and
cotangents) keeps every kernel's tiles in registers with several programs per SM.

Per chunk (t, s: steps of the chunk; GY: grad_y gated by silu(z); Lm[t, s] = exp(Acum_t -
Acum_s) for t >= s; Hin the entering state, Dst the cotangent of the leaving one, [P, N]):
  dx_s = dt_s gB_s + D GY_s,  gB_s = sum_{t>=s} Lm[t, s] (C_t . B_s) GY_t + exp(Acum_end -
         Acum_s) Dst B_s                                         (rows s, P blocks)
  dB_s = dt_s (sum_{t>=s} Lm[t, s] (GY_t . x_s) C_t + exp(Acum_end - Acum_s) x_s Dst)
                                                                  (rows s, N blocks)
  dC_t = sum_{s<=t} Lm[t, s] dt_s (GY_t . x_s) B_s + exp(Acum_t) GY_t Hin   (rows t, N blocks)
One kernel computes the three (the "rows" kernel, KIND 0 / 1 / 2: the same loop of two
tensor-core products, over the later steps of the chunk for dx and dB, the earlier ones for
dC), and each program also reduces its rows: x . gB (the dt gradient through dt x), B . dB and
C . dC. The gradient of the within-chunk cumulative sum Acum_t is exactly C_t . dC_t -
B_t . dB_t (the decay terms, each pair (t, s) entering once with + at t and - at s, and the
state term r_s = dt_s exp(Acum_end - Acum_s) x_s . (Dst B_s) with - at s), plus
exp(Acum_end) sum(Hin o Dst) + sum_s r_s at the chunk's last step; a small kernel takes suffix
sums of it per chunk and finishes ddt, and the partial sums of da and ddt_bias. Those suffix
sums cancel the pairs and the r_s of every suffix, so with 16-bit inputs each must enter
twice as the same float32 value up to float32 rounding, as in the fused kernel: dB rounds
the same 16-bit operand (S Lm) dt_s as dC (dt_s inside its products, not applied to its
result), and the dx kernel sums r_s from float32 products and takes Hin . Dst, not
h_out . Dst from the 16-bit stored h_out (whose rounding, relative to |h_out| and not to the
decayed |Hin|, reached every step's da and ddt: errors of 2-25% of da on the GPU-sized
tests). When b and c are one group broadcast over the heads, C B^T of each chunk is formed
once (the forward's kernel) and the dx programs read it; with config zcb, dB and dC also form
the decay terms' share of B . dB and C . dC from it (no more accurate than the products' own
sums in an emulation of the GPU's rounding, and 30-40% more loop instructions: off by
default). The states entering the
chunks and the cotangents at their ends come from the forward's state walk and its reverse,
at the same chunk length."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ssm_ssd as KD
from .ssm import sigmoid_f32


@triton.jit
def _rows_block(acc, z, k0, offs_k, offs_m, offs_u, offs_o, cend, row, c0, ci, bi, NC, ac_m,
                dtp_m, U, acum_ptr, dtp_ptr, cb_ptr, v_base, w_base, sv_l, sw_l, umask, omask,
                Q: tl.constexpr, CB_S: tl.constexpr, CB_Z: tl.constexpr, REV: tl.constexpr,
                ROW_DT: tl.constexpr, PREC: tl.constexpr, op_t: tl.constexpr):
    """(acc + (S o weights) W, z + row sums of (S o weights o C B^T)) over the columns
    k0 + [0, BK) of the rows kernel: S = U V^T (CB_S: C B^T read from cb instead), W [BK, BO];
    weights Lm[t, s] (REV: rows s, columns t, times dt_s = dtp_m if ROW_DT; else rows t,
    columns s, times dt_s), zero outside t >= s: dB (ROW_DT) and dC so round the same 16-bit
    operand (S_ts Lm[t, s]) dt_s for the pair (t, s), and their R . out sums cancel in the
    Acum gradient at float32 rounding. CB_Z: z gets the decay-weighted products times C B^T
    from cb (rows of Zm[t, s] = (GY_t . x_s) C_t . B_s Lm[t, s] dt_s for dC, columns for
    dB)."""
    t = k0 + offs_k
    kmask = t < cend
    ac_k = tl.load(acum_ptr + row + t, mask=kmask, other=0.0)
    cb_base = cb_ptr + (bi * NC + ci) * Q * Q
    if CB_S:
        # cb rows are the chunk's t (here the columns), its columns s (here the rows)
        S = tl.load(cb_base + (t - c0)[None, :] * Q + (offs_m - c0)[:, None]).to(tl.float32)
    else:
        V = tl.load(v_base + t[:, None] * sv_l + offs_u[None, :],
                    mask=kmask[:, None] & umask[None, :], other=0.0).to(op_t)
        S = tl.dot(U, tl.trans(V), input_precision=PREC)
    if REV:
        valid = (t[None, :] >= offs_m[:, None]) & kmask[None, :]
        S = S * tl.exp(tl.where(valid, ac_k[None, :] - ac_m[:, None], float("-inf")))
        if ROW_DT:
            S = S * dtp_m[:, None]
    else:
        valid = (offs_m[:, None] >= t[None, :]) & kmask[None, :]
        dtp_k = tl.load(dtp_ptr + row + t, mask=kmask, other=0.0)
        S = S * tl.exp(tl.where(valid, ac_m[:, None] - ac_k[None, :], float("-inf"))) \
            * dtp_k[None, :]
    if CB_Z:
        if REV:
            CB = tl.load(cb_base + (t - c0)[None, :] * Q + (offs_m - c0)[:, None])
        else:
            CB = tl.load(cb_base + (offs_m - c0)[:, None] * Q + (t - c0)[None, :])
        z += tl.sum(S * CB.to(tl.float32), 1)
    Wk = tl.load(w_base + t[:, None] * sw_l + offs_o[None, :],
                 mask=kmask[:, None] & omask[None, :], other=0.0).to(op_t)
    return tl.dot(S.to(op_t), Wk, acc, input_precision=PREC), z


@triton.jit
def _store_chunk_end(tot, st_ptr, m_ptr, dtot_ptr, total, pid_bh, ci, NC, pid_m, NM, pid_o,
                     offs_o, omask, K, S_MC, sm_k, sm_o):
    """dx's share of the chunk-end term of the Acum gradient into dtot: tot (its rows' sum of
    r_s), plus exp(Acum_end) sum(Hin o Dst) of its P block by the first row block (in slabs
    of 16 rows of N: few registers)."""
    if pid_m == 0:
        hd = 0.0
        for n0 in range(0, K, 16):
            offs_s = n0 + tl.arange(0, 16)
            s_off = offs_s[:, None] * sm_k + offs_o[None, :] * sm_o
            s_mask = (offs_s < K)[:, None] & omask[None, :]
            h_in = tl.load(st_ptr + (pid_bh * NC + ci) * S_MC + s_off, mask=s_mask,
                           other=0.0).to(tl.float32)
            dslab = tl.load(m_ptr + (pid_bh * NC + ci) * S_MC + s_off, mask=s_mask,
                            other=0.0).to(tl.float32)
            hd += tl.sum(tl.sum(h_in * dslab, 1), 0)
        tot += hd * tl.exp(total)
    tl.store(dtot_ptr + ((pid_bh * NC + ci) * NM + pid_m) * tl.num_programs(1) + pid_o, tot)


@triton.jit
def _ssd_bwd_rows_kernel(u_ptr, v_ptr, w_ptr, m_ptr, r_ptr, cb_ptr, out_ptr, rsum_ptr,
                         acum_ptr, dtp_ptr, d_ptr, dd_ptr, st_ptr, dtot_ptr,
                         L, H, P, K, O, NC, S_MC,
                         su_b, su_l, su_h, sv_b, sv_l, sv_h, sw_b, sw_l, sw_h, sr_b, sr_l, sr_h,
                         sm_k, sm_o,
                         Q: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                         BKU: tl.constexpr, BO: tl.constexpr, KIND: tl.constexpr,
                         HAS_CB: tl.constexpr, HAS_D: tl.constexpr, D_PER_P: tl.constexpr,
                         PREC: tl.constexpr, OP_T: tl.constexpr):
    """One block of BM rows of one chunk (batch, chunk, head, rows; program axis 1: block of
    the output's last axis O), inputs [B, L, H, *] with strides (batch, time, head):
      acc_i = coef_i (U_i M)_o + sum_j (U_i . V_j) dec[i, j] W_j,o
    KIND 0 (dx: U = b, V = c, W = GY, M = Dst^T, R = x) and 1 (dB: U = x, V = GY, W = c,
    M = Dst, R = b): rows i = s, columns j = t >= s, dec = Lm[t, s], coef = exp(Acum_end -
    Acum_s); the output is dt_s acc (+ D GY for dx). KIND 2 (dC: U = GY, V = x, W = b,
    M = Hin, R = c): rows i = t, columns j = s <= t, dec = Lm[t, s] dt_s, coef = exp(Acum_t).
    rsum [O blocks, B H, L] gets R . acc (dx) or -R . out (dB) or R . out (dC); dB puts dt_s
    inside its products (coef and the loop's weights), so out = acc there. dx also writes
    the partial dd sums (GY . x over its rows, [B H, NC * Q / BM, P]) and the chunk-end
    term of the Acum gradient over its rows and P block (sum_s dt_s x_s . (coef_s Dst b_s),
    plus exp(Acum_end) sum(Hin o Dst) by the first row block; dtot [B H, NC, Q / BM, P
    blocks]). HAS_CB (b and c shared by the heads): C B^T of the chunk in cb [B, NC, Q, Q];
    dx reads it for U V^T, dB and dC the decay terms' share of their R . out sums from it."""
    NM: tl.constexpr = Q // BM
    REV: tl.constexpr = KIND != 2
    pid = tl.program_id(0).to(tl.int64)
    if REV:
        pid_m = pid % NM                       # the longest rows (first of the chunk) first
    else:
        pid_m = NM - 1 - pid % NM
    hi = (pid // NM) % H                       # heads fastest: shared b, c (and cb) from L2
    ci = (pid // (NM * H)) % NC
    bi = pid // (NM * H * NC)
    pid_bh = bi * H + hi
    pid_o = tl.program_id(1)
    op_t: tl.constexpr = OP_T
    c0 = ci * Q
    cend = tl.minimum(c0 + Q, L)
    m0 = c0 + pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_u = tl.arange(0, BKU)
    offs_o = pid_o * BO + tl.arange(0, BO)
    offs_k = tl.arange(0, BK)
    mmask = offs_m < cend
    umask = offs_u < K
    omask = offs_o < O
    row = pid_bh * L
    ac_m = tl.load(acum_ptr + row + offs_m, mask=mmask, other=0.0)
    u_base = u_ptr + bi * su_b + hi * su_h
    v_base = v_ptr + bi * sv_b + hi * sv_h
    w_base = w_ptr + bi * sw_b + hi * sw_h
    U = tl.load(u_base + offs_m[:, None] * su_l + offs_u[None, :],
                mask=mmask[:, None] & umask[None, :], other=0.0).to(op_t)
    mo_off = offs_u[:, None] * sm_k + offs_o[None, :] * sm_o
    mo_mask = umask[:, None] & omask[None, :]
    Mt = tl.load(m_ptr + (pid_bh * NC + ci) * S_MC + mo_off, mask=mo_mask, other=0.0)
    if REV:
        total = tl.load(acum_ptr + row + cend - 1)
        coef = tl.where(mmask, tl.exp(total - ac_m), 0.0)
        lo = m0
        hi_t = cend
    else:
        coef = tl.where(mmask, tl.exp(ac_m), 0.0)
        lo = c0
        hi_t = tl.minimum(m0 + BM, cend)
    row_dt = coef                          # dB's row factor dt_s (a placeholder otherwise)
    if KIND == 1:            # dB: dt_s inside the products (see _rows_block)
        row_dt = tl.load(dtp_ptr + row + offs_m, mask=mmask, other=0.0)
        coef = coef * row_dt
    acc = tl.dot(U, Mt.to(op_t), input_precision=PREC) * coef[:, None]
    mo2 = mmask[:, None] & omask[None, :]
    r_off = bi * sr_b + hi * sr_h + offs_m[:, None] * sr_l + offs_o[None, :]
    CB_S: tl.constexpr = HAS_CB and KIND == 0
    CB_Z: tl.constexpr = HAS_CB and KIND != 0
    z = tl.zeros((BM,), tl.float32)
    # dx: the chunk-end term of the Acum gradient, exp(Acum_end) sum(Hin o Dst) + sum_s r_s,
    # r_s = dt_s x_s . (coef_s Dst b_s) (float32 here), while -r_s enters at each step s within
    # dB's -b . dB, so that the suffix sums cancel them at float32 rounding, as in the fused
    # kernel (taken as sum(h_out o Dst) from the 16-bit stored h_out, the rounding relative to
    # |h_out|, not to the decayed |Hin|, reached every step's da and ddt). 16-bit: before the
    # loop (with shared b, c then 168 registers, 3 programs an SM, see _launch_rows); float32
    # (dots on CUDA cores): its state term kept across the loop instead (80 registers, not 191)
    LATE: tl.constexpr = KIND == 0 and OP_T == tl.float32
    if CB_Z or (KIND == 0 and not LATE):
        # the state term's share of R . out (R: x for dx, b for dB, c for dC)
        R = tl.load(r_ptr + r_off, mask=mo2, other=0.0).to(tl.float32)
        z_state = tl.sum(R * acc, 1)
    if KIND == 0:
        if LATE:
            acc_state = acc
        else:
            dtp_s = tl.load(dtp_ptr + row + offs_m, mask=mmask, other=0.0)
            _store_chunk_end(tl.sum(z_state * dtp_s, 0), st_ptr, m_ptr, dtot_ptr, total, pid_bh,
                             ci, NC, pid_m, NM, pid_o, offs_o, omask, K, S_MC, sm_k, sm_o)
    for k0 in range(lo, hi_t, BK):
        acc, z = _rows_block(
            acc, z, k0, offs_k, offs_m, offs_u, offs_o, cend, row, c0, ci, bi, NC, ac_m, row_dt,
            U, acum_ptr, dtp_ptr, cb_ptr, v_base, w_base, sv_l, sw_l, umask, omask, Q, CB_S,
            CB_Z, REV, KIND == 1, PREC, op_t)
    out = acc
    if KIND == 0:
        # x and dt_s loaded again, not kept across the loop (registers)
        R = tl.load(r_ptr + r_off, mask=mo2, other=0.0).to(tl.float32)
        dtp_s = tl.load(dtp_ptr + row + offs_m, mask=mmask, other=0.0)
        if LATE:
            _store_chunk_end(tl.sum(tl.sum(R * acc_state, 1) * dtp_s, 0), st_ptr, m_ptr,
                             dtot_ptr, total, pid_bh, ci, NC, pid_m, NM, pid_o, offs_o, omask,
                             K, S_MC, sm_k, sm_o)
        rs = tl.sum(R * acc, 1)
        out = acc * dtp_s[:, None]
        if HAS_D:
            G = tl.load(w_base + offs_m[:, None] * sw_l + offs_o[None, :], mask=mo2,
                        other=0.0).to(tl.float32)
            if D_PER_P:
                out += G * tl.load(d_ptr + hi * P + offs_o, mask=omask,
                                   other=0.0).to(tl.float32)[None, :]
            else:
                out += G * tl.load(d_ptr + hi).to(tl.float32)
            tl.store(dd_ptr + ((pid_bh * NC + ci) * NM + pid_m) * P + offs_o,
                     tl.sum(G * R, 0), mask=omask)
    else:
        if CB_Z:
            # the decay terms' share from the products themselves (z, by the first O block
            # only): the pairs (t, s) of a chunk cancel at float32 rounding
            rs = z_state + tl.where(pid_o == 0, z, 0.0)
        else:
            rs = tl.sum(tl.load(r_ptr + r_off, mask=mo2, other=0.0).to(tl.float32) * acc, 1)
        if KIND == 1:
            rs = -rs
    tl.store(out_ptr + ((bi * L + offs_m[:, None]) * H + hi) * O + offs_o[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mo2)
    tl.store(rsum_ptr + (pid_o * (tl.num_programs(0) // (NM * NC)) + pid_bh) * L + offs_m, rs,
             mask=mmask)


@triton.jit
def _ssd_bwd_dt_kernel(dt_ptr, a_ptr, bias_ptr, dtp_ptr, ddtx_ptr, dacc_ptr, dtot_ptr,
                       ddt_ptr, da_ptr, dbias_ptr, L, H, NC, BH, NPB, NAB, NTB,
                       sdt_b, sdt_l, sdt_h,
                       Q: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """ddt of one chunk of one (batch, head) from the rows kernels' partial sums: the
    cotangent of Acum (dacc summed over its NAB blocks, plus the dx programs' chunk-end
    partials, NTB of them, at the chunk's last step) summed from each step to the chunk's end,
    times a, plus x . gB (NPB blocks); through softplus; da and ddt_bias partials per program
    [B H NC]."""
    pid = tl.program_id(0).to(tl.int64)
    pid_bh = pid // NC
    ci = pid % NC
    bi = pid_bh // H
    hi = pid_bh % H
    offs = tl.arange(0, Q)
    t = ci * Q + offs
    tmask = t < L
    ddt = tl.zeros((Q,), tl.float32)
    for j in range(0, NPB):
        ddt += tl.load(ddtx_ptr + (j * BH + pid_bh) * L + t, mask=tmask, other=0.0)
    dac = tl.zeros((Q,), tl.float32)
    for j in range(0, NAB):
        dac += tl.load(dacc_ptr + (j * BH + pid_bh) * L + t, mask=tmask, other=0.0)
    dtot = 0.0
    for j in range(0, NTB):
        dtot += tl.load(dtot_ptr + pid * NTB + j)
    dac += tl.where(offs == Q - 1, dtot, 0.0)
    ds = tl.sum(dac, 0) - tl.cumsum(dac, 0) + dac                  # suffix sums
    ddt += ds * tl.load(a_ptr + hi).to(tl.float32)
    dtp = tl.load(dtp_ptr + pid_bh * L + t, mask=tmask, other=0.0)
    if SOFTPLUS:
        pre = tl.load(dt_ptr + bi * sdt_b + t * sdt_l + hi * sdt_h, mask=tmask,
                      other=0.0).to(tl.float32)
        if HAS_BIAS:
            pre += tl.load(bias_ptr + hi).to(tl.float32)
        ddt = ddt * sigmoid_f32(pre)
    ddt = tl.where(tmask, ddt, 0.0)
    tl.store(ddt_ptr + (bi * L + t) * H + hi, ddt.to(ddt_ptr.dtype.element_ty), mask=tmask)
    tl.store(da_ptr + pid, tl.sum(ds * dtp, 0))
    tl.store(dbias_ptr + pid, tl.sum(ddt, 0))


def _launch_rows(kind, u, v, w, m, r, cb, out, rsum, acum, dtp, d, dd, st, dtot, NC, Q,
                 cfg, has_cb=False, has_d=False):
    """One rows kernel (kind 0 dx, 1 dB, 2 dC) over (B H NC row blocks, O blocks); out
    [B, L, H, O], st [B H, NC, P, N] gives P and N."""
    B, L, H = out.shape[:3]
    P, N = st.shape[2], st.shape[3]
    K, O = (N, P) if kind == 0 else (P, N)
    bo = min(cfg.bp if kind == 0 else cfg.bn, KD._p2(O))
    bm = min(cfg.bm, Q)
    sm_k, sm_o = (1, N) if kind == 0 else (N, 1)
    extra = {}
    if kind == 0 and has_cb and cfg.warps == 4 and out.dtype != torch.float32 \
            and not KD.INTERPRET:
        # dx reading the shared C B^T: 3 programs of 4 warps an SM in 168 registers (sm_90,
        # 64 x 64 tiles, no spill with or without d); left alone ptxas takes 166-191
        extra["maxnreg"] = 168
    _ssd_bwd_rows_kernel[(B * H * NC * (Q // bm), triton.cdiv(O, bo))](
        u, v, w, m, r, cb, out, rsum, acum, dtp, d, dd, st, dtot, L, H, P, K, O, NC, P * N,
        *KD._strides3(u), *KD._strides3(v), *KD._strides3(w), *KD._strides3(r), sm_k, sm_o,
        Q=Q, BM=bm, BK=bm, BKU=KD._p2(K), BO=bo, KIND=kind, HAS_CB=has_cb, HAS_D=has_d,
        D_PER_P=has_d and d.dim() == 2, PREC=KD.F32_DOT, OP_T=KD._op_type(out.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages, **extra)


def ssd_backward_split(x, dt, a, b, c, d, z, bias, h0, gy, gl, *, dt_softplus, has_d, has_z,
                       has_dt_bias, has_initial_states, cfg):
    """The gradients of SSD_CHUNK_SCAN (inputs as ssd_chunk_scan_backward gets them, last axes
    contiguous, B H P L > 0): (dx, ddt, db, dc, dz or None, da_p, dd_p, dbias_p, dh0) with
    the per-program partial sums da_p, dbias_p [B H NC], dd_p [B H, *, P] (float32) and dh0
    [B, H, P, N] float32."""
    B, L, H, P = x.shape
    N = b.shape[3]
    BH = B * H
    dev, dtype = x.device, x.dtype
    f32 = dict(dtype=torch.float32, device=dev)
    Q = min(cfg.q, KD._p2(L))
    NC = triton.cdiv(L, Q)
    softplus = bool(dt_softplus)
    fcfg = KD.ssd_config(B, L, H, P, N)._replace(q=Q, bm=min(64, Q), bk=min(64, Q))
    dtp, acum = KD._launch_dt(dt, a, bias, B, L, H, Q, has_dt_bias, softplus)
    # states entering each chunk, cotangents at each chunk's end (reverse walk), x's dtype
    st = torch.empty((BH, NC, P, N), dtype=dtype, device=dev)
    dst = torch.empty((BH, NC, P, N), dtype=dtype, device=dev)
    hl = torch.empty((B, H, P, N), **f32)
    dh0 = gl.to(torch.float32).clone()
    KD._launch_state(x, b, z, dtp, acum, h0, st, hl, Q, fcfg, has_initial_states)
    KD._launch_state(gy, c, z, dtp, acum, gl, dst, dh0, Q, fcfg, True, reverse=True,
                     has_z=has_z)
    dz, gyg = None, gy
    if has_z:        # the ungated y for dz, and grad_y through the gate (float32)
        ys = torch.empty((B, L, H, P), **f32)
        KD._launch_scan(x, b, c, d, z, dtp, acum, st, ys, Q, fcfg, False, False)
        zf, g = z.float(), gy.float()
        sz = torch.sigmoid(zf)
        if has_d:
            ys += x.float() * (d.float().view(1, 1, H, -1))
        dz = (g * ys * sz * (1.0 + zf * (1.0 - sz))).to(dtype)
        gyg = g * zf * sz
    bm = min(cfg.bm, Q)
    NM = Q // bm
    has_cb = KD._heads_share_bc(b, c)
    cb = KD._launch_cb(b, c, Q, bm, dtype) if has_cb else x
    dx = torch.empty((B, L, H, P), dtype=dtype, device=dev)
    db = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    dc = torch.empty((B, L, H, N), dtype=dtype, device=dev)
    npb = triton.cdiv(P, min(cfg.bp, KD._p2(P)))
    nnb = triton.cdiv(N, min(cfg.bn, KD._p2(N)))
    ddtx = torch.empty((npb, BH, L), **f32)
    dacc = torch.empty((2 * nnb, BH, L), **f32)          # C . dC blocks, then -B . dB blocks
    dtot = torch.empty((BH, NC, NM * npb), **f32)      # dx's chunk-end terms per program
    dd_p = torch.zeros((BH, NC * NM, P) if has_d else (1, 1, P), **f32)
    _launch_rows(0, b, c, gyg, dst, x, cb, dx, ddtx, acum, dtp, d, dd_p, st, dtot, NC, Q,
                 cfg, has_cb=has_cb, has_d=has_d)
    _launch_rows(1, x, gyg, c, dst, b, cb, db, dacc[nnb:], acum, dtp, d, dd_p, st, dtot,
                 NC, Q, cfg, has_cb=has_cb and bool(cfg.zcb))
    _launch_rows(2, gyg, x, b, st, c, cb, dc, dacc[:nnb], acum, dtp, d, dd_p, st, dtot,
                 NC, Q, cfg, has_cb=has_cb and bool(cfg.zcb))
    ddt = torch.empty((B, L, H), dtype=dtype, device=dev)
    da_p, dbias_p = torch.empty((BH, NC), **f32), torch.empty((BH, NC), **f32)
    _ssd_bwd_dt_kernel[(BH * NC,)](
        dt, a, bias, dtp, ddtx, dacc, dtot, ddt, da_p, dbias_p, L, H, NC, BH, npb, 2 * nnb,
        NM * npb, *KD._strides3(dt), Q=Q, HAS_BIAS=has_dt_bias, SOFTPLUS=softplus, num_warps=4)
    return dx, ddt, db, dc, dz, da_p, dd_p, dbias_p, dh0
