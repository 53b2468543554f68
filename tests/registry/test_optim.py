"""Optimizer update ops (registry/optim.py): adamw_step and sgd_step against torch.optim's own
single-tensor updates (one step from the same state, four float dtypes), the recipe against
the kernel, in-place reuse of handed-over buffers, validation errors, and not-differentiable."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph import FuelGraphError
from fuelgraph.registry.optim import ADAMW_STEP, SGD_STEP, adamw_step, sgd_step
from fuelgraph.runtime.executor import compile_plan
from tests.oracle import assert_close_dtype

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
DTYPES = list(NP)


def _state(shape, seed, dtype):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape)
    g = rng.standard_normal(shape)
    m = rng.standard_normal(shape) * 0.1
    v = np.abs(rng.standard_normal(shape)) * 0.01
    return [a.astype(NP[dtype]) for a in (p, g, m, v)]


def _torch_adamw(p, g, m, v, tdtype, lr, wd, betas, eps, step):
    """One torch.optim.AdamW step (single-tensor path) from state (m, v, step - 1)."""
    tp = torch.nn.Parameter(torch.tensor(np.asarray(p, np.float64)).to(tdtype))
    tp.grad = torch.tensor(np.asarray(g, np.float64)).to(tdtype)
    opt = torch.optim.AdamW([tp], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    opt.state[tp] = {"step": torch.tensor(float(step - 1)),
                     "exp_avg": torch.tensor(np.asarray(m, np.float64)).to(tdtype),
                     "exp_avg_sq": torch.tensor(np.asarray(v, np.float64)).to(tdtype)}
    opt.step()
    st = opt.state[tp]
    return [t.detach().double().numpy() for t in (tp, st["exp_avg"], st["exp_avg_sq"])]


def _scalars(dtype, lr, wd, betas, step):
    acc = np.float64 if dtype == "float64" else np.float32
    s = lambda x: fg.tensor(acc(x))  # noqa: E731
    return (s(1 - lr * wd), s(lr / (1 - betas[0] ** step)),
            s(math.sqrt(1 - betas[1] ** step)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,step", [((7,), 1), ((3, 5, 4), 3), ((), 10)])
def test_adamw_step_matches_torch(dtype, shape, step):
    lr, wd, betas, eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    p, g, m, v = _state(shape, step, dtype)
    outs = adamw_step(*(fg.tensor(a) for a in (p, g, m, v)),
                      *_scalars(dtype, lr, wd, betas, step), beta1=betas[0], beta2=betas[1],
                      eps=eps)
    got = [o.numpy().astype(np.float64) for o in fg.realize(list(outs))]
    for o in outs:
        assert o.dtype.name == dtype and o.shape == shape
    ref = _torch_adamw(*(np.asarray(a, np.float64) for a in (p, g, m, v)), torch.float64, lr,
                       wd, betas, eps, step)
    same = _torch_adamw(p, g, m, v, TORCH[dtype], lr, wd, betas, eps, step)
    for o, r, s in zip(got, ref, same):
        assert_close_dtype(o, r, s, dtype, f32_rtol=1e-6, f64_rtol=1e-14)
    low = [o.numpy().astype(np.float64) for o in fg.realize(list(outs), lower_all=True)]
    for o, w in zip(got, low):                           # the recipe is the kernel's twin
        np.testing.assert_allclose(o, w, rtol=0, atol=0 if dtype in ("float32", "float64")
                                   else 2 ** -7 * np.abs(w).max(initial=1))


def _torch_sgd(p, g, buf, tdtype, lr, momentum, dampening, wd, nesterov):
    tp = torch.nn.Parameter(torch.tensor(np.asarray(p, np.float64)).to(tdtype))
    tp.grad = torch.tensor(np.asarray(g, np.float64)).to(tdtype)
    opt = torch.optim.SGD([tp], lr=lr, momentum=momentum, dampening=dampening,
                          weight_decay=wd, nesterov=nesterov, foreach=False)
    if buf is not None:
        opt.state[tp] = {"momentum_buffer": torch.tensor(np.asarray(buf, np.float64)).to(tdtype)}
    opt.step()
    out = [tp.detach().double().numpy()]
    if momentum:
        out.append(opt.state[tp]["momentum_buffer"].double().numpy())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum,dampening,wd,nesterov,first", [
    (0.0, 0.0, 0.0, False, False), (0.0, 0.0, 0.05, False, False),
    (0.9, 0.0, 0.0, False, True), (0.9, 0.1, 0.01, False, False),
    (0.9, 0.0, 0.01, True, False), (0.5, 0.3, 0.0, False, True)])
def test_sgd_step_matches_torch(dtype, momentum, dampening, wd, nesterov, first):
    lr = 0.1
    p, g, buf, _ = _state((4, 6), 3, dtype)
    acc = np.float64 if dtype == "float64" else np.float32
    args = [fg.tensor(p), fg.tensor(g), fg.tensor(acc(lr))]
    if momentum:
        args += [fg.tensor(buf), fg.tensor(acc(1.0 if first else 0.0))]
    outs = sgd_step(*args, momentum=momentum, dampening=dampening, weight_decay=wd,
                    nesterov=nesterov)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    assert len(outs) == (2 if momentum else 1)
    got = [o.numpy().astype(np.float64) for o in fg.realize(outs)]
    init = None if (first or not momentum) else buf
    ref = _torch_sgd(*(np.asarray(a, np.float64) if a is not None else None
                       for a in (p, g, init)), torch.float64, lr, momentum, dampening, wd,
                     nesterov)
    same = _torch_sgd(p, g, init, TORCH[dtype], lr, momentum, dampening, wd, nesterov)
    for o, r, s in zip(got, ref, same):
        assert_close_dtype(o, r, s, dtype, f32_rtol=1e-6, f64_rtol=1e-14)
    low = [o.numpy().astype(np.float64) for o in fg.realize(outs, lower_all=True)]
    for o, w in zip(got, low):
        np.testing.assert_allclose(o, w, rtol=0, atol=0 if dtype in ("float32", "float64")
                                   else 2 ** -7 * np.abs(w).max(initial=1))


def test_donated_buffers_are_overwritten_in_place():
    p, g, m, v = (fg.tensor(a) for a in _state((64,), 0, "float32"))
    outs = adamw_step(p, g, m, v, *_scalars("float32", 1e-3, 0.0, (0.9, 0.999), 1))
    plan, inputs = compile_plan([o.value for o in outs], donate=[p.node, m.node, v.node])
    bufs = [np.array(fg.ir.tensor.bound_data(n)) for n in inputs]     # writable copies
    res = plan.run(bufs)
    pos = {n: k for k, n in enumerate(inputs)}
    assert res[0] is bufs[pos[p.node]] and res[1] is bufs[pos[m.node]] \
        and res[2] is bufs[pos[v.node]]
    # without handing over, the inputs are left alone
    plan2, inputs2 = compile_plan([o.value for o in outs])
    bufs2 = [np.array(fg.ir.tensor.bound_data(n)) for n in inputs2]
    before = [b.copy() for b in bufs2]
    plan2.run(bufs2)
    for a, b in zip(bufs2, before):
        np.testing.assert_array_equal(a, b)


def test_validation_errors():
    p, g, m, v = (fg.tensor(a) for a in _state((4,), 0, "float32"))
    s = _scalars("float32", 1e-3, 0.0, (0.9, 0.999), 1)
    with pytest.raises(FuelGraphError, match="adamw_step: g has shape"):
        adamw_step(p, fg.tensor(np.zeros(5, np.float32)), m, v, *s)
    with pytest.raises(FuelGraphError, match="adamw_step: m has dtype"):
        adamw_step(p, g, m.astype(fg.float64), v, *s)
    with pytest.raises(FuelGraphError, match="adamw_step: decay must be a 0-d float32"):
        adamw_step(p, g, m, v, fg.tensor(np.float64(1.0)), *s[1:])
    with pytest.raises(FuelGraphError, match="adamw_step: betas must be in"):
        adamw_step(p, g, m, v, *s, beta1=1.0)
    with pytest.raises(FuelGraphError, match="adamw_step: p has dtype int64"):
        adamw_step(*(t.astype(fg.int64) for t in (p, g, m, v)), *s)
    lr = fg.tensor(np.float32(0.1))
    with pytest.raises(FuelGraphError, match="sgd_step: expected 5 inputs"):
        fg.default_registry().entry(SGD_STEP)
        from fuelgraph.registry.core import call_fused
        call_fused(SGD_STEP, p, g, lr, momentum=0.9, dampening=0.0, weight_decay=0.0,
                   nesterov=False)
    with pytest.raises(FuelGraphError, match="sgd_step: momentum must be >= 0, and nesterov"):
        sgd_step(p, g, lr, m, lr, momentum=0.9, dampening=0.5, nesterov=True)


def test_not_differentiable():
    p = fg.tensor(np.ones(3, np.float32), requires_grad=True)
    out = sgd_step(p, fg.tensor(np.ones(3, np.float32)), fg.tensor(np.float32(0.1)))
    with pytest.raises(FuelGraphError, match="sgd_step: not differentiable"):
        out.sum().backward()


def test_entries_are_declared_with_fixed_ids():
    reg = fg.default_registry()
    assert reg.entry("adamw_step").id == ADAMW_STEP == 0x160
    assert reg.entry("sgd_step").id == SGD_STEP == 0x161
    assert reg.entry("adamw_step").destructive_inputs == (0, 2, 3)
