"""Hand-written RMS norm, layer norm and RoPE idioms fuse into RMS_NORM_LAST_DIM, LAYER_NORM_LAST_DIM
and ROPE exactly once each, with eps / layout recovered from the graph, and keep their values
(vs the lowered graph and vs torch). Numerically different spellings (unbiased variance,
E[x^2] - mu^2) must not fuse, and explain names the constraint that failed."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort


def fused_nodes(outs):
    res = fg.optimize(outs if isinstance(outs, list) else [outs])
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]


def check_values(y, want, rtol=1e-6, atol=1e-6):
    got = y.numpy()
    np.testing.assert_allclose(got, fg.realize([y], lower_all=True)[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def rand(shape, seed=0, dtype=np.float32):
    return (np.random.default_rng(seed).standard_normal(shape) + 0.25).astype(dtype)


# ---- RMS norm -----------------------------------------------------------------------------
def rms_div_sqrt(x, eps):
    return x / (x * x).mean(-1, keepdim=True).add(eps).sqrt()


def rms_mul_rsqrt(x, eps):
    return x * (x ** 2).mean(-1, keepdim=True).__add__(eps).rsqrt()


def rms_llama(x, eps):  # HF LlamaRMSNorm body: pow(2), mean, + eps, rsqrt, multiply
    return x * fg.Tensor.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("spelling", [rms_div_sqrt, rms_mul_rsqrt, rms_llama])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.1])
@pytest.mark.parametrize("shape", [(9,), (4, 16), (2, 3, 33)])
def test_rms_norm_idioms_fuse_once(spelling, eps, shape):
    a = rand(shape)
    y = spelling(fg.tensor(a), eps)
    assert fg.explain(y).fused_ops == {"rms_norm_last_dim": 1}
    (node,) = fused_nodes(y)
    assert node.op.params.eps == eps
    check_values(y, TF.rms_norm(torch.tensor(a), (shape[-1],), eps=eps).numpy())


def test_rms_norm_idiom_fuses_in_every_float_dtype():
    for dt in (fg.float64, fg.bfloat16, fg.float16):
        y = rms_mul_rsqrt(fg.tensor(rand((3, 8)).astype(dt.np)), 1e-6)
        assert fg.explain(y).fused_ops == {"rms_norm_last_dim": 1}
        assert y.dtype == dt


def test_hf_llama_rms_norm_with_upcast_fuses():
    """HF LlamaRMSNorm: upcast to float32, pow(2).mean, rsqrt, multiply, cast back."""
    a = rand((3, 16)).astype(fg.bfloat16.np)
    x = fg.tensor(a)
    h = x.astype(fg.float32)
    y = (h * (h.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()).astype(fg.bfloat16)
    assert fg.explain(y).fused_ops == {"rms_norm_last_dim": 1}
    (node,) = fused_nodes(y)
    assert node.op.params.eps == 1e-6 and node.srcs[0].dtype == fg.float32
    t = torch.tensor(a.astype(np.float32))
    want = TF.rms_norm(t, (16,), eps=1e-6).to(torch.bfloat16).float().numpy()
    np.testing.assert_allclose(y.numpy().astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_rms_norm_idiom_gradient_uses_the_helper():
    a = rand((3, 8), dtype=np.float64)
    x = fg.tensor(a, requires_grad=True)
    w = np.random.default_rng(1).standard_normal((3, 8))
    y = rms_div_sqrt(x, 1e-6)
    (y * fg.tensor(w)).sum().backward()
    assert fg.explain(x.grad).fused_ops.get("rms_norm_last_dim_backward") == 1
    t = torch.tensor(a, requires_grad=True)
    ty = TF.rms_norm(t, (8,), eps=1e-6)
    (ty * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_rms_norm_not_fused_when_an_intermediate_is_shared():
    x = fg.tensor(rand((4, 8)))
    r = (x * x).mean(-1, keepdim=True).add(1e-6).rsqrt()
    y = x * r
    rep = fg.explain([y, r])
    assert "rms_norm_last_dim" not in rep.fused_ops
    assert "another consumer" in rep.near_misses["rms_norm_last_dim"]
    np.testing.assert_allclose(y.numpy(), TF.rms_norm(torch.tensor(x.numpy()), (8,), eps=1e-6).numpy(),
                               rtol=1e-6, atol=1e-6)


def test_rms_norm_over_another_axis_does_not_fuse():
    x = fg.tensor(rand((8, 4)))
    y = x / ((x * x).mean(0, keepdim=True) + 1e-6).sqrt()
    rep = fg.explain(y)
    assert "rms_norm_last_dim" not in rep.fused_ops
    assert "axes=(0,)" in rep.near_misses["rms_norm_last_dim"]


# ---- layer norm ---------------------------------------------------------------------------
def ln_idiom(x, eps):
    xc = x - x.mean(-1, keepdim=True)
    return xc / ((xc * xc).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("shape", [(12,), (5, 16), (2, 3, 31)])
def test_layer_norm_idiom_fuses_once(eps, shape):
    a = rand(shape, seed=1) * 3
    y = ln_idiom(fg.tensor(a), eps)
    assert fg.explain(y).fused_ops == {"layer_norm_last_dim": 1}
    (node,) = fused_nodes(y)
    assert node.op.params.eps == eps
    check_values(y, TF.layer_norm(torch.tensor(a), (shape[-1],), eps=eps).numpy(), atol=3e-6)


def test_layer_norm_rsqrt_spelling_fuses():
    a = rand((4, 10), seed=2)
    x = fg.tensor(a)
    xc = x - x.mean(-1, keepdim=True)
    y = xc * ((xc ** 2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    assert fg.explain(y).fused_ops == {"layer_norm_last_dim": 1}
    check_values(y, TF.layer_norm(torch.tensor(a), (10,), eps=1e-5).numpy())


NORMS = ("layer_norm_last_dim", "rms_norm_last_dim")


def _no_norm_fused(rep):
    return not any(k in rep.fused_ops for k in NORMS)


def test_unbiased_variance_does_not_fuse():
    a = rand((4, 16), seed=3)
    x = fg.tensor(a)
    xc = x - x.mean(-1, keepdim=True)
    y = xc / ((xc * xc).sum(-1, keepdim=True) / 15.0 + 1e-5).sqrt()
    rep = fg.explain(y)
    assert _no_norm_fused(rep)
    why = rep.near_misses["layer_norm_last_dim"]
    assert "0.0625" in why and "0.0666" in why           # 1/n expected, 1/(n-1) found
    t = torch.tensor(a)
    want = (t - t.mean(-1, keepdim=True)) / (t.var(-1, keepdim=True, unbiased=True) + 1e-5).sqrt()
    np.testing.assert_allclose(y.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_tensor_var_spelling_does_not_fuse():
    x = fg.tensor(rand((4, 16), seed=4))
    y = (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + 1e-5).sqrt()
    rep = fg.explain(y)
    assert _no_norm_fused(rep)
    assert "layer_norm_last_dim" in rep.near_misses


def test_e_x2_minus_mu2_variance_does_not_fuse():
    a = rand((4, 16), seed=5)
    x = fg.tensor(a)
    mu = x.mean(-1, keepdim=True)
    y = (x - mu) / ((x * x).mean(-1, keepdim=True) - mu * mu + 1e-5).sqrt()
    rep = fg.explain(y)
    assert _no_norm_fused(rep)
    assert "expected mul" in rep.near_misses["layer_norm_last_dim"]
    assert "found sub" in rep.near_misses["layer_norm_last_dim"]
    np.testing.assert_allclose(y.numpy(), TF.layer_norm(torch.tensor(a), (16,), eps=1e-5).numpy(),
                               rtol=1e-4, atol=1e-4)


# ---- RoPE ---------------------------------------------------------------------------------
def rotate_half(x):
    d = x.shape[-1]
    return fg.cat([-x[..., d // 2:], x[..., :d // 2]], -1)


def rotate_every_two(x):
    return fg.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def torch_rope(x, cos, sin, interleaved=False):
    if interleaved:
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * cos + rot * sin


def half_tables(s, d):
    inv = 10000.0 ** (-np.arange(0, d, 2) / d)
    ang = np.arange(s)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("built", ["cat", "direct"])
@pytest.mark.parametrize("shape", [(2, 4, 6, 16), (7, 8), (3, 5, 2)])
def test_hf_rope_q_and_k_fuse(built, shape):
    s, d = shape[-2:]
    c, sn = half_tables(s, d)
    if built == "cat":
        ct, st = fg.tensor(c), fg.tensor(sn)
        cos, sin = fg.cat([ct, ct], -1), fg.cat([st, st], -1)
    else:
        cos, sin = fg.tensor(np.concatenate([c, c], -1)), fg.tensor(np.concatenate([sn, sn], -1))
    qa, ka = rand(shape, 6), rand(shape, 7)
    q, k = fg.tensor(qa), fg.tensor(ka)
    q_embed = q * cos + rotate_half(q) * sin
    k_embed = (k * cos) + (rotate_half(k) * sin)
    assert fg.explain(q_embed).fused_ops == {"rope": 1}
    assert fg.explain([q_embed, k_embed]).fused_ops == {"rope": 2}
    assert {n.op.params.interleaved for n in fused_nodes([q_embed, k_embed])} == {False}
    tc = torch.tensor(np.concatenate([c, c], -1))
    ts = torch.tensor(np.concatenate([sn, sn], -1))
    check_values(q_embed, torch_rope(torch.tensor(qa), tc, ts).numpy())
    check_values(k_embed, torch_rope(torch.tensor(ka), tc, ts).numpy())


def test_hf_rope_operand_orders():
    s, d = 4, 8
    c, sn = half_tables(s, d)
    cos, sin = fg.tensor(np.concatenate([c, c], -1)), fg.tensor(np.concatenate([sn, sn], -1))
    q = fg.tensor(rand((2, s, d), 8))
    y = sin * rotate_half(q) + cos * q
    assert fg.explain(y).fused_ops == {"rope": 1}
    check_values(y, torch_rope(torch.tensor(q.numpy()), torch.tensor(cos.numpy()),
                               torch.tensor(sin.numpy())).numpy())


def test_gptj_rope_fuses_interleaved():
    s, d = 5, 8
    ang = np.random.default_rng(9).standard_normal((s, d // 2))
    cos = fg.tensor(np.repeat(np.cos(ang), 2, axis=1).astype(np.float32))
    sin = fg.tensor(np.repeat(np.sin(ang), 2, axis=1).astype(np.float32))
    qa = rand((2, 3, s, d), 10)
    q = fg.tensor(qa)
    y = q * cos + rotate_every_two(q) * sin
    assert fg.explain(y).fused_ops == {"rope": 1}
    (node,) = fused_nodes(y)
    assert node.op.params.interleaved is True
    check_values(y, torch_rope(torch.tensor(qa), torch.tensor(cos.numpy()), torch.tensor(sin.numpy()),
                               interleaved=True).numpy())


def test_rope_with_leading_one_tables_fuses_and_half_tables_do_not():
    """cos/sin [1, S, D] broadcast to x and are the op's inputs; [S, 1] tables broadcast too
    but are not [..., S, D] tables: no fusion, the near miss says why, values stay right."""
    s, d = 4, 8
    c, sn = half_tables(s, d)
    cos = fg.tensor(np.concatenate([c, c], -1)[None])
    sin = fg.tensor(np.concatenate([sn, sn], -1)[None])
    q = fg.tensor(rand((2, s, d), 11))
    y = q * cos + rotate_half(q) * sin
    assert fg.explain(y).fused_ops == {"rope": 1}
    check_values(y, torch_rope(torch.tensor(q.numpy()), torch.tensor(cos.numpy()),
                               torch.tensor(sin.numpy())).numpy())
    cos1, sin1 = fg.tensor(c[:, :1]), fg.tensor(sn[:, :1])
    z = q * cos1 + rotate_half(q) * sin1
    rep = fg.explain(z)
    assert "rope" not in rep.fused_ops
    assert "ending in exactly [S, D]" in rep.near_misses["rope"]
    np.testing.assert_allclose(z.numpy(), torch_rope(torch.tensor(q.numpy()), torch.tensor(c[:, :1]),
                                                     torch.tensor(sn[:, :1])).numpy(), rtol=1e-6)


def test_wrong_rotation_does_not_fuse():
    s, d = 4, 8
    c, sn = half_tables(s, d)
    cos, sin = fg.tensor(np.concatenate([c, c], -1)), fg.tensor(np.concatenate([sn, sn], -1))
    q = fg.tensor(rand((2, s, d), 12))
    y = q * cos + fg.cat([-q[..., 3:], q[..., :3]], -1) * sin     # rotates by 3, not D/2
    rep = fg.explain(y)
    assert "rope" not in rep.fused_ops and "rope" in rep.near_misses


def test_rope_idiom_gradients_match_torch():
    s, d = 3, 6
    rng = np.random.default_rng(13)
    qa, ca, sa = rng.standard_normal((2, s, d)), rng.standard_normal((s, d)), rng.standard_normal((s, d))
    q, cos, sin = fg.tensor(qa), fg.tensor(ca), fg.tensor(sa)
    y = q * cos + rotate_half(q) * sin
    gq, gc, gs = fg.grad((y * y).sum(), [q, cos, sin])
    tq, tc, ts = (torch.tensor(v, requires_grad=True) for v in (qa, ca, sa))
    ty = torch_rope(tq, tc, ts)
    (ty * ty).sum().backward()
    for ours, t in ((gq, tq), (gc, tc), (gs, ts)):
        np.testing.assert_allclose(ours.numpy(), t.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_block_fuses_norm_and_rope():
    """A pre-norm attention input: RMS norm idiom, then RoPE of the projected q and k."""
    b, s, h, dh = 2, 5, 2, 8
    rng = np.random.default_rng(14)
    xa = rng.standard_normal((b, s, h * dh)).astype(np.float32)
    wq, wk = (rng.standard_normal((h * dh, h * dh)).astype(np.float32) * 0.2 for _ in range(2))
    c, sn = half_tables(s, dh)
    x = fg.tensor(xa)
    cos, sin = fg.cat([fg.tensor(c)] * 2, -1), fg.cat([fg.tensor(sn)] * 2, -1)
    xn = rms_mul_rsqrt(x, 1e-6)
    q = (xn @ fg.tensor(wq)).reshape(b, s, h, dh).transpose(1, 2)
    k = (xn @ fg.tensor(wk)).reshape(b, s, h, dh).transpose(1, 2)
    qe = q * cos + rotate_half(q) * sin
    ke = k * cos + rotate_half(k) * sin
    rep = fg.explain([qe, ke])
    assert rep.fused_ops == {"rms_norm_last_dim": 1, "rope": 2}
    tx = TF.rms_norm(torch.tensor(xa), (h * dh,), eps=1e-6)
    tq = (tx @ torch.tensor(wq)).reshape(b, s, h, dh).transpose(1, 2)
    tcos, tsin = torch.tensor(np.concatenate([c, c], -1)), torch.tensor(np.concatenate([sn, sn], -1))
    np.testing.assert_allclose(qe.numpy(), torch_rope(tq, tcos, tsin).numpy(), rtol=1e-5, atol=1e-5)


def test_norms_fuse_from_squeezed_means_unsqueezed_again():
    a = rand((3, 16))
    x = fg.tensor(a)
    y = x / ((x * x).mean(-1)[..., None] + 1e-6).sqrt()
    xc = x - x.mean(-1).unsqueeze(-1)
    z = xc / ((xc * xc).mean(-1).unsqueeze(-1) + 1e-5).sqrt()
    assert fg.explain([y]).fused_ops == {"rms_norm_last_dim": 1}
    assert fg.explain([z]).fused_ops == {"layer_norm_last_dim": 1}
    t = torch.tensor(a)
    np.testing.assert_allclose(y.numpy(), TF.rms_norm(t, (16,), eps=1e-6).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z.numpy(), TF.layer_norm(t, (16,), eps=1e-5).numpy(), rtol=1e-5, atol=1e-6)
