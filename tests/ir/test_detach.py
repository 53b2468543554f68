"""detach() stops gradients (torch semantics) without changing values or blocking realize."""
import numpy as np
import torch

import fuelgraph as fg


def test_detach_matches_torch_first_and_second_order():
    a = np.array([0.5, -1.5, 2.0])
    x = fg.tensor(a, dtype=fg.float64, requires_grad=True)
    f = (x * x * x.detach() + (x.sin() * x).detach() * x).sum()
    (g,) = fg.grad(f, [x])
    (gg,) = fg.grad(g.sum(), [x])
    xt = torch.tensor(a, requires_grad=True)
    ft = (xt * xt * xt.detach() + (xt.sin() * xt).detach() * xt).sum()
    (gt,) = torch.autograd.grad(ft, [xt], create_graph=True)
    (ggt,) = torch.autograd.grad(gt.sum(), [xt])
    np.testing.assert_allclose(f.numpy(), ft.item(), rtol=1e-12)
    np.testing.assert_allclose(g.numpy(), gt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(gg.numpy(), ggt.numpy(), rtol=1e-12, atol=1e-15)


def test_detached_graph_has_no_detach_node_at_run_time():
    x = fg.tensor(np.ones((2, 3), np.float32))
    y = (x * 2.0).detach() + 1.0
    np.testing.assert_array_equal(y.numpy(), np.full((2, 3), 3.0, np.float32))
    assert fg.explain([y]).primitive_count == 2
