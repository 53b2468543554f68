"""The HTML view in a real headless browser: `fuelgraph explain --html` on the demo model
(TinyBlock with its backward pass) loads without a console error or a network request, draws
the fused ops with their registry names, links a fused op to the primitives it replaced, folds
and searches; screenshots land in tests/viewer/screenshots/ (or $FUELGRAPH_SCREENSHOTS)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .browser import launch, open_page

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("FUELGRAPH_SCREENSHOTS", Path(__file__).parent / "screenshots"))
DEMO_FUSED = {"rms_norm_last_dim", "rope", "softmax_last_dim", "fused_linear",
              "fused_softmax_cross_entropy", "fused_softmax_cross_entropy_backward",
              "rms_norm_last_dim_backward", "softmax_last_dim_backward"}


@pytest.fixture(scope="module")
def demo_html(tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "demo.html"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "fuelgraph.cli", "explain", "--html", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "wrote" in r.stdout
    return out


def test_demo_page_in_chromium(demo_html):
    SHOTS.mkdir(parents=True, exist_ok=True)
    with launch() as ctx:
        page, errors, failed = open_page(ctx, demo_html)
        assert errors == [], errors
        assert failed == [], failed                      # self-contained: no request at all
        labels = set(page.eval_on_selector_all(
            "#svg-after .node.fused text:first-of-type", "els => els.map(e => e.textContent)"))
        assert DEMO_FUSED <= labels, DEMO_FUSED - labels
        # the before pane holds the hand-written primitives
        before_ops = set(page.eval_on_selector_all(
            "#svg-before .node text:first-of-type", "els => els.map(e => e.textContent)"))
        assert {"mul", "sum", "exp", "matmul"} <= before_ops
        page.screenshot(path=str(SHOTS / "demo.png"), full_page=False)

        # clicking a fused op highlights the primitives it replaced, and details show them
        nid = page.evaluate("""() => [...document.querySelectorAll('#svg-after .node.fused')]
            .find(g => g.querySelector('text').textContent === 'softmax_last_dim').dataset.id""")
        page.click(f'#svg-after [data-id="{nid}"]')
        det = page.inner_text("#details")
        assert "replaced" in det and "exp" in det and "FLOPs" in det
        assert page.eval_on_selector_all("#svg-before .node.hl", "els => els.length") >= 5
        page.screenshot(path=str(SHOTS / "demo_selected.png"))

        # search by name marks nodes in both panes
        page.fill("#search", "rms_norm")
        assert page.eval_on_selector_all(".node.match", "els => els.length") >= 3
        assert "match" in page.inner_text("#hits")
        assert page.inner_text("#plan").count("MiB") >= 1
        assert errors == [], errors


def test_near_misses_listed(tmp_path):
    """A softmax whose exp feeds a second consumer cannot fuse: the page lists the near miss
    with its first failed constraint."""
    import numpy as np

    import fuelgraph as fg
    x = fg.tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    outs = [y, e * 2.0]
    rep = fg.explain(outs)
    assert rep.near_misses
    path = rep.to_html(tmp_path / "miss.html")
    with launch() as ctx:
        page, errors, _ = open_page(ctx, path)
        text = page.inner_text("#misses")
        assert errors == [], errors
        assert "softmax_last_dim" in text and "another consumer" in text


def test_large_graph_folds_repeated_layers(tmp_path):
    """Twelve identical layers with their backward pass: folded, the page draws far fewer
    boxes; unfolding draws them all; search still finds nodes inside folded copies."""
    import fuelgraph as fg
    from viewer_models import stacked_layers
    path = fg.explain(stacked_layers(layers=12)).to_html(tmp_path / "deep.html", plan=False)
    with launch() as ctx:
        page, errors, _ = open_page(ctx, path)
        count = lambda: page.eval_on_selector_all("#svg-after .node", "e => e.length")  # noqa: E731
        folded = count()
        assert page.eval_on_selector_all("#svg-after .node.fold", "e => e.length") >= 8
        page.screenshot(path=str(SHOTS / "deep_folded.png"))
        page.uncheck("#fold")
        page.wait_for_function("document.querySelectorAll('#svg-after .node.fold').length == 0")
        assert count() > 3 * folded
        page.check("#fold")
        page.fill("#search", "softmax_last_dim_backward")
        assert "match" in page.inner_text("#hits")
        assert errors == [], errors
