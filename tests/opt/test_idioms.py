"""Idioms written the way people write them fuse exactly once (`fg.explain(outs).fused_ops`) and
give the same value and gradient as torch CPU: cross-entropy with the [N, 1] gather left
unsqueezed, `nll.sum() / N`, a spelled-out log-softmax, softmax as exp(x - logsumexp(x)) and
with a detached max, Hugging Face's LlamaRMSNorm (weight multiply outside the norm), layer norm
then `* w + b`, Hugging Face's causal-LM loss (shifted logits/labels, ignore_index=-100) and
Hugging Face's rotary embedding with per-batch [B, 1, S, D] tables."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort

RNG = np.random.default_rng(0)
CE = "fused_softmax_cross_entropy"


def _a(shape, dtype=np.float64, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def fused(outs):
    """The idiom (registry) fused nodes of the optimized graph; generated glue regions (run-time
    entries of family "glue", which run the primitives left around them) are not idioms."""
    res = fg.optimize(outs if isinstance(outs, list) else [outs])
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)
            and fg.default_registry().entry(n.op.id).family != "glue"]


def close(ours, ref, tol=1e-12):
    ref = ref.detach().numpy() if isinstance(ref, torch.Tensor) else ref
    np.testing.assert_allclose(np.asarray(ours.numpy(), np.float64), ref, rtol=tol, atol=tol)


# ---- cross-entropy --------------------------------------------------------------------------
def ls_method(x):
    return x.log_softmax(-1)


def ls_spelled(x):                        # x - m - log(sum(exp(x - m)))
    m = x.max(-1, keepdim=True)
    return x - m - (x - m).exp().sum(-1, keepdim=True).log()


def ls_spelled_squeezed_max(x):
    m = x.max(-1)[:, None]
    return x - m - (x - m).exp().sum(-1, keepdim=True).log()


CE_SPELLINGS = {   # name -> (loss(log_softmax, t, n), torch reduction)
    "-(ls.gather(t[:, None])).mean()":
        (lambda ls, t, n: -(ls.gather(-1, t[:, None])).mean(), "mean"),
    "(-ls.gather(t[:, None])).mean()":
        (lambda ls, t, n: (-ls.gather(-1, t[:, None])).mean(), "mean"),
    "(-ls).gather(t[:, None]).mean()":
        (lambda ls, t, n: (-ls).gather(-1, t[:, None]).mean(), "mean"),
    "nll[N,1].sum() / N": (lambda ls, t, n: (-ls.gather(-1, t[:, None])).sum() / n, "mean"),
    "nll[N].sum() / N": (lambda ls, t, n: (-ls.gather(-1, t[:, None])[:, 0]).sum() / n, "mean"),
    "-(ls.gather(t[:, None]).sum())":
        (lambda ls, t, n: -(ls.gather(-1, t[:, None]).sum()), "sum"),
    "nll[N,1].sum()": (lambda ls, t, n: (-ls.gather(-1, t[:, None])).sum(), "sum"),
    "ls.gather(t[:, None]).mean() * -1":
        (lambda ls, t, n: ls.gather(-1, t[:, None]).mean() * -1.0, "mean"),
}


@pytest.mark.parametrize("log_softmax", [ls_method, ls_spelled, ls_spelled_squeezed_max],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("spelling", list(CE_SPELLINGS))
def test_cross_entropy_spellings(spelling, log_softmax):
    n, v = 6, 9
    x, t = _a((n, v), scale=2), RNG.integers(0, v, n)
    X = fg.tensor(x, requires_grad=True)
    build, reduction = CE_SPELLINGS[spelling]
    loss = build(log_softmax(X), fg.tensor(t), float(n))
    rep = fg.explain(loss)
    assert rep.fused_ops == {CE: 1} and rep.primitive_count == 0, str(rep)
    (node,) = fused(loss)
    assert node.op.params.reduction == reduction
    (gx,) = fg.grad(loss, [X])
    assert fg.explain(gx).fused_ops == {CE + "_backward": 1}
    assert fg.explain([loss, gx]).fused_ops == {CE + "_fwd_bwd": 1}     # one pass (issue 16)
    tx = torch.tensor(x, requires_grad=True)
    tl = TF.cross_entropy(tx, torch.tensor(t), reduction=reduction)
    tl.backward()
    close(loss, tl)
    close(gx, tx.grad)


def test_unsqueezed_gather_reports_the_rules_that_made_it_fuse():
    x, t = fg.tensor(_a((5, 7))), fg.tensor(RNG.integers(0, 7, 5))
    rep = fg.explain(-(x.log_softmax(-1).gather(-1, t[:, None])).mean())
    assert rep.fused_ops == {CE: 1}
    assert rep.rules_fired.get("reduce_size1_is_reshape", 0) >= 1, rep.rules_fired
    assert rep.rules_fired.get("neg_of_scale", 0) >= 1, rep.rules_fired
    assert "canonicalization rules fired" in str(rep) and "reduce_size1_is_reshape" in str(rep)


# ---- Hugging Face causal-LM loss --------------------------------------------------------------
def _lm_inputs(b=2, s=6, v=11, ignored=((0, 2), (1, 5), (1, 1))):
    logits = _a((b, s, v), scale=2)
    labels = RNG.integers(0, v, (b, s))
    for i, j in ignored:
        labels[i, j] = -100
    return logits, labels


def _torch_lm_loss(logits, labels, reduction="mean"):
    tl = torch.tensor(logits, requires_grad=True)
    v = logits.shape[-1]
    loss = TF.cross_entropy(tl[:, :-1].reshape(-1, v), torch.tensor(labels)[:, 1:].reshape(-1),
                            ignore_index=-100, reduction=reduction)
    loss.backward()
    return loss, tl.grad


def _shifted(logits_t, labels_t):
    v = logits_t.shape[-1]
    return logits_t[:, :-1].reshape(-1, v), labels_t[:, 1:].reshape(-1)


def _masked_nll(lg, tg):
    """F.cross_entropy-style: log_softmax, gather at masked targets, zero the ignored rows."""
    mask = tg != -100
    safe = fg.where(mask, tg, 0)
    nll = -lg.log_softmax(-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return fg.where(mask, nll, 0.0), mask


COUNTS = {   # count spelling -> the fused reduction (the division stays outside for "sum")
    "mask.sum()": (lambda mask: mask.sum(), "sum"),
    "mask.sum().maximum(1)": (lambda mask: mask.sum().maximum(1), "sum"),
    "mask.float().sum().maximum(1.0)": (lambda mask: mask.astype(fg.float64).sum().maximum(1.0),
                                        "mean"),
}


@pytest.mark.parametrize("count", list(COUNTS))
def test_hf_causal_lm_loss(count):
    logits, labels = _lm_inputs()
    L = fg.tensor(logits, requires_grad=True)
    nll, mask = _masked_nll(*_shifted(L, fg.tensor(labels)))
    count_fn, reduction = COUNTS[count]
    loss = nll.sum() / count_fn(mask)
    rep = fg.explain(loss)
    assert rep.fused_ops == {CE: 1}, str(rep)
    (node,) = fused(loss)
    assert node.op.params.reduction == reduction and node.op.params.ignore_index == -100
    assert node.srcs[1].shape == (10,)                 # the flat shifted targets, not [B, S-1]
    (gl,) = fg.grad(loss, [L])
    tl, tg = _torch_lm_loss(logits, labels)
    close(loss, tl)
    close(gl, tg)


def test_hf_causal_lm_loss_sum_reduction_and_all_rows_ignored():
    logits, labels = _lm_inputs(ignored=())
    labels[:, 1:] = -100
    L = fg.tensor(logits, requires_grad=True)
    nll, mask = _masked_nll(*_shifted(L, fg.tensor(labels)))
    total = nll.sum()
    assert fg.explain(total).fused_ops == {CE: 1}
    np.testing.assert_array_equal(total.numpy(), 0.0)
    # torch gives NaN for a mean over no rows; the spelled division keeps that
    loss = total / mask.sum()
    assert fg.explain(loss).fused_ops == {CE: 1}
    assert np.isnan(loss.numpy()) and np.isnan(_torch_lm_loss(logits, labels)[0].item())


def test_hf_causal_lm_loss_without_ignored_rows_captures_targets_past_their_reshape():
    """`labels[:, 1:].reshape(-1)` unsqueezed again for the gather: the graph holds one reshape
    [B, S-1] -> [N, 1]; the targets the op needs, [N], are recovered from it."""
    logits, labels = _lm_inputs(ignored=())
    L = fg.tensor(logits, requires_grad=True)
    lg, tg = _shifted(L, fg.tensor(labels))
    loss = -lg.log_softmax(-1).gather(-1, tg.unsqueeze(-1)).squeeze(-1).mean()
    rep = fg.explain(loss)
    assert rep.fused_ops == {CE: 1} and not rep.near_misses, str(rep)
    (node,) = fused(loss)
    assert node.srcs[1].shape == (10,) and node.op.params.ignore_index is None
    (gl,) = fg.grad(loss, [L])
    tl, tg_ = _torch_lm_loss(logits, labels)
    close(loss, tl)
    close(gl, tg_)


def test_shared_mask_copy_is_limited_to_cheap_work():
    """The valid-row mask may keep its other reader (the count); the log-probabilities may not."""
    logits, labels = _lm_inputs()
    lg, tg = _shifted(fg.tensor(logits), fg.tensor(labels))
    nll, mask = _masked_nll(lg, tg)
    assert fg.explain([nll.sum(), mask.sum()]).fused_ops == {CE: 1}
    ls = lg.log_softmax(-1)
    rep = fg.explain([nll.sum(), ls])
    assert CE not in rep.fused_ops and "another consumer" in rep.near_misses[CE]


# ---- softmax ----------------------------------------------------------------------------------
def sm_detached_max(x):
    e = (x - x.max(-1, keepdim=True).detach()).exp()
    return e / e.sum(-1, keepdim=True)


def sm_detached_squeezed_max(x):
    e = (x - x.max(-1).detach().unsqueeze(-1)).exp()
    return e / e.sum(-1, keepdim=True)


def sm_logsumexp(x):
    m = x.max(-1, keepdim=True)
    lse = m + (x - m).exp().sum(-1, keepdim=True).log()
    return (x - lse).exp()


def sm_logsumexp_squeezed(x):                 # logsumexp without keepdim, unsqueezed again
    m = x.max(-1)
    lse = m + (x - m[..., None]).exp().sum(-1).log()
    return (x - lse[..., None]).exp()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("spelling", [sm_detached_max, sm_detached_squeezed_max, sm_logsumexp,
                                      sm_logsumexp_squeezed], ids=lambda f: f.__name__)
def test_softmax_spellings(spelling, dtype):
    x, w = _a((3, 4, 7), dtype, scale=3), _a((3, 4, 7), dtype)
    X = fg.tensor(x, requires_grad=True)
    y = spelling(X)
    rep = fg.explain(y)
    assert rep.fused_ops == {"softmax_last_dim": 1} and rep.primitive_count == 0, str(rep)
    (gx,) = fg.grad((y * fg.tensor(w)).sum(), [X])
    # the backward reads the forward's output: one softmax, one backward helper
    assert fg.explain(gx).fused_ops == {"softmax_last_dim": 1, "softmax_last_dim_backward": 1}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    ty = torch.softmax(tx, -1)
    (ty * torch.tensor(w.astype(np.float64))).sum().backward()
    tol = 1e-12 if dtype == np.float64 else 2e-6
    close(y, ty, tol)
    close(gx, tx.grad, tol)


def test_detached_shift_elsewhere_does_not_fuse():
    """A stop-gradient is only seen through where the recipe allows it: a detached normaliser
    changes the gradient, so it must not fuse."""
    x = fg.tensor(_a((3, 7)))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True).detach()
    assert fg.explain(y).fused_ops == {}


# ---- norms followed by their affine weights ----------------------------------------------------
def hf_llama_rms_norm(hidden_states, weight, eps=1e-6):
    """transformers' LlamaRMSNorm.forward, line for line."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.astype(fg.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * (variance + eps).rsqrt()
    return weight * hidden_states.astype(input_dtype)


def torch_llama_rms_norm(hidden_states, weight, eps=1e-6):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _weight_multiply_outside(y, name):
    """The norm is fused once and the weight multiply reads it as a primitive (or as part of
    the generated glue region that runs the primitives after it)."""
    res = fg.optimize([y])
    glue = {int(e.id) for e in fg.default_registry() if e.family == "glue"}
    (node,) = [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)
               and int(n.op.id) not in glue]
    assert node.op.name == name
    readers = [n for n in toposort(res.outputs) if any(s.node is node for s in n.srcs)]
    assert readers and all(not isinstance(n.op, ops.Fused) or int(n.op.id) in glue
                           for n in readers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_llama_rms_norm_with_weight(dtype):
    d = 16
    tdt = getattr(torch, dtype)
    hs = torch.randn(2, 3, d, generator=torch.Generator().manual_seed(1)).to(tdt)
    wt = (1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(2))).to(tdt)
    fdt = getattr(fg, dtype)
    H = fg.tensor(hs.float().numpy()).astype(fdt)
    W = fg.tensor(wt.float().numpy()).astype(fdt)
    y = hf_llama_rms_norm(H, W)
    assert fg.explain(y).fused_ops == {"rms_norm_last_dim": 1}
    _weight_multiply_outside(y, "rms_norm_last_dim")
    want = torch_llama_rms_norm(hs, wt).float().numpy()
    got = np.asarray(y.numpy(), np.float32)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    else:   # one bfloat16 rounding of the norm, one of the product
        np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1.6e-2)


def test_hf_llama_rms_norm_gradients():
    hs, wt = _a((2, 3, 8)).astype(np.float32), (1 + 0.1 * _a(8)).astype(np.float32)
    H, W = fg.tensor(hs, requires_grad=True), fg.tensor(wt, requires_grad=True)
    g = _a((2, 3, 8)).astype(np.float32)
    y = hf_llama_rms_norm(H, W)
    gh, gw = fg.grad((y * fg.tensor(g)).sum(), [H, W])
    assert fg.explain([y, gh, gw]).fused_ops.get("rms_norm_last_dim") == 1
    assert fg.explain(gh).fused_ops.get("rms_norm_last_dim_backward") == 1
    th, tw = torch.tensor(hs, requires_grad=True), torch.tensor(wt, requires_grad=True)
    (torch_llama_rms_norm(th, tw) * torch.tensor(g)).sum().backward()
    close(y, torch_llama_rms_norm(torch.tensor(hs), torch.tensor(wt)), 2e-6)
    close(gh, th.grad, 2e-5)
    close(gw, tw.grad, 2e-5)


def ln_mul_add(x, w, b, eps=1e-5):
    xc = x - x.mean(-1, keepdim=True)
    return xc / ((xc * xc).mean(-1, keepdim=True) + eps).sqrt() * w + b


def ln_var_rsqrt_affine(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return w * ((x - mu) * (var + eps).rsqrt()) + b


@pytest.mark.parametrize("spelling", [ln_mul_add, ln_var_rsqrt_affine], ids=lambda f: f.__name__)
def test_layer_norm_then_weight_and_bias(spelling):
    x, w, b, g = _a((2, 3, 10)), 1 + 0.1 * _a(10), _a(10), _a((2, 3, 10))
    X, Wt, B = (fg.tensor(v, requires_grad=True) for v in (x, w, b))
    y = spelling(X, Wt, B)
    assert fg.explain(y).fused_ops == {"layer_norm_last_dim": 1}
    _weight_multiply_outside(y, "layer_norm_last_dim")
    gx, gw, gb = fg.grad((y * fg.tensor(g)).sum(), [X, Wt, B])
    assert fg.explain(gx).fused_ops.get("layer_norm_last_dim_backward") == 1
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    ty = TF.layer_norm(tx, (10,), tw, tb, eps=1e-5)
    (ty * torch.tensor(g)).sum().backward()
    close(y, ty, 1e-11)
    for ours, t in ((gx, tx), (gw, tw), (gb, tb)):
        close(ours, t.grad, 1e-11)


# ---- Hugging Face rotary embedding -------------------------------------------------------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return fg.cat([-x2, x1], -1)


def hf_rotary_tables(position_ids, dim, base=10000.0):
    """LlamaRotaryEmbedding.forward: per-batch tables [B, S, D] from position_ids [B, S]."""
    inv_freq = fg.tensor(1.0 / base ** (np.arange(0, dim, 2) / dim))
    freqs = position_ids.astype(fg.float64)[:, :, None] * inv_freq[None, None, :]
    emb = fg.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def torch_rotary(q, k, pos, dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = pos.double()[:, :, None] * inv_freq[None, None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (2, 1)], ids=["mha", "gqa", "mqa"])
def test_hf_rotary_with_per_batch_tables(heads):
    b, s, d = 2, 5, 8
    hq, hk = heads
    pos = np.stack([np.arange(s), np.arange(3, 3 + s)])       # a different offset per batch
    q, k = _a((b, hq, s, d)), _a((b, hk, s, d))
    Q, K = fg.tensor(q, requires_grad=True), fg.tensor(k, requires_grad=True)
    cos, sin = hf_rotary_tables(fg.tensor(pos), d)
    qe, ke = hf_apply_rotary_pos_emb(Q, K, cos, sin)
    assert fg.explain(qe).fused_ops == {"rope": 1}
    assert fg.explain([qe, ke]).fused_ops == {"rope": 2}
    for node in fused([qe, ke]):
        assert node.srcs[1].shape == (b, 1, s, d) and node.op.params.interleaved is False
    gq, gk = fg.grad((qe * qe).sum() + (ke * ke * 0.5).sum(), [Q, K])
    tq, tk = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    tqe, tke = torch_rotary(tq, tk, torch.tensor(pos), d)
    ((tqe * tqe).sum() + (tke * tke * 0.5).sum()).backward()
    close(qe, tqe)
    close(ke, tke)
    close(gq, tq.grad)
    close(gk, tk.grad)


def test_hf_rotary_table_gradients():
    """Gradients of per-batch tables that are inputs: summed over the heads only."""
    b, h, s, d = 2, 3, 4, 6
    q, c, sn, g = _a((b, h, s, d)), _a((b, s, d)), _a((b, s, d)), _a((b, h, s, d))
    Q, C, S = (fg.tensor(v, requires_grad=True) for v in (q, c, sn))
    (y, _) = hf_apply_rotary_pos_emb(Q, Q, C, S)
    assert fg.explain(y).fused_ops == {"rope": 1}
    gq, gc, gs = fg.grad((y * fg.tensor(g)).sum(), [Q, C, S])
    tq, tc, ts = (torch.tensor(v, requires_grad=True) for v in (q, c, sn))
    h2 = d // 2
    rot = torch.cat([-tq[..., h2:], tq[..., :h2]], -1)
    ty = tq * tc.unsqueeze(1) + rot * ts.unsqueeze(1)
    (ty * torch.tensor(g)).sum().backward()
    close(y, ty)
    for ours, t in ((gq, tq), (gc, tc), (gs, ts)):
        close(ours, t.grad)
