"""Optimizers with torch.optim's names, arguments and arithmetic: `SGD` (momentum, dampening,
weight decay, Nesterov) and `AdamW`; `step()` / `zero_grad()`, `param_groups`,
`state_dict()` / `load_state_dict()`.

A step is one graph for all parameters (one fused update op per parameter, registry
`optim` family) that runs as one cached plan: the first step traces it (fuelgraph.jit) and
later steps replay it. The parameters and their state are overwritten in place when nothing
else holds their old values (else the old values keep a copy). The learning rate and the step
count are 0-d tensors read when the plan runs, so `group["lr"] = x` (a schedule) changes no
graph; changing another hyperparameter traces the step again.

Inside a traced training step (`fg.jit`), `opt.step()` becomes part of that step's graph.

One difference from torch: the step count that drives Adam's bias correction is kept per
parameter group, not per parameter (they differ only for a parameter that had no gradient at
some step)."""
from __future__ import annotations


import numpy as np

from .. import dtype as dt
from ..api import assign, bind_buffer
from ..backends import get_backend
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.tensor import OWNER, REALIZED, TRACE, Tensor, _leaf, full
from ..jit import current_trace, jit
from ..registry.optim import adamw_step, sgd_step
from ..runtime.executor import realize_raw


def new_cell(array: np.ndarray, dtype, device: str) -> Tensor:
    """A state tensor (a leaf the optimizer rebinds) holding a copy of `array` on `device`."""
    buf = get_backend(device).from_any(np.asarray(array, dtype=dtype.np), device)
    t = _leaf(buf, dtype, device, False)
    OWNER[t.value.node] = (t, "value")
    return t


class ParamGroup(dict):
    """A parameter group: a dict as in torch. Setting "lr" updates the 0-d learning-rate
    tensors the step reads (no new graph)."""

    def __init__(self, opt, d):
        super().__init__(d)
        self._opt = opt

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        if k == "lr":
            for dev, cell in self._opt._lr_cells.get(id(self), {}).items():
                bind_buffer(cell, get_backend(dev).from_any(np.array(float(v), np.float64), dev))


class Optimizer:
    """Base class: param_groups, state, zero_grad, step through one cached plan."""
    defaults: dict = {}

    def __init__(self, params, defaults):
        params = list(params)
        if not params:
            raise FuelGraphError(f"{type(self).__name__}: got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        self.defaults = dict(defaults)
        self.param_groups: list[ParamGroup] = []
        self.state: dict = {}           # id(param) -> {name: cell}
        self._lr_cells: dict = {}       # id(group) -> {device: 0-d float64 cell}
        self._step_cells: dict = {}     # id(group) -> {device: 0-d float64 cell}
        for g in params:
            self.add_param_group(g)
        self._step = jit(self._update)
        self._step.__name__ = f"{type(self).__name__}.step"

    def add_param_group(self, group: dict):
        g = dict(self.defaults, **group)
        g["params"] = list(group["params"])
        for p in g["params"]:
            if not isinstance(p, Tensor) or not p.is_leaf:
                raise FuelGraphError(f"{type(self).__name__}: parameters must be leaf tensors "
                                     f"(fuelgraph.nn.Parameter or requires_grad tensors)")
            if p.value.node not in OWNER:
                OWNER[p.value.node] = (p, "value")
        self._check(g)
        self.param_groups.append(ParamGroup(self, g))
        if hasattr(self, "_step"):
            self._step.retrace()

    def _check(self, g):
        if not g["lr"] >= 0:
            raise FuelGraphError(f"{type(self).__name__}: lr must be >= 0, got {g['lr']}")

    def zero_grad(self, set_to_none: bool = True):
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad = full(p.shape, 0, p.dtype, p.device)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _hyper(self):
        return tuple(tuple((k, v) for k, v in sorted(g.items()) if k not in ("params", "lr"))
                     for g in self.param_groups)

    def step(self, closure=None):
        """Apply one update to every parameter that has a gradient (one plan)."""
        loss = closure() if closure is not None else None
        if TRACE[0] is None:
            _leafify_grads(self._params())
        self._step()
        return loss

    # -- the traced update --
    def _scalar(self, table, g, device, init):
        cells = table.setdefault(id(g), {})
        c = cells.get(device)
        if c is None:
            c = cells[device] = new_cell(np.array(init, np.float64), dt.float64, device)
        return c

    def _update(self):
        tr = current_trace()
        if tr is not None:     # which gradients exist is guarded by the trace's .grad reads
            tr.guard(self._hyper, key=("hyper", id(self)))
        for g in self.param_groups:
            live = [p for p in g["params"] if p.grad is not None]
            by_dev: dict = {}
            for p in live:
                by_dev.setdefault(p.device, []).append(p)
            for dev, ps in by_dev.items():
                lr = self._scalar(self._lr_cells, g, dev, g["lr"])
                self._group_update(g, dev, ps, lr)

    def state_dict(self) -> dict:
        """torch's layout: {"state": {index: {name: tensor}}, "param_groups": [...]}."""
        index = {id(p): i for i, p in enumerate(self._params())}
        state = {}
        for p in self._params():
            st = self.state.get(id(p))
            if st:
                state[index[id(p)]] = {k: Tensor(v.value) for k, v in st.items()}
        for gi, g in enumerate(self.param_groups):
            for dev, c in self._step_cells.get(id(g), {}).items():
                for p in g["params"]:
                    if index[id(p)] in state:
                        state[index[id(p)]]["step"] = Tensor(c.value)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict):
        params = self._params()
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups):
            raise FuelGraphError(f"load_state_dict: {len(groups)} parameter groups, expected "
                                 f"{len(self.param_groups)}")
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = tuple(v) if isinstance(v, list) else v
        for key, st in sd["state"].items():
            p = params[int(key)]
            cells = self.state.setdefault(id(p), {})
            for name, v in st.items():
                arr = v.numpy() if isinstance(v, Tensor) else np.asarray(v)
                if name == "step":
                    g = next(g for g in self.param_groups if any(q is p for q in g["params"]))
                    c = self._scalar(self._step_cells, g, p.device, 0.0)
                    bind_buffer(c, get_backend(p.device).from_any(
                        np.asarray(arr, np.float64).reshape(()), p.device))
                    continue
                if name in cells:
                    bind_buffer(cells[name], get_backend(p.device).from_any(
                        np.asarray(arr, dtype=p.dtype.np), p.device))
                else:
                    cells[name] = new_cell(arr, p.dtype, p.device)
        self._step.retrace()


def _leafify_grads(params) -> None:
    """Compute every lazy gradient (one plan) and make each a leaf holding its buffer, so the
    step reads buffers, never the forward/backward graph."""
    lazy = [p for p in params if p._grad is not None and
            not isinstance(p._grad.value.node.op, ops.Input)]
    if not lazy:
        return
    realize_raw([p._grad for p in lazy])
    for p in lazy:
        v = p._grad.value
        hit = REALIZED.get(v.node, {}).get(v.slot)
        if hit is not None:
            p.grad = Tensor(hit.out(0))


def _acc_scalar(x: Tensor, p: Tensor) -> Tensor:
    return x.astype(p.dtype.acc)


class SGD(Optimizer):
    """torch.optim.SGD: d = g + weight_decay * p; with momentum, buf = momentum * buf +
    (1 - dampening) * d (buf = d at the first step) and d = buf (or d + momentum * buf with
    nesterov); p -= lr * d."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, maximize=False):
        if maximize:
            raise FuelGraphError("SGD: maximize=True is not supported")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _check(self, g):
        super()._check(g)
        if g["momentum"] < 0 or g["weight_decay"] < 0:
            raise FuelGraphError("SGD: momentum and weight_decay must be >= 0")
        if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise FuelGraphError("SGD: nesterov needs momentum > 0 and dampening 0")

    def _group_update(self, g, dev, ps, lr):
        mom = float(g["momentum"])
        if mom != 0.0:
            step = self._scalar(self._step_cells, g, dev, 0.0)
            first = (step == 0.0).astype(dt.float64)
            assign(step, step + 1.0)
        for p in ps:
            a = _acc_scalar(lr, p)
            if mom == 0.0:
                assign(p, sgd_step(p, p.grad, a, weight_decay=g["weight_decay"]))
                continue
            st = self.state.setdefault(id(p), {})
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = new_cell(np.zeros(p.shape), p.dtype, p.device)
            buf = st["momentum_buffer"]
            p2, b2 = sgd_step(p, p.grad, a, buf, _acc_scalar(first, p), momentum=mom,
                              dampening=g["dampening"], weight_decay=g["weight_decay"],
                              nesterov=g["nesterov"])
            assign(p, p2)
            assign(buf, b2)


class AdamW(Optimizer):
    """torch.optim.AdamW: p *= 1 - lr * weight_decay; m = lerp(m, g, 1 - beta1);
    v = beta2 * v + (1 - beta2) * g^2; p -= lr / (1 - beta1^t) * m / (sqrt(v) /
    sqrt(1 - beta2^t) + eps). The bias corrections are computed in float64 (as torch does on
    the host) from the 0-d step and learning-rate tensors."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, maximize=False):
        if amsgrad or maximize:
            raise FuelGraphError("AdamW: amsgrad and maximize are not supported")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def _check(self, g):
        super()._check(g)
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0) or not g["eps"] > 0:
            raise FuelGraphError(f"AdamW: betas must be in [0, 1) and eps > 0, got "
                                 f"{g['betas']}, {g['eps']}")

    def _group_update(self, g, dev, ps, lr):
        b1, b2 = (float(b) for b in g["betas"])
        step = self._scalar(self._step_cells, g, dev, 0.0)
        t = step + 1.0
        assign(step, t)
        decay = 1.0 - lr * float(g["weight_decay"])
        step_size = lr / (1.0 - full((), b1, dt.float64, dev) ** t)
        bc2_sqrt = (1.0 - full((), b2, dt.float64, dev) ** t).sqrt()
        for p in ps:
            st = self.state.setdefault(id(p), {})
            if "exp_avg" not in st:
                st["exp_avg"] = new_cell(np.zeros(p.shape), p.dtype, p.device)
                st["exp_avg_sq"] = new_cell(np.zeros(p.shape), p.dtype, p.device)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            p2, m2, v2 = adamw_step(p, p.grad, m, v, _acc_scalar(decay, p),
                                    _acc_scalar(step_size, p), _acc_scalar(bc2_sqrt, p),
                                    beta1=b1, beta2=b2, eps=float(g["eps"]))
            assign(p, p2)
            assign(m, m2)
            assign(v, v2)


class Adam(AdamW):
    """torch.optim.Adam with weight_decay 0 (the L2 form of weight decay is not offered:
    use AdamW)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        if weight_decay:
            raise FuelGraphError("Adam: weight_decay > 0 is the L2 form; use AdamW for "
                                 "decoupled weight decay")
        super().__init__(params, lr, betas, eps, 0.0)


from . import lr_scheduler  # noqa: E402,F401  (torch's layout: fuelgraph.optim.lr_scheduler)
