"""fg.plan_report on the GPU: the predicted peak of the plan's allocations (512-byte caching-
allocator blocks) against torch.cuda.max_memory_allocated over one run, on the demo model and
a GPT-style transformer block, forward and backward."""
from __future__ import annotations

import pytest

import fuelgraph as fg

from viewer_models import demo_graph, gpt_block

from .cuda_oracle import ON_GPU

pytestmark = ON_GPU


@pytest.mark.parametrize("build", [demo_graph, gpt_block], ids=["demo", "gpt_block"])
def test_predicted_peak_within_10_percent_of_measured_on_gpu(build):
    rep = fg.plan_report(build(device="cuda"), measure=True)
    print(f"\n{build.__name__}:\n{rep}")
    assert rep.backend == "cuda"
    assert 0.9 <= rep.agreement <= 1.1, str(rep)
