"""NF4 on the tensor-core GEMV of `quant_mma` (bitsandbytes' layout: w_packed uint8 [N, K / 2],
even element in the high nibble, absmax float32 [N, K / block], block a multiple of 64).

The mma's A operand wants each weight as a bf16. NF4's 16 code values are not small integers,
so a nibble becomes its bf16 code by table lookups in registers with `prmt` (byte permute: four
3-bit indices pick four bytes out of an 8-byte table held in two registers). A bf16 is two
bytes, so there are two byte planes (low byte, high byte), and 16 entries need a fourth index
bit. The fourth bit costs no select: prmt's sign mode (selector nibble bit 3 set) writes the
selected byte's sign replicated (0x00 or 0xFF) instead of the byte. With the index j, one prmt
reads table U0 by j and another reads U1 by j ^ 8; for j < 8 the first gives U0[j] and the
second a sign byte, for j >= 8 the first a sign byte and the second U1[j - 8], and the XOR of
the two is the entry when both entries of each pair (j, j + 8) have the same top bit in that
plane (U0's entry is stored complemented where that bit is set: `_tables`). NF4's bf16 codes
(zero as -0.0) fall into four groups of four by (sign, top bit of the low byte), so a
permutation of the nibble values at pack time (`REMAP`) pairs them that way. Per 8 weights (one
word): an XOR and two shifts for the selectors, 8 prmt, 4 XOR, 4 prmt interleaving the planes
into bf16 pairs: 19 instructions, 2.4 a weight (Q4_0's integer unpack: 1.4). That bound the
kernel; by default (`MmaConfig.lut`) the codes come from a 256-entry byte table in shared memory
instead (`fill_ptx` / `lut_ptx`: 0.5 integer instructions a weight; H200, one row of x, N = K =
8192: 0.0130 ms against 0.0164). The prmt lookups stay as the reference the table is checked
against (`emulate_unpack`) and as the lut=0 launch.

Numerics: A = bf16(code) exactly as bitsandbytes' own bf16 kernels round the code table; the
products with bf16 x are exact and summed in float32 by the tensor core over a 64-element
block, then scaled by the block's float32 absmax (one FFMA a row and block). The float32
dequantization code * absmax (rounded once) differs from bf16(code) * absmax by at most 2^-9
of a weight (bf16's relative rounding), far inside the matmul tolerance of bf16 outputs; the
dequantization paths stay bit-exact.

Word layout (`pack_nf4`): as `quant_mma`'s (tiles of 16 rows, chunks of 64, lane r = l // 4,
p = l % 4, entry e = 2 g + h: row r + 8 h, block g, elements 8 p .. 8 p + 7 of the 32-element
block) but element t of the eight in nibble t (bits 4 t): a word's low 16 bits are the
selector of elements 0..3 (bf16 pairs 0, 1), its high 16 bits of elements 4..7."""
from __future__ import annotations

import numpy as np
import torch

from ....registry.quant import NF4_CODE

#: bf16 bits of the NF4 code values (zero as -0.0: it joins the negative codes' group)
_BF16 = (torch.from_numpy(NF4_CODE).to(torch.bfloat16).view(torch.int16).numpy()
         .astype(np.int64) & 0xFFFF)
_BF16[7] = 0x8000


def _pairs() -> list[tuple[int, int]]:
    """Eight pairs of codes (q_a, q_b) with equal (sign, top bit of the low byte)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for q, v in enumerate(_BF16):
        groups.setdefault((int(v) >> 15, (int(v) >> 7) & 1), []).append(q)
    pairs = []
    for members in groups.values():
        assert len(members) % 2 == 0, groups
        pairs += [(members[i], members[i + 1]) for i in range(0, len(members), 2)]
    return pairs


PAIRS = _pairs()
#: nibble value stored for code index q: pair i's codes become i and i + 8
REMAP = np.zeros(16, np.int64)
for _i, (_a, _b) in enumerate(PAIRS):
    REMAP[_a], REMAP[_b] = _i, _i + 8


def _tables() -> dict[str, tuple[int, int]]:
    """(low register, high register) of the tables U0, U1 of both byte planes: entry i in byte
    i % 4 of register i // 4. U0 entries are complemented where the pair's top bit is set (the
    XOR with U1's sign byte then restores them)."""
    out = {}
    for plane, shift in (("lo", 0), ("hi", 8)):
        u0, u1 = [], []
        for a, b in PAIRS:
            va, vb = (int(_BF16[a]) >> shift) & 255, (int(_BF16[b]) >> shift) & 255
            assert va >> 7 == vb >> 7
            u0.append(va ^ (255 if va >> 7 else 0))
            u1.append(vb)
        for name, u in (("0", u0), ("1", u1)):
            regs = [sum(u[4 * j + i] << (8 * i) for i in range(4)) for j in range(2)]
            out[plane + name] = (regs[0], regs[1])
    return out


TABLES = _tables()


#: the order of the table words in the operand that carries them (`table_words`)
TABLE_ORDER = ("lo0", "lo1", "hi0", "hi1")


def table_words() -> list[int]:
    """The 8 table registers as int32 values, in the order the kernel passes them (`tab`:
    operand entries 0..7, two a table: its entries 0..3, then 4..7)."""
    vals = [v for name in TABLE_ORDER for v in TABLES[name]]
    return [v - (1 << 32) if v >> 31 else v for v in vals]


def unpack_ptx(word: str, dests: list[str], tab: list[str]) -> list[str]:
    """PTX turning the 8 nibbles of `word` into 4 bf16x2 registers `dests` (elements 2 m,
    2 m + 1 in dests[m]); tab: the 8 table registers (`table_words`; operands, not immediates:
    ptxas would materialize an immediate table at every prmt). Uses %fx, %fs, %fa, %fb, %fe.
    """
    t = {name: (tab[2 * i], tab[2 * i + 1]) for i, name in enumerate(TABLE_ORDER)}
    lines = [f"xor.b32 %fx, {word}, 0x88888888;"]
    for half, sel in enumerate((word, "%fs")):
        if half:
            lines += [f"shr.u32 %fs, {word}, 16;", "shr.u32 %fx, %fx, 16;"]
        lines += [f"prmt.b32 %fa, {t['lo0'][0]}, {t['lo0'][1]}, {sel};",
                  f"prmt.b32 %fb, {t['lo1'][0]}, {t['lo1'][1]}, %fx;",
                  "xor.b32 %fa, %fa, %fb;",
                  f"prmt.b32 %fb, {t['hi0'][0]}, {t['hi0'][1]}, {sel};",
                  f"prmt.b32 %fe, {t['hi1'][0]}, {t['hi1'][1]}, %fx;",
                  "xor.b32 %fb, %fb, %fe;",
                  f"prmt.b32 {dests[2 * half]}, %fa, %fb, 0x5140;",
                  f"prmt.b32 {dests[2 * half + 1]}, %fa, %fb, 0x7362;"]
    return lines


DECLARE = ".reg .b32 %fx, %fs, %fa, %fb, %fe;"


# ---- the byte table in shared memory (`MmaConfig.lut`) --------------------------------------
# Why: the prmt lookups cost 2.4 integer-pipe instructions a weight, which Hopper issues at half
# rate. A 256-entry table of bf16x2 pairs (a byte = two nibbles = one of the mma's register
# pairs) gives two weights by one shared-memory load, one byte extraction (integer pipe) and one
# address IMAD (FMA pipe): 0.5 integer instructions a weight. The table is replicated once a
# lane (entry e of lane l at e * 128 + 4 l) so the 32 lanes of a load hit 32 different banks
# whatever bytes they hold: 32 KB of static shared memory a program, filled once by its threads.
LUT_BYTES = 256 * 128


def pair_table() -> list[int]:
    """The 256 table words (int32 values): entry e = bf16 code of the stored nibble e & 15 in
    the low half (element 2 m of byte m), of e >> 4 in the high half (element 2 m + 1)."""
    inv = np.argsort(REMAP)                     # stored nibble -> code index
    codes = _BF16[inv]
    vals = [int(codes[e & 15]) | (int(codes[e >> 4]) << 16) for e in range(256)]
    return [v - (1 << 32) if v >> 31 else v for v in vals]


def fill_ptx(warps: int) -> str:
    """PTX run once a program before its loop (one instance a thread, not pure): declares the
    table in shared memory, fills it (thread t: rows e = t + 32 warps j, each row 32 copies of
    entry e loaded from operand $1, the global pair table; 16-byte stores staggered by t so a
    warp's stores spread over all banks), waits for the program's threads (bar.sync) and
    returns the thread's base address (table + 4 lane) in $0."""
    threads = 32 * warps
    lines = ["{", f".shared .align 16 .b8 fgnf4lut[{LUT_BYTES}];",
             ".reg .b32 %lt, %ll, %lb, %lv, %la, %lc;", ".reg .b64 %lp;",
             "mov.u32 %lt, %tid.x;", "and.b32 %ll, %lt, 31;", "mov.u32 %lb, fgnf4lut;"]
    if threads > 256:           # (one row a thread: the others skip the stores)
        lines += [".reg .pred %lq;", "setp.lt.u32 %lq, %lt, 256;"]
    st = "@%lq st" if threads > 256 else "st"
    for e0 in range(0, 256, threads):
        lines += ["mul.wide.u32 %lp, %lt, 4;", "add.s64 %lp, %lp, $1;",
                  f"{'@%lq ' if threads > 256 else ''}ld.global.nc.b32 %lv, [%lp+{4 * e0}];",
                  f"add.u32 %la, %lt, {e0};", "shl.b32 %la, %la, 7;", "add.u32 %la, %la, %lb;"]
        for c in range(8):      # column chunk (c + t) % 8: 16 bytes = 4 lanes' copies
            lines += [f"add.u32 %lc, %lt, {c};", "and.b32 %lc, %lc, 7;", "shl.b32 %lc, %lc, 4;",
                      "add.u32 %lc, %lc, %la;",
                      f"{st}.shared.v4.b32 [%lc], {{%lv, %lv, %lv, %lv}};"]
    lines += ["bar.sync 0;", "shl.b32 %ll, %ll, 2;", "add.u32 $0, %lb, %ll;", "}"]
    return "\n".join(lines)


def lut_ptx(word: str, dests: list[str], base: str) -> list[str]:
    """PTX turning the 4 bytes of `word` into 4 bf16x2 registers `dests` (byte m: elements 2 m,
    2 m + 1) by loads from the shared table at `base` (`fill_ptx`'s address). Uses %fx."""
    lines = []
    for m in range(4):
        lines += [f"prmt.b32 %fx, {word}, 0, {0x4440 + m:#x};",      # byte m, zero-extended
                  f"mad.lo.u32 %fx, %fx, 128, {base};",
                  f"ld.shared.b32 {dests[m]}, [%fx];"]
    return lines


def emulate_lut(words: np.ndarray) -> np.ndarray:
    """`lut_ptx` in NumPy: words (uint32 values as int64) -> the 8 elements' bf16 bits [..., 8]."""
    tab = np.asarray(pair_table(), np.int64) & 0xFFFFFFFF
    out = []
    for m in range(4):
        v = tab[(words >> (8 * m)) & 255]
        out += [v & 0xFFFF, v >> 16]
    return np.stack(out, axis=-1)


def pack_nf4(w_packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int,
             k: int, n: int):
    """(words int32 [N / 16, K / 64, 32, 4], absmax [N / 16, K / block, 8, 2] float32 (rows r,
    r + 8), the lookup tables int32 [32 lanes * 8 + 256]: the prmt tables a lane, then the
    shared-memory pair table `pair_table`) of a bitsandbytes NF4 weight; the code table must be
    NF4's (the lookup tables hold it)."""
    from .quant_mma_pack import _row_pairs, _words_from_codes
    if not torch.equal(code.detach().float().cpu(), torch.from_numpy(NF4_CODE)):
        raise ValueError("the mma GEMV holds bitsandbytes' NF4 code table only")
    w = w_packed.reshape(n, k // 2)
    q = torch.stack([w >> 4, w & 15], dim=-1).reshape(n, k).to(torch.int64)
    j = torch.as_tensor(REMAP, device=q.device)[q]
    # _words_from_codes puts element e of a lane's eight at bit 4 (e // 2) + 16 (e % 2): feed
    # it element t = (0, 4, 1, 5, 2, 6, 3, 7)[e] so element t lands at bit 4 t
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=q.device)
    j = j.reshape(n, k // 8, 8)[..., perm].reshape(n, k)
    tab = torch.tensor(table_words(), dtype=torch.int32, device=q.device).repeat(32)
    tab = torch.cat([tab, torch.tensor(pair_table(), dtype=torch.int32, device=q.device)])
    return _words_from_codes(j), _row_pairs(absmax.reshape(n, k // block).float()), tab


def emulate_prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode) on uint32 arrays, for the CPU tests."""
    a, b, c = np.broadcast_arrays(np.asarray(a, np.int64), np.asarray(b, np.int64),
                                  np.asarray(c, np.int64))
    src = np.stack([(a >> (8 * i)) & 255 for i in range(4)]
                   + [(b >> (8 * i)) & 255 for i in range(4)], axis=-1)
    out = np.zeros(a.shape, np.int64)
    for i in range(4):
        sel = (c >> (4 * i)) & 15
        byte = np.take_along_axis(src, (sel & 7)[..., None], axis=-1)[..., 0]
        byte = np.where(sel & 8, np.where(byte & 128, 255, 0), byte)
        out |= byte << (8 * i)
    return out


def emulate_unpack(words: np.ndarray) -> np.ndarray:
    """`unpack_ptx` in NumPy: words (uint32 values as int64, any shape) -> the 8 elements'
    bf16 bits [..., 8]."""
    t = {k_: tuple(np.int64(v) for v in regs) for k_, regs in TABLES.items()}
    x = words ^ 0x88888888
    out = []
    for sel, xsel in ((words, x), (words >> 16, x >> 16)):
        lo = emulate_prmt(*t["lo0"], sel) ^ emulate_prmt(*t["lo1"], xsel)
        hi = emulate_prmt(*t["hi0"], sel) ^ emulate_prmt(*t["hi1"], xsel)
        for s in (0x5140, 0x7362):
            pair = emulate_prmt(lo, hi, np.int64(s))
            out += [pair & 0xFFFF, pair >> 16]
    return np.stack(out, axis=-1)
