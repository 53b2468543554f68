"""End-to-end smoke tests of the public surface (CLI included)."""
import re
import subprocess
import sys

import numpy as np
import torch

import fuelgraph as fg


def test_softmax_idiom_fuses_and_matches_torch():
    a = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
    x = fg.tensor(a)
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    assert fg.explain([y]).fused_ops == {"softmax_last_dim": 1}
    np.testing.assert_allclose(y.numpy(), torch.softmax(torch.tensor(a), -1).numpy(), rtol=1e-6, atol=1e-7)


def test_cli_registry_lists_all_ids():
    out = subprocess.run([sys.executable, "-m", "fuelgraph.cli", "registry"], capture_output=True,
                         text=True, check=True).stdout
    for name in ("softmax_last_dim", "awq_matmul", "flash_attn_backward_v"):
        assert name in out
    ids = [int(l.split()[0]) for l in out.splitlines() if re.match(r"^\d+\s{2,}[a-z]", l)]
    assert ids[:25] == list(range(1, 26)) and all(i >= 0x100 for i in ids[25:])
    assert 0x100 in ids   # fused_softmax_cross_entropy_backward, a fixed built-in id


def test_cli_demo_runs():
    out = subprocess.run([sys.executable, "-m", "fuelgraph.cli", "demo"], capture_output=True,
                         text=True, check=True, timeout=300).stdout
    assert "softmax_last_dim" in out and "max relative error" in out
