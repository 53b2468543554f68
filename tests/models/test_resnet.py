"""fuelgraph.models ResNet-style CNN against a torch.nn twin with the same names: eval and
training forward (batch statistics, running-statistic updates), gradients, BN folding."""
import numpy as np
import pytest
import torch
import torch.nn as tnn

import fuelgraph as fg
from fuelgraph import FuelGraphError
from fuelgraph.models import ResNet


class TorchBlock(tnn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(cout)
        self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = tnn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = tnn.Sequential(tnn.Conv2d(cin, cout, 1, stride, bias=False),
                                             tnn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class TorchNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = tnn.BatchNorm2d(8)
        self.layer1 = tnn.Sequential(TorchBlock(8, 8, 1))
        self.layer2 = tnn.Sequential(TorchBlock(8, 16, 2))
        self.fc = tnn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


@pytest.fixture
def pair():
    torch.manual_seed(0)
    tm = TorchNet()
    with torch.no_grad():
        for m in tm.modules():
            if isinstance(m, tnn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    net = ResNet(widths=(8, 16), blocks=(1, 1), num_classes=10)
    net.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()
                         if not k.endswith("num_batches_tracked")})
    x = np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32)
    return net, tm, x


def test_eval_forward_and_folding(pair):
    net, tm, x = pair
    net.eval()
    tm.eval()
    with torch.no_grad():
        ref = tm(torch.tensor(x)).numpy()
    np.testing.assert_allclose(net(fg.tensor(x)).numpy(), ref, rtol=1e-4, atol=1e-5)
    rep = fg.explain([net(fg.tensor(x))])
    assert rep.fused_ops == {"conv2d": 6, "fused_linear": 1}
    assert not ({"conv2d", "fused_linear"} & set(rep.near_misses))
    folded = net.fold_batchnorm()
    assert not any("bn" in k or "downsample.1" in k for k, _ in folded.named_parameters())
    np.testing.assert_allclose(folded(fg.tensor(x)).numpy(), ref, rtol=1e-4, atol=1e-5)
    assert fg.explain([folded(fg.tensor(x))]).fused_ops == {"conv2d": 6, "fused_linear": 1}


def test_training_forward_gradients_and_running_stats(pair):
    net, tm, x = pair
    net.train()
    tm.train()
    xt = torch.tensor(x)
    yt = tm(xt)
    (yt * yt).mean().backward()
    y = net(fg.tensor(x))
    (y * y).mean().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-4, atol=1e-5)
    for name in ("conv1.weight", "layer2.0.conv1.weight", "layer2.0.downsample.0.weight",
                 "bn1.weight", "layer1.0.bn2.bias", "fc.weight"):
        g = dict(net.named_parameters())[name].grad.numpy()
        r = dict(tm.named_parameters())[name].grad.numpy()
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-6, err_msg=name)
    for name in ("layer2.0.bn2.running_var", "bn1.running_mean"):
        np.testing.assert_allclose(dict(net.named_buffers())[name].numpy(),
                                   tm.state_dict()[name].numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(FuelGraphError, match="eval"):
        net.fold_batchnorm()
