"""Collectives on two GPUs (backends/cuda/kernels/collective.py, NCCL): the same multi-process
scenarios as the gloo tests, one GPU per process (cuda:LOCAL_RANK, NCCL_NVLS_ENABLE=0), against
the same references: every op's value and gradient in four dtypes, the kernels called directly
(in-place reduction, out=, gathers and scatters along an axis), data parallel against one
process on the whole batch, tensor parallel against the single-device model. Skips cleanly
without two GPUs."""
from __future__ import annotations

import numpy as np
import pytest

try:
    import torch
    TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and \
        torch.distributed.is_available() and torch.distributed.is_nccl_available()
except ImportError:
    TWO_GPUS = False

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs and NCCL")]

from tests.distributed import scenarios as S  # noqa: E402
from tests.distributed.harness import results  # noqa: E402


def _res(name):
    return results(name, device="cuda")


@pytest.mark.parametrize("dtype", S.DTYPES)
@pytest.mark.parametrize("case,kw,shape", S.COLLECTIVE_CASES,
                         ids=[c[0] for c in S.COLLECTIVE_CASES])
def test_value_and_gradient_on_two_gpus(case, kw, shape, dtype):
    from tests.distributed.references import check_collective_case
    check_collective_case(_res("collectives"), case, kw, shape, dtype)


def test_chain_recipe_refusal_and_mismatch_on_two_gpus():
    from tests.distributed.references import check_chain
    res = _res("collectives")
    check_chain(res)
    for r in res:
        np.testing.assert_array_equal(r["int_sum"], np.arange(6) * 3)
        assert "no composition of primitives" in r["lower_all"]
        assert "every process must build the same graph" in r["mismatch"]


@pytest.mark.parametrize("dtype", S.DTYPES)
def test_cuda_kernels_on_two_gpus(dtype):
    res = _res("cuda_kernels")
    xs = [np.asarray(S.rank_input(r, (5, 4), dtype, 4), np.float64) for r in range(2)]
    total = xs[0] + xs[1]
    rnd = lambda v: np.asarray(np.asarray(v).astype(S.np_dtype(dtype)), np.float64)  # noqa: E731
    for r in range(2):
        y, y_avg, gathered, scattered, shard, wrote_out, kept = res[r][dtype]
        np.testing.assert_array_equal(y, rnd(total))
        np.testing.assert_allclose(y_avg, rnd(total / 2), rtol=1e-2 if dtype != "float64" else 0)
        np.testing.assert_array_equal(gathered, np.concatenate(xs, 1))
        np.testing.assert_array_equal(scattered, rnd(total.reshape(10, 2)[5 * r:5 * r + 5]))
        np.testing.assert_array_equal(shard, xs[r][:, 2 * r:2 * r + 2])
        assert wrote_out and kept


def test_data_parallel_on_two_gpus():
    ref = S.reference_data_parallel()
    a, b = _res("data_parallel")
    for r in (a, b):
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-4)
    for k, want in ref["params"].items():
        np.testing.assert_array_equal(a["params"][k], b["params"][k])
        np.testing.assert_allclose(a["params"][k], want, rtol=1e-3, atol=1e-4)
    s = _res("schedule")
    assert s[0]["names"] == s[1]["names"] and s[0]["first_coll"] < s[0]["last_matmul"]


def test_tensor_parallel_on_two_gpus():
    for rank, r in enumerate(_res("tensor_parallel")):
        np.testing.assert_allclose(r["logits"], r["logits_full"], rtol=1e-4, atol=1e-4)
        for tp_loss, full_loss in r["losses"]:
            np.testing.assert_allclose(tp_loss, full_loss, rtol=1e-4)
        for k, v in r["tp_params"].items():
            owner, _, local = k.rpartition(".")
            axis = r["shard_axes"][owner].get(local)
            want = r["full_params"][k] if axis is None else \
                np.split(r["full_params"][k], 2, axis)[rank]
            np.testing.assert_allclose(v, want, rtol=1e-3, atol=1e-4, err_msg=k)


def test_llama_tensor_parallel_on_two_gpus():
    for rank, r in enumerate(_res("tensor_parallel_llama")):
        np.testing.assert_allclose(r["logits"], r["logits_full"], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(*r["losses"], rtol=1e-4)
