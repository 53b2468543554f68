"""`fuelgraph explain [script.py] --html/--plan` and `fuelgraph bench`."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fuelgraph.benchrun as benchrun

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")

SCRIPT = """
import numpy as np
import fuelgraph as fg
x = fg.tensor(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
e = (x - x.max(-1, keepdim=True)).exp()
outputs = [e / e.sum(-1, keepdim=True)]
"""

FAKE_BENCH = """
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
import torch
import fuelgraph.functional as F
from common import fg_case, run_cases


def main(quick=False):
    a = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    t = torch.from_numpy(a)
    make = fg_case(lambda x: F.softmax_last_dim(x), [a])
    return run_cases("fake", [("softmax_last_dim", a.shape, make,
                               lambda: torch.softmax(t, -1))], quick=quick)
"""


def _cli(*args, env=ENV, cwd=None):
    return subprocess.run([sys.executable, "-m", "fuelgraph.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_explain_script_to_html_with_plan(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    out = tmp_path / "model.html"
    r = _cli("explain", str(script), "--html", str(out), "--plan", "--measure")
    assert r.returncode == 0, r.stderr
    assert "softmax_last_dim x1" in r.stdout and "peak memory" in r.stdout
    assert "measured" in r.stdout
    page = out.read_text()
    assert "softmax_last_dim" in page and "model.py" in page


def test_explain_script_without_outputs_says_so(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    r = _cli("explain", str(script))
    assert r.returncode != 0 and "defines no `outputs`" in r.stderr


def test_bench_runs_a_family_and_writes_records_and_plot(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    shutil.copy(ROOT / "bench" / "common.py", bench / "common.py")
    (bench / "bench_fake.py").write_text(FAKE_BENCH)
    env = dict(ENV, FUELGRAPH_BENCH_DIR=str(bench))
    r = _cli("bench", "--list", env=env)
    assert r.returncode == 0 and "fake" in r.stdout
    out = tmp_path / "out"
    r = _cli("bench", "fake", "--quick", "--out", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert "softmax_last_dim" in r.stdout and "torch eager" in r.stdout and "%]" in r.stdout
    assert "bench cpu" in r.stderr                         # the progress bar
    (rec,) = out.glob("fake_*.json")
    records = json.loads(rec.read_text())["records"]
    assert {x["impl"] for x in records} == {"fuelgraph", "fuelgraph lowered", "torch eager"}
    assert all(x["bytes"] > 0 for x in records)
    png = next(out.glob("bench_cpu_*.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert next(out.glob("ceilings_cpu_*.json"))


def test_bench_without_the_suite_says_where_it_lives(monkeypatch, capsys):
    monkeypatch.setattr(benchrun, "find_bench_dir", lambda: None)
    args = argparse.Namespace(families=[], device="cpu", quick=True, out=None, list=False)
    assert benchrun.bench_main(args) == 2
    assert "source repository" in capsys.readouterr().err


def test_bench_dir_found_beside_the_sources():
    assert benchrun.find_bench_dir() == ROOT / "bench"
    assert "norm" in benchrun.families(ROOT / "bench", "cpu")


def test_fraction_of_ceiling():
    ceil = {"gbps": 100.0, "tflops": 1.0}
    assert benchrun.fraction({"ms": 1.0, "bytes": 50e6}, ceil) == 0.5
    assert benchrun.fraction({"ms": 1.0, "gbps": 20.0, "tflops": 0.5}, ceil) == 0.5
    assert benchrun.fraction({"ms": 1.0}, ceil) is None
