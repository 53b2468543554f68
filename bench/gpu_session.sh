#!/usr/bin/env bash
# One batched session on a lent GPU machine (no internet there): install the carried anchor
# wheels, then run the named stages, writing logs and bench records under $OUT (packed into
# one archive, since only a few files come back). Anchors live in the git-ignored ./anchors/
# (bitsandbytes, liger-kernel, einops, gguf wheels; mamba_ssm_src/ with mamba-ssm's Python
# sources; transformers-<v>-site.tar.xz, the tests' transformers version, unpacked as is). Usage: bash bench/gpu_session.sh tests bench_core bench_families ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fg_out}; mkdir -p "$OUT/r"
if ls anchors/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site anchors/*.whl >/dev/null 2>&1
fi
for t in anchors/*-site.tar.xz; do       # pure-Python packages pinned to the tested version
  [ -e "$t" ] && mkdir -p /tmp/site && tar xJf "$t" -C /tmp/site
done
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
stage() { echo "=== $1 ($(date +%T))"; }
for s in "$@"; do
  case $s in
    tests) stage tests
      timeout 480 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=60 tests \
        > "$OUT/r/pytest.log" 2>&1; tail -45 "$OUT/r/pytest.log" | grep -vE "^\.+ *\[|^$" ;;
    tests_new) stage tests_new      # the families the previous GPU session had not run
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=40 \
        tests/backends/cuda/test_attention.py tests/backends/cuda/test_loss.py \
        tests/backends/cuda/test_glue.py tests/backends/cuda/test_ssm.py \
        tests/registry/test_attention.py tests/registry/test_loss.py \
        > "$OUT/r/pytest_new.log" 2>&1; tail -25 "$OUT/r/pytest_new.log" | grep -vE "^\.+ *\[|^$|Warning|warner" ;;
    tests_decode) stage tests_decode   # traced decode steps (paged KV cache, Mamba-2 states) as CUDA graphs
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
        tests/models/test_llama.py tests/models/test_mamba2.py tests/nn/test_kv_cache.py \
        tests/backends/cuda/test_optim.py tests/backends/cuda/test_paged.py \
        > "$OUT/r/pytest_decode.log" 2>&1; tail -25 "$OUT/r/pytest_decode.log" | grep -vE "^\.+ *\[|^$" ;;
    tests_files) stage tests_files    # TEST_FILES: the test files to run (-v: failures named as they happen)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -v -p no:cacheprovider -n ${WORKERS:-14} -rfE \
        --tb=short $TEST_FILES > "$OUT/r/pytest_files.log" 2>&1; echo "rc=$?"
      grep -E " FAILED | ERROR |^FAILED|^ERROR" "$OUT/r/pytest_files.log" | head -30
      grep -E "[0-9]+ (passed|failed)" "$OUT/r/pytest_files.log" | tail -2 ;;
    tests_cuda) stage tests_cuda
      timeout 480 python3 -m pytest -q -p no:cacheprovider -n 8 --maxfail=60 tests/backends/cuda \
        tests/registry tests/nn tests/opt > "$OUT/r/pytest_cuda.log" 2>&1
      tail -45 "$OUT/r/pytest_cuda.log" | grep -vE "^\.+ *\[|^$" ;;
    bench_*) name=${s#bench_}; stage "$s"; extra=""
      [ "$name" = ssm ] || [ "$name" = models ] && extra="--mamba-src anchors/mamba_ssm_src"
      per="ARGS_$name"; extra="$extra ${!per:-}"
      tmo="TMO_$name"; timeout ${!tmo:-420} python3 "bench/bench_cuda_${name}.py" --out "$OUT/r" $extra ${BENCH_ARGS:-} \
        > "$OUT/r/$s.log" 2>&1; tail -${TAIL:-25} "$OUT/r/$s.log" ;;
    dist) stage dist              # needs the 2-GPU machine (nvidia-h200-x2): NCCL, one GPU each
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
        tests/backends/cuda/test_collective.py > "$OUT/r/pytest_dist.log" 2>&1
      tail -15 "$OUT/r/pytest_dist.log" | grep -vE "^\.+ *\[|^$"
      timeout ${TMO_dist:-900} torchrun --nproc_per_node 2 bench/bench_cuda_distributed.py \
        --out "$OUT/r" > "$OUT/r/bench_dist.log" 2>&1; tail -${TAIL:-25} "$OUT/r/bench_dist.log" ;;
    ssd_diag) stage ssd_diag      # which SSD kernel faults, and does exact fp32 fix the grads
      for prec in tf32x3 ieee; do
        FUELGRAPH_SSD_DOT_PRECISION=$prec CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m pytest \
          -q -p no:cacheprovider -x tests/backends/cuda/test_ssm.py -k "ssd_chunk_scan and float32" \
          > "$OUT/r/ssd_$prec.log" 2>&1; echo "prec=$prec"; grep -E "^E  |passed|failed|File.*ssm" \
          "$OUT/r/ssd_$prec.log" | head -12
      done ;;
    *) echo "unknown stage $s" ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$OUT/r"
