"""In-place overwrites proved safe when a plan is built (no per-run counting of live buffers)
and the per-run check of what such a proof relies on: input buffers that do not alias."""
import numpy as np

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.ir.tensor import bound_data
from fuelgraph.runtime.executor import compile_plan

NB, BS, H, D = 5, 4, 2, 8


def _case(seed=0):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((NB, BS, H, D)).astype(np.float32)
    other = rng.standard_normal((NB, BS, H, D)).astype(np.float32)
    rows = rng.standard_normal((3, H, D)).astype(np.float32)
    slots = np.array([17, 2, 8], np.int32)
    return pool, other, rows, slots


def _written(pool, rows, slots):
    out = pool.copy().reshape(NB * BS, H, D)
    out[slots.astype(np.int64)] = rows
    return out.reshape(pool.shape)


def _plan(other_read_after_write: bool):
    """A donated pool written in place (as a traced decode step does), and a second input read
    after the write (or not read at all)."""
    pool, other, rows, slots = _case()
    p, q = fg.tensor(pool), fg.tensor(other)
    out = F.paged_cache_write(p, fg.tensor(rows), fg.tensor(slots))
    outs = [out]
    if other_read_after_write:
        outs.append(q + out[0, 0, 0, 0])
    plan, ins = compile_plan([o.value for o in outs], donate=[p.value.node])
    return plan, ins, p, q


def _stats(plan):
    return plan.stats.get("inplace_reused", 0), plan.stats.get("inplace_copies", 0)


def test_pool_write_is_proved_safe_when_planned():
    plan, ins, p, q = _plan(True)
    prog = plan._program()
    assert not prog.dynamic and prog.alias_targets
    pool, other, rows, slots = _case()
    bufs = [bound_data(n).copy() for n in ins]
    kept = [b for b, n in zip(bufs, ins) if n is p.value.node][0]
    r0, c0 = _stats(plan)
    got = plan.run(bufs)
    assert _stats(plan) == (r0 + 1, c0)
    want = _written(pool, rows, slots)
    np.testing.assert_array_equal(got[0], want)
    assert np.shares_memory(got[0], kept)                  # written where it was
    np.testing.assert_array_equal(got[1], other + want[0, 0, 0, 0])


def test_aliasing_inputs_make_the_run_copy():
    """The pool's buffer passed again as the other input (which is read after the write): the
    run notices the aliasing and copies instead of changing what the other input reads."""
    plan, ins, p, q = _plan(True)
    pool, other, rows, slots = _case()
    shared = pool.copy()
    bufs = [shared if n in (p.value.node, q.value.node) else bound_data(n) for n in ins]
    r0, c0 = _stats(plan)
    got = plan.run(bufs)
    assert _stats(plan) == (r0, c0 + 1)
    want = _written(pool, rows, slots)
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], pool + want[0, 0, 0, 0])
    np.testing.assert_array_equal(shared, pool)            # neither input was written


def test_read_only_pool_is_copied():
    plan, ins, p, q = _plan(False)
    pool, other, rows, slots = _case()
    ro = pool.copy()
    ro.flags.writeable = False
    bufs = [ro if n is p.value.node else bound_data(n) for n in ins]
    r0, c0 = _stats(plan)
    got = plan.run(bufs)
    assert _stats(plan) == (r0, c0 + 1)
    np.testing.assert_array_equal(got[0], _written(pool, rows, slots))
    np.testing.assert_array_equal(ro, pool)


def test_llama_decode_step_needs_no_counting():
    """The traced decode step of the Llama writes its KV pools in place with the decision
    made when the plan was built."""
    from fuelgraph.models.llama import LlamaConfig, LlamaForCausalLM
    fg.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    model.generate(ids, max_new_tokens=3)
    dec = next(iter(model._decoders.values()))
    plan = next(iter(dec.step.cache.values()))[0].plan
    prog = plan._program()
    pools = 2 * cfg.num_hidden_layers                      # a k and a v pool per layer
    assert not prog.dynamic and len(prog.alias_targets) == pools
    r0, c0 = _stats(plan)
    model.generate(ids, max_new_tokens=3)                  # two decode steps
    r1, c1 = _stats(plan)
    assert c1 == c0 and r1 - r0 == 2 * pools
