"""A ResNet-style CNN written with fuelgraph tensors: 3x3 convolutions (`conv2d`), batch norm
in primitives (batch statistics while training, running statistics in eval, or folded into the
convolution for inference) and residual connections. Names follow torchvision's ResNet
(conv1, bn1, layer1.0.conv1, ..., downsample.0/1, fc), so a torch state dict of the same shape
loads with `load_state_dict` (drop its `num_batches_tracked` entries).

    net = ResNet(widths=(16, 32), blocks=(1, 1), num_classes=10)
    logits = net(images)                 # images [N, 3, H, W] -> [N, 10]
    net.eval().fold_batchnorm()          # inference: each BN folded into its conv's weights
"""
from __future__ import annotations

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..nn import functional as F
from ..nn.layers import Conv2d, Linear
from ..nn.module import Buffer, Module, Parameter, Sequential


class BatchNorm2d(Module):
    """Batch norm over [N, C, H, W] per channel, as torch.nn.BatchNorm2d: in training the batch
    mean and biased variance normalize, and running_mean / running_var (unbiased) move by
    `momentum`; in eval the running statistics are used."""

    def __init__(self, channels, eps=1e-5, momentum=0.1, dtype=dt.float32, device="cpu"):
        super().__init__()
        self.eps, self.momentum = float(eps), float(momentum)
        self.weight = Parameter(np.ones(channels, dtype.np))
        self.bias = Parameter(np.zeros(channels, dtype.np))
        self.register_buffer("running_mean", np.zeros(channels, dtype.np))
        self.register_buffer("running_var", np.ones(channels, dtype.np))
        if device != "cpu":
            self.to(device)

    def forward(self, x):
        c = x.shape[1]
        if self.training:
            n = x.numel() // c
            mean = x.mean((0, 2, 3), keepdim=True)
            d = x - mean
            var = (d * d).mean((0, 2, 3), keepdim=True)
            m = self.momentum
            # torch's update: the unbiased variance goes into the running estimate
            self.running_mean.copy_((1 - m) * self.running_mean + m * mean.reshape(c).detach())
            self.running_var.copy_((1 - m) * self.running_var +
                                   m * var.reshape(c).detach() * (n / max(n - 1, 1)))
        else:
            mean, var = self.running_mean.reshape(1, c, 1, 1), self.running_var.reshape(1, c, 1, 1)
            d = x - mean
        scale = self.weight.reshape(1, c, 1, 1) / (var + self.eps).sqrt()
        return d * scale + self.bias.reshape(1, c, 1, 1)

    def folded(self):
        """(scale [C], shift [C]) with bn(x) = x * scale + shift in eval mode (NumPy)."""
        w, b = self.weight.numpy(), self.bias.numpy()
        rm, rv = self.running_mean.numpy(), self.running_var.numpy()
        scale = w / np.sqrt(rv + self.eps)
        return scale, b - rm * scale


def fold_into(conv: Conv2d, bn: BatchNorm2d) -> None:
    """conv followed by bn (eval) becomes one conv: weight * scale, bias * scale + shift."""
    scale, shift = bn.folded()
    w = conv.weight.numpy() * scale[:, None, None, None]
    b = shift if conv.bias is None else conv.bias.numpy() * scale + shift
    conv.weight = Parameter(w.astype(conv.weight.dtype.np))
    conv.bias = Parameter(b.astype(conv.weight.dtype.np))


class _Folded(Module):
    """Stands where a batch norm was folded into the preceding conv."""

    def forward(self, x):
        return x


def _conv3x3(cin, cout, stride, dtype, device):
    return Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, dtype=dtype, device=device)


class BasicBlock(Module):
    """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), shortcut = x, or a strided 1x1
    conv + bn when the shape changes."""

    def __init__(self, cin, cout, stride=1, dtype=dt.float32, device="cpu"):
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride, dtype, device)
        self.bn1 = BatchNorm2d(cout, dtype=dtype, device=device)
        self.conv2 = _conv3x3(cout, cout, 1, dtype, device)
        self.bn2 = BatchNorm2d(cout, dtype=dtype, device=device)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = Sequential(Conv2d(cin, cout, 1, stride=stride, bias=False,
                                                dtype=dtype, device=device),
                                         BatchNorm2d(cout, dtype=dtype, device=device))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        short = x if self.downsample is None else self.downsample(x)
        return F.relu(y + short)

    def fold_batchnorm(self):
        pairs = [(self, "conv1", "bn1"), (self, "conv2", "bn2")]
        if self.downsample is not None:
            pairs.append((self.downsample, "0", "1"))
        for owner, c, b in pairs:
            bn = getattr(owner, b)
            if isinstance(bn, BatchNorm2d):
                fold_into(getattr(owner, c), bn)
                setattr(owner, b, _Folded())


class ResNet(Module):
    """Stem (3x3 conv, bn, relu), stages of BasicBlocks (the first block of each stage after the
    first halves the resolution), global average pool, linear classifier."""

    def __init__(self, widths=(16, 32), blocks=(1, 1), num_classes=10, in_channels=3,
                 dtype=dt.float32, device="cpu"):
        super().__init__()
        if len(widths) != len(blocks) or not widths:
            raise FuelGraphError(f"ResNet: widths {widths} and blocks {blocks} must be non-empty "
                                 f"and of one length")
        self.conv1 = _conv3x3(in_channels, widths[0], 1, dtype, device)
        self.bn1 = BatchNorm2d(widths[0], dtype=dtype, device=device)
        cin = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stage = Sequential(*[BasicBlock(cin if j == 0 else w, w, 2 if (i and j == 0) else 1,
                                            dtype, device) for j in range(n)])
            setattr(self, f"layer{i + 1}", stage)
            cin = w
        self.nstages = len(widths)
        self.fc = Linear(cin, num_classes, dtype=dtype, device=device)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(self.nstages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(x.mean((2, 3)))

    def fold_batchnorm(self):
        """Fold every batch norm into the conv before it (eval-mode inference; the model keeps
        computing the same function with fewer ops). Returns self."""
        if self.training:
            raise FuelGraphError("fold_batchnorm: call eval() first (folding uses the running "
                                 "statistics)")
        if isinstance(self.bn1, BatchNorm2d):
            fold_into(self.conv1, self.bn1)
            self.bn1 = _Folded()
        for m in self.modules():
            if isinstance(m, BasicBlock):
                m.fold_batchnorm()
        return self
