"""Learning-rate schedules with torch.optim.lr_scheduler's names and formulas. A schedule sets
each parameter group's "lr", a run-time input of the optimizer's plan: a traced step keeps
replaying the same plan with the new rate."""
from __future__ import annotations

import abc
import math

__all__ = ["LRScheduler", "LambdaLR", "StepLR", "CosineAnnealingLR"]


class LRScheduler(abc.ABC):
    """torch.optim.lr_scheduler's protocol: `step()` once per epoch (or per step) sets every
    group's learning rate (a run-time input of the step's plan: no new graph);
    `get_last_lr()`."""

    def __init__(self, optimizer, last_epoch: int = -1):
        self.optimizer = optimizer
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        for g, b in zip(optimizer.param_groups, self.base_lrs):
            dict.__setitem__(g, "initial_lr", b)
        self.last_epoch = last_epoch
        self.step()

    @abc.abstractmethod
    def lr_at(self, epoch: int, base: float, i: int) -> float:
        """The learning rate of group i at `epoch`, from its base rate (each schedule's formula)."""

    def step(self):
        self.last_epoch += 1
        for i, (g, b) in enumerate(zip(self.optimizer.param_groups, self.base_lrs)):
            g["lr"] = self.lr_at(self.last_epoch, b, i)

    def get_last_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, sd: dict):
        self.last_epoch, self.base_lrs = int(sd["last_epoch"]), list(sd["base_lrs"])


class LambdaLR(LRScheduler):
    """lr = base_lr * lr_lambda(epoch)."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        n = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) \
            else [lr_lambda] * n
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch, base, i):
        return base * self.lr_lambdas[i](epoch)


class StepLR(LRScheduler):
    """lr = base_lr * gamma ** (epoch // step_size)."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch, base, i):
        return base * self.gamma ** (epoch // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch, base, i):
        return self.eta_min + (base - self.eta_min) * \
            (1 + math.cos(math.pi * epoch / self.T_max)) / 2
