"""Every registered fused op decomposes totally (DESIGN §1.3, Appendix H.1): for EVERY entry of
fg.default_registry() (iterated, so entries added later are covered), built on its own
`entry.sample(rng)` inputs (float inputs cast to float64) and for each of its param settings,
the kernel run (lower_all=False) and the recipe run (lower_all=True) agree tightly, and the
lowered optimized graph holds no fused node at all."""
import dataclasses

import numpy as np
import pytest

import fuelgraph as fg
from fuelgraph import FuelGraphError
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort
from fuelgraph.registry.core import call_fused

ENTRIES = list(fg.default_registry())


def _fallback(field, i):
    """A value for a param that has no default and no pattern variant."""
    t = str(field.type)
    if "bool" in t:
        return False
    if "int" in t:
        return 3
    if "float" in t:
        return 0.25 + 0.5 * i
    pytest.fail(f"param {field.name}: {t} has no default and no pattern variant; give it one")


def param_sets(entry) -> list[dict]:
    """The dataclass defaults, then each pattern variant over them; params with neither get a
    fallback value by type."""
    fields = dataclasses.fields(entry.params)
    sets = []
    for over in [{}] + [dict(v) for v in (entry.pattern_variants or ())]:
        p = {}
        for i, f in enumerate(fields):
            if f.name in over:
                p[f.name] = over[f.name]
            elif f.default is not dataclasses.MISSING:
                p[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                p[f.name] = f.default_factory()
            else:
                p[f.name] = _fallback(f, i)
        if p not in sets:
            sets.append(p)
    return sets


def _no_fused(vals):
    for n in toposort(vals):
        assert not isinstance(n.op, ops.Fused), f"lowered graph still holds {n.op!r}"
        if isinstance(n.op, ops.Scan):
            _no_fused(list(n.op.body.outputs))


def _run(outs, lower_all):
    try:
        return fg.realize(outs, lower_all=lower_all), None
    except FuelGraphError as e:
        return None, e


def _build(entry, arrays, params, f64):
    xs = [fg.tensor(a.astype(np.float64) if f64 and a.dtype.kind == "f" else a) for a in arrays]
    out = call_fused(entry.id, *xs, **params)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_decomposition_matches_kernel(entry):
    arrays = [np.asarray(a) for a in entry.sample(np.random.default_rng(int(entry.id)))]
    ran = 0
    for params in param_sets(entry):
        try:
            outs, f64 = _build(entry, arrays, params, True), True
        except FuelGraphError:          # an input whose dtype the format fixes (not float64)
            outs, f64 = _build(entry, arrays, params, False), False
        rep = fg.explain(outs, lower_all=True)
        assert rep.fused_ops == {}, (params, rep.fused_ops)
        _no_fused(fg.optimize(outs, lower_all=True).outputs)
        kern, kerr = _run(outs, False)
        reci, rerr = _run(outs, True)
        # both run, or both reject the data (e.g. a sample target that a param setting ignores)
        assert (kerr is None) == (rerr is None), (params, kerr, rerr)
        if kern is None:
            continue
        ran += 1
        for o, k, r in zip(outs, kern, reci):
            assert k.shape == r.shape == o.shape and k.dtype == r.dtype, params
            k64, r64 = np.asarray(k, np.float64), np.asarray(r, np.float64)
            assert np.array_equal(np.isnan(k64), np.isnan(r64)), params
            scale = max(np.abs(np.nan_to_num(r64)).max(initial=0.0), 1.0)
            tol = 1e-9 if f64 or o.dtype == fg.float64 else \
                {"float32": 1e-5}.get(o.dtype.name, 2e-2)
            np.testing.assert_allclose(np.nan_to_num(k64), np.nan_to_num(r64), rtol=tol,
                                       atol=tol * scale, err_msg=f"{entry.name} {params}")
    assert ran, f"{entry.name}: no param setting ran on its sample"


LOW = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 1.5e-2}


@pytest.mark.parametrize("dtype", list(LOW))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_decomposition_matches_kernel_in_low_precision(entry, dtype):
    """The same in 32/16-bit floats, on inputs scaled by 100 (16-bit recipes must accumulate
    in float32 like the kernels: a float16 row sum of squares overflows otherwise)."""
    arrays = [np.asarray(a) for a in entry.sample(np.random.default_rng(int(entry.id)))]
    arrays = [(a * 100).astype(fg.tensor(np.zeros(1, np.float32), dtype=dtype).dtype.np)
              if a.dtype.kind == "f" else a for a in arrays]
    params = param_sets(entry)[0]
    try:
        outs = _build(entry, arrays, params, False)
    except FuelGraphError:
        return  # a format that fixes its dtypes rejects this one at build time, as it must
    kern, kerr = _run(outs, False)
    reci, rerr = _run(outs, True)
    assert (kerr is None) == (rerr is None), (kerr, rerr)
    if kern is None:
        return
    for k, r in zip(kern, reci):
        k64, r64 = np.asarray(k, np.float64), np.asarray(r, np.float64)
        assert np.array_equal(np.isfinite(k64), np.isfinite(r64)), (entry.name, dtype)
        scale = max(np.abs(r64[np.isfinite(r64)]).max(initial=0.0), 1.0)
        ok = np.isfinite(r64)
        np.testing.assert_allclose(k64[ok], r64[ok], rtol=LOW[dtype], atol=LOW[dtype] * scale,
                                   err_msg=f"{entry.name} {dtype}")
