"""Shared oracle checks for the op tests (DESIGN §10 tolerances)."""
import numpy as np


def assert_flash_rule(ours, ref64, same_dtype_ref, slack=1e-6):
    """16-bit rule (FlashAttention's): our error vs the float64 reference is at most twice the
    error of the reference op run in the same dtype, plus `slack` times the largest magnitude."""
    ours = np.asarray(ours, np.float64)
    ref64 = np.asarray(ref64, np.float64)
    assert ours.shape == ref64.shape, (ours.shape, ref64.shape)
    assert np.isfinite(ours).all() or not np.isfinite(ref64).all(), "non-finite output"
    err = np.abs(ours - ref64).max(initial=0.0)
    terr = np.abs(np.asarray(same_dtype_ref, np.float64) - ref64).max(initial=0.0)
    assert err <= 2 * terr + slack * max(np.abs(ref64).max(initial=0.0), 1.0), (err, terr)


def assert_close_dtype(ours, ref64, same_dtype_ref, dtype, f32_rtol=1e-5, f64_rtol=1e-12,
                       slack=1e-6):
    """float64 and float32 relative to the largest magnitude of the reference; 16-bit dtypes by
    `assert_flash_rule`."""
    ours = np.asarray(ours, np.float64)
    ref64 = np.asarray(ref64, np.float64)
    assert ours.shape == ref64.shape, (ours.shape, ref64.shape)
    scale = max(np.abs(ref64).max(initial=0.0), 1.0)
    err = np.abs(ours - ref64).max(initial=0.0)
    if dtype == "float64":
        assert err <= f64_rtol * scale, err
    elif dtype == "float32":
        assert err <= f32_rtol * scale, err
    else:
        assert_flash_rule(ours, ref64, same_dtype_ref, slack)
