"""Optimizer updates as fused ops, written into the parameter's and the state's own buffers
(frontend block of built-in ids, 0x160-0x16f). `fuelgraph.optim` builds one graph per step
with one of these nodes per parameter; the runtime overwrites the parameter and state buffers
when they are handed over (donated) and no other reader needs them, else writes fresh ones.

* ADAMW_STEP (0x160)  (p, g, m, v, decay, step_size, bc2_sqrt) -> (p', m', v')
      p' = p * decay;  m' = m + (1 - beta1) * (g - m);  v' = v * beta2 + ((1 - beta2) * g) * g
      p' = p' + (-step_size) * (m' / (sqrt(v') / bc2_sqrt + eps))
  torch.optim.AdamW's single-tensor update, operation for operation: decay = 1 - lr * wd,
  step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t) are computed by the caller (in
  float64, as torch does on the host, then rounded to the accumulation dtype).
* SGD_STEP (0x161)    (p, g, lr[, buf, first]) -> (p'[, buf'])
      d = g + wd * p;  buf' = first ? d : buf * momentum + (1 - dampening) * d
      d = nesterov ? d + momentum * buf' : buf';  p' = p + (-lr) * d
  torch.optim.SGD's single-tensor update; without momentum (momentum == 0) there is no buffer
  and p' = p + (-lr) * d. `first` is 1.0 on the first step (the buffer starts as d).

p, g, m, v, buf share one shape and one float dtype (float32, float64, bfloat16, float16; the
state has the parameter's dtype, as in torch); the scalars are 0-d tensors in the accumulation
dtype (float32 for 16/32-bit parameters, float64 for float64) so that a new learning rate or
step count is new data for the same cached plan, not a new graph. Computation is in the
accumulation dtype with one rounding per output. Updates are not differentiable."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FuelGraphError
from ..ir.tensor import where
from .core import BackwardKind, FusedOpEntry, FusedOpId, call_fused
from .rules import check_float, real_param

ADAMW_STEP = FusedOpId(0x160)
SGD_STEP = FusedOpId(0x161)


@dataclass(frozen=True)
class AdamWParams:
    """beta1, beta2 in [0, 1); eps > 0 (the denominator floor)."""
    beta1: float
    beta2: float
    eps: float


@dataclass(frozen=True)
class SGDParams:
    """momentum >= 0 (0: no buffer input/output), dampening, weight_decay, nesterov."""
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool


# ---- recipes ---------------------------------------------------------------------------------
def adamw_step_recipe(p, g, m, v, decay, step_size, bc2_sqrt, beta1, beta2, eps):
    t = p.dtype
    a = t.acc
    p, g, m, v = (x.astype(a) for x in (p, g, m, v))
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + ((1.0 - beta2) * g) * g
    denom = v.sqrt() / bc2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    return p.astype(t), m.astype(t), v.astype(t)


def sgd_step_recipe(p, g, lr, *state, momentum, dampening, weight_decay, nesterov):
    t = p.dtype
    a = t.acc
    pa, d = p.astype(a), g.astype(a)
    if weight_decay != 0.0:
        d = d + weight_decay * pa
    if momentum == 0.0:
        return (pa + (-lr) * d).astype(t)
    buf, first = state
    b = buf.astype(a)
    b = where(first > 0.5, d, b * momentum + (1.0 - dampening) * d)
    d = d + momentum * b if nesterov else b
    return (pa + (-lr) * d).astype(t), b.astype(t)


# ---- validation and rules ---------------------------------------------------------------------------
def _check_like(name, srcs, which, labels):
    s0 = srcs[0]
    for i in which:
        if srcs[i].shape != s0.shape:
            raise FuelGraphError(f"{name}: {labels[i]} has shape {srcs[i].shape}, expected "
                                 f"{s0.shape} (the parameter's)")
        if srcs[i].dtype != s0.dtype:
            raise FuelGraphError(f"{name}: {labels[i]} has dtype {srcs[i].dtype.name}, expected "
                                 f"{s0.dtype.name} (the parameter's)")


def _check_scalars(name, srcs, which, labels):
    acc = srcs[0].dtype.acc
    for i in which:
        if tuple(srcs[i].shape) != () or srcs[i].dtype != acc:
            raise FuelGraphError(f"{name}: {labels[i]} must be a 0-d {acc.name} tensor, got "
                                 f"shape {tuple(srcs[i].shape)} {srcs[i].dtype.name}")


def _check_real(name, params, *fields):
    for f in fields:
        v = getattr(params, f)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                or not np.isfinite(v):
            raise FuelGraphError(f"{name}: param {f} must be a finite real number, got {v!r}")


_ADAMW_LABELS = ["p", "g", "m", "v", "decay", "step_size", "bc2_sqrt"]


def _adamw_validate(srcs, params):
    name = "adamw_step"
    if len(srcs) != 7:
        raise FuelGraphError(f"{name}: expected 7 inputs (p, g, m, v, decay, step_size, "
                             f"bc2_sqrt), got {len(srcs)}")
    check_float(name, srcs, which=range(4), labels=_ADAMW_LABELS)
    _check_like(name, srcs, (1, 2, 3), _ADAMW_LABELS)
    _check_scalars(name, srcs, (4, 5, 6), _ADAMW_LABELS)
    _check_real(name, params, "beta1", "beta2", "eps")
    if not (0.0 <= params.beta1 < 1.0 and 0.0 <= params.beta2 < 1.0) or params.eps <= 0:
        raise FuelGraphError(f"{name}: betas must be in [0, 1) and eps > 0, got "
                             f"({params.beta1}, {params.beta2}), {params.eps}")


_SGD_LABELS = ["p", "g", "lr", "buf", "first"]


def _sgd_validate(srcs, params):
    name = "sgd_step"
    _check_real(name, params, "momentum", "dampening", "weight_decay")
    want = 3 if params.momentum == 0.0 else 5
    if len(srcs) != want:
        raise FuelGraphError(f"{name}: expected {want} inputs ("
                             f"{', '.join(_SGD_LABELS[:want])}) for momentum={params.momentum}, "
                             f"got {len(srcs)}")
    check_float(name, srcs, which=range(2), labels=_SGD_LABELS)
    _check_like(name, srcs, (1,) if want == 3 else (1, 3), _SGD_LABELS)
    _check_scalars(name, srcs, (2,) if want == 3 else (2, 4), _SGD_LABELS)
    if params.momentum < 0 or (params.nesterov and (params.momentum <= 0 or params.dampening)):
        raise FuelGraphError(f"{name}: momentum must be >= 0, and nesterov needs momentum > 0 "
                             f"and dampening 0 (got momentum={params.momentum}, dampening="
                             f"{params.dampening}, nesterov={params.nesterov})")


def _adamw_sample(rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [f(4, 6), f(4, 6), f(4, 6) * 0.1, np.abs(f(4, 6)) * 0.01,
            np.float32(0.999), np.float32(0.01), np.float32(0.3)]


def _sgd_sample(rng):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [f(4, 6), f(4, 6), np.float32(0.1), f(4, 6), np.float32(0.0)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=ADAMW_STEP, name="adamw_step", family="optim", params=AdamWParams,
        shape_rule=lambda shapes, p: [shapes[0]] * 3,
        dtype_rule=lambda dtypes, p: [dtypes[0]] * 3, validate=_adamw_validate,
        decompose=adamw_step_recipe, backward=BackwardKind.NOT_DIFFERENTIABLE,
        outputs=("p", "m", "v"), destructive_inputs=(0, 2, 3), pattern_variants=None,
        sample=_adamw_sample,
        doc="One AdamW step (torch.optim.AdamW's single-tensor arithmetic): p, g, m, v [...] "
            "one float dtype; decay = 1 - lr*wd, step_size = lr / (1 - beta1^t), bc2_sqrt = "
            "sqrt(1 - beta2^t) 0-d in acc(T) -> (p', m', v'), written over p, m and v when "
            "they are handed over. params beta1, beta2, eps. Not differentiable."))
    reg.add(FusedOpEntry(
        id=SGD_STEP, name="sgd_step", family="optim", params=SGDParams,
        shape_rule=lambda shapes, p: [shapes[0]] * (1 if p.momentum == 0.0 else 2),
        dtype_rule=lambda dtypes, p: [dtypes[0]] * (1 if p.momentum == 0.0 else 2),
        validate=_sgd_validate, decompose=sgd_step_recipe,
        backward=BackwardKind.NOT_DIFFERENTIABLE, outputs=("p", "buf"),
        destructive_inputs=(0, 3), pattern_variants=None, sample=_sgd_sample,
        doc="One SGD step (torch.optim.SGD's single-tensor arithmetic): p, g [...] one float "
            "dtype, lr 0-d acc(T), with momentum also buf [...] and first (0-d, 1.0 on the "
            "first step) -> p' (and buf'), written over p (and buf) when handed over. params "
            "momentum, dampening, weight_decay, nesterov. Not differentiable."))


# ---- builders ------------------------------------------------------------------------------------
def adamw_step(p, g, m, v, decay, step_size, bc2_sqrt, beta1=0.9, beta2=0.999, eps=1e-8):
    """One AdamW update -> (p', m', v'). p, g, m, v: one shape and float dtype; decay
    (= 1 - lr * weight_decay), step_size (= lr / (1 - beta1**t)) and bc2_sqrt
    (= sqrt(1 - beta2**t)): 0-d tensors in the accumulation dtype (float32 for 16/32-bit,
    float64 for float64). Runs in place on p, m and v when the runtime may overwrite them."""
    return call_fused(ADAMW_STEP, p, g, m, v, decay, step_size, bc2_sqrt,
                      beta1=real_param(beta1), beta2=real_param(beta2), eps=real_param(eps))


def sgd_step(p, g, lr, buf=None, first=None, momentum=0.0, dampening=0.0, weight_decay=0.0,
             nesterov=False):
    """One SGD update -> p' (momentum 0) or (p', buf'). p, g (and buf): one shape and float
    dtype; lr and first (1.0 on the first step with momentum): 0-d in the accumulation dtype."""
    srcs = (p, g, lr) if float(momentum) == 0.0 else (p, g, lr, buf, first)
    return call_fused(SGD_STEP, *srcs, momentum=real_param(momentum),
                      dampening=real_param(dampening), weight_decay=real_param(weight_decay),
                      nesterov=bool(nesterov))
