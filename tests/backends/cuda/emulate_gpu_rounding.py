"""pytest plugin: run a CUDA test module's GPU-sized cases in Triton's CPU interpreter with the
GPU's 16-bit rounding, to reproduce accuracy failures without a GPU.

The interpreter multiplies bfloat16 dot operands as float32 (kernels hand it float32 there)
and narrows float32 -> bfloat16 by truncation; the GPU's tensor cores take bfloat16 operands
and its conversions round to nearest even. This plugin rounds float32 dot operands to
bfloat16 (nearest even) in tests whose id names bfloat16, makes every float32 -> bfloat16
cast round to nearest even, and sets the module's HAS_CUDA so the tests take their GPU
shapes and the 16-bit accuracy rule. float16 needs nothing: the interpreter already rounds it
as the GPU does. Slow (tens of seconds a case); e.g.

    SSD_GPU_CONFIG=1 TRITON_INTERPRET=1 PYTHONPATH=src:tests/backends/cuda \\
        python3 -m pytest -p emulate_gpu_rounding tests/backends/cuda/test_ssm.py -k ssd
"""
import numpy as np

ROUND_DOTS = [False]


def _rne_bf16(a):
    """float32 array rounded to bfloat16 values (nearest even), still float32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)


def _install():
    import triton.language as tl
    from triton.runtime import interpreter as itp
    builder = itp.InterpreterBuilder
    if getattr(builder.create_dot, "_gpu_rounding", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if ROUND_DOTS[0] and a.data.dtype == np.float32:
            a = itp.TensorHandle(_rne_bf16(a.data), a.dtype.scalar)
            b = itp.TensorHandle(_rne_bf16(b.data), b.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = (_rne_bf16(src.data).view(np.uint32) >> 16).astype(np.uint16)
            return itp.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)
    create_dot._gpu_rounding = True
    builder.create_dot, builder.cast_impl = create_dot, cast_impl


def pytest_configure(config):
    _install()


def pytest_runtest_setup(item):
    if hasattr(item.module, "HAS_CUDA"):
        item.module.HAS_CUDA = True
    ROUND_DOTS[0] = "bfloat16" in item.name
