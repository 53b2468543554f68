"""The registry contract, walked over every entry (entries added later are covered): each op is
declared in a family module of `fuelgraph.registry`, has a kernel on every backend or declares
itself recipe-only there, and has its family's test file and benchmark (op, test and benchmark
mirrored by name)."""
from pathlib import Path

import pytest

import fuelgraph as fg
from fuelgraph.backends.cuda import declared_fused_ids
from fuelgraph.opt.passes import has_kernel

ROOT = Path(__file__).resolve().parents[2]
BUILT_IN = [e for e in fg.default_registry() if not e.id.is_runtime()]


def family_of(entry) -> str:
    mod = entry.decompose.__module__
    assert mod.startswith("fuelgraph.registry."), f"{entry.name} is declared outside the registry"
    return mod.rsplit(".", 1)[1]


@pytest.mark.parametrize("entry", BUILT_IN, ids=lambda e: e.name)
def test_every_entry_has_kernels_or_says_recipe_only(entry):
    assert has_kernel(entry.id, "numpy") or "numpy" in entry.recipe_only, entry.name
    assert int(entry.id) in declared_fused_ids() or "cuda" in entry.recipe_only, entry.name


@pytest.mark.parametrize("entry", BUILT_IN, ids=lambda e: e.name)
def test_every_family_has_its_tests_and_benchmark(entry):
    fam = family_of(entry)
    assert (ROOT / "tests" / "registry" / f"test_{fam}.py").exists(), fam
    assert (ROOT / "bench" / f"bench_{fam}.py").exists(), fam


@pytest.mark.parametrize("entry", BUILT_IN, ids=lambda e: e.name)
def test_every_entry_documents_itself(entry):
    assert entry.doc and len(entry.doc) > 40, entry.name
    assert entry.sample is not None and entry.sample(__import__("numpy").random.default_rng(0))


def test_ids_are_fixed_and_unique():
    ids = [int(e.id) for e in BUILT_IN]
    assert len(set(ids)) == len(ids)
    assert all(1 <= i <= 25 or 0x100 <= i < 0x8000 for i in ids)
    assert {n: int(v) for n, v in fg.FusedOps.well_known().items()}["AWQ_MATMUL"] == 25
