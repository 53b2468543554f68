#!/usr/bin/env python3
"""One small plain causal forward through the warp-specialized kernel under the settings
given as KEY=VALUE arguments (attention.VARIANTS), checked against SDPA: a quick probe that
a variant runs (and does not hang) before a benchmark times it.

    python3 bench/ws_smoke.py WS_SKIP_MASK_WINDOW=1 [WS_HEADS=4 ...] [window=1024]

window=W: a causal sliding window of W keys to the left (the persistent kernel's case).
"""
from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
from fuelgraph.backends.cuda.kernels import attention as K  # noqa: E402


def main():
    window = None
    for arg in sys.argv[1:]:
        key, val = arg.split("=")
        if key == "window":
            window = int(val)
            continue
        K.VARIANTS[key] = int(val) if val.isdigit() and int(val) > 1 else val not in ("0", "false")
    worst = 0.0
    for b, h, sq, sk in ((1, 16, 1024, 1024), (2, 16, 768, 256), (1, 16, 256, 640)):
        q = torch.randn(b, h, sq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, h, sk, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        out, _ = K.flash_attn(q, k, v, softmax_scale=128 ** -0.5, causal=True,
                              window_size_left=window)
        mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
        if window is not None:
            mask &= ~torch.ones_like(mask).tril(sk - sq - window - 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask)
        ref = torch.where(mask.any(-1)[:, None], ref, torch.zeros_like(ref))
        worst = max(worst, (out.float() - ref).abs().max().item())
    torch.cuda.synchronize()
    print(f"smoke {' '.join(sys.argv[1:])}: max err {worst:.2e}", "ok" if worst < 3e-2 else "BAD")
    sys.exit(0 if worst < 3e-2 else 1)


if __name__ == "__main__":
    main()
