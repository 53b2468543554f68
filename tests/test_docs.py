"""The documentation's examples run as written (README quick start and idioms, the training
page's loop), and the generated op reference is current."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


def run(code, tmp_path):
    env_code = "import os\nos.chdir(%r)\n" % str(tmp_path) + code
    r = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True,
                       timeout=600, env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                                         "FUELGRAPH_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.skipif(__import__("importlib").util.find_spec("safetensors") is None,
                    reason="safetensors is not installed")
def test_readme_examples_run(tmp_path):
    b = blocks("README.md")
    out = run(b[0] + "\n" + b[1], tmp_path)
    assert "softmax_last_dim" in out and (tmp_path / "model.safetensors").exists()


@pytest.mark.skipif(__import__("importlib").util.find_spec("safetensors") is None,
                    reason="safetensors is not installed")
def test_readme_decode_loop_runs(tmp_path):
    code = next(b for b in blocks("README.md") if "PagedKVCache" in b)
    out = run(code, tmp_path)
    assert out.split() == ["(4,", "8,", "12,", "64)"] + ["(4,", "8,", "1,", "64)"] * 3


@pytest.mark.skipif(__import__("importlib").util.find_spec("safetensors") is None,
                    reason="safetensors is not installed")
def test_training_page_runs(tmp_path):
    b = blocks("docs/training.md")
    out = run(b[0] + "\n" + b[1].replace("print(loss)", "pass"), tmp_path)
    acc = [float(m) for m in re.findall(r"accuracy ([0-9.]+)", out)]
    assert len(acc) == 5 and acc[-1] > 0.8


def test_op_reference_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_ops.py"), "--check"],
                       capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"),
                                                            "PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        pytest.fail("docs/ops.md is stale: run python docs/gen_ops.py\n" + r.stdout + r.stderr)
