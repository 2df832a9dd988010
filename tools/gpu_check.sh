#!/usr/bin/env bash
# The whole GPU check, for a fresh GPU machine with no network (jax, nanobind,
# scikit-build-core, cmake, ninja and nvidia-nccl-cu13 preinstalled): build
# (CUDA kernels and the nccl backend), run every test (GPU tests included, and
# the one-GPU multi-rank NCCL test), run the codec benchmark on the GPU and the
# CPU and the all-reduce benchmark with 2 and 4 ranks sharing the GPU (psum vs
# the xla and nccl backends; reduce-scatter and all-gather with 2), and write logs, JSON and a results table into a
# directory.
#
#   tools/gpu_check.sh [OUTDIR]        (default: $OUT if set, else ./gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
status=0
step() {  # step NAME CMD...: run, log to $out/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*" | tee -a "$out/summary.txt"
  if "$@" >"$out/$name.log" 2>&1; then
    echo "   ok" | tee -a "$out/summary.txt"
  else
    echo "   FAILED (exit $?), see $name.log" | tee -a "$out/summary.txt"
    status=1
  fi
}

{ nvidia-smi; python --version; python -c "import jax; print(jax.__version__, jax.devices())"; } \
  >"$out/environment.log" 2>&1
# Tests and benchmarks start several processes on the one GPU: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step build env JAX_CGX_CUDA=ON JAX_CGX_NCCL=ON pip install --no-build-isolation --no-deps -v -e .
step import python -c "import jax_cgx; assert jax_cgx.cuda_extension_available(); \
from jax_cgx import _cuda; assert _cuda.nccl_compiled(); print('cuda extension ok, NCCL', jax_cgx.nccl.load())"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
step device_test_build nvcc -std=c++17 -O3 --fmad=false --expt-relaxed-constexpr -arch="sm_${arch:-90}" \
  -I. -Icuda/tests cuda/tests/device_test.cu cuda/codec_kernels.cu -o "$out/device_test"
step device_test "$out/device_test"
step device_bench "$out/device_test" bench
step tests_gpu pytest tests -m gpu -v
step tests_all pytest tests -q
step bench_codec_gpu python -m jax_cgx.bench codec --platform gpu --sizes-mib 16 64 256 --bits 2 4 8 \
  --output "$out/bench_codec_gpu.json"
step bench_codec_cpu python -m jax_cgx.bench codec --platform cpu --sizes-mib 64 --bits 4 8 \
  --output "$out/bench_codec_cpu.json"
for n in 2 4; do
  step "bench_allreduce_gpu_w$n" python -m jax_cgx.launch -n "$n" benchmarks/allreduce.py --share-gpu \
    --sizes-mib 16 64 256 --bits 4 8 --backends xla nccl --repeats 10 --output "$out/bench_allreduce_gpu_w$n.json"
done
# Reduce-scatter and all-gather of sharded training: lax vs the xla and nccl backends.
step bench_sharded_gpu_w2 python -m jax_cgx.launch -n 2 benchmarks/allreduce.py --share-gpu \
  --sizes-mib 16 64 --bits 4 8 --ops psum_scatter all_gather --backends xla nccl --repeats 10 \
  --output "$out/bench_sharded_gpu_w2.json"
# The training step on the GPU (2 ranks sharing it): policy="auto" calibrating on a GPU, and
# reduce_in_backward where XLA's latency-hiding scheduler may overlap it (the profile shows whether).
step train_step_gpu_w2 python -m jax_cgx.launch -n 2 benchmarks/train_step.py --share-gpu --steps 20 \
  --compressors none maxmin:4 maxmin:4+auto maxmin:4+backward --no-progress \
  --profile "$out/train_step_profile" --output "$out/train_step_gpu_w2.json"
python tools/results_table.py "$out"/bench_allreduce_gpu_w*.json >"$out/allreduce_table.md" 2>>"$out/summary.txt"
tail -n 30 "$out/bench_codec_gpu.log" >>"$out/summary.txt" 2>/dev/null
cat "$out/allreduce_table.md" >>"$out/summary.txt" 2>/dev/null
echo "exit status $status" | tee -a "$out/summary.txt"
exit $status
