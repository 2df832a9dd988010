#!/usr/bin/env bash
# The whole GPU check, in stages, for a fresh GPU machine with no network (jax,
# nanobind, scikit-build-core, cmake, ninja and nvidia-nccl-cu13 preinstalled).
#
#   tools/gpu_check.sh [-o OUTDIR] [STAGE ...]
#
# Stages (default: all of them, in this order):
#   build            pip install -e . with the CUDA kernels and the nccl backend (every
#                    other stage builds first if jax_cgx._cuda does not import)
#   kernels          cuda/tests/device_test.cu: the CUDA launchers against the scalar
#                    reference, byte for byte, and the bandwidth table against a copy,
#                    for each build-time variant of the quantizing kernels (VARIANTS)
#   profile_codec    Nsight Compute on the quantize (bucket 512) and dequantize kernels,
#                    the default build and the one with a kernel per width (WIDTHS=1)
#   tests_codec_gpu  the CUDA kernels against the CPU kernels through JAX, bitwise (about 7
#                    minutes on an H100: each case compiles)
#   tests_nccl_gpu   the nccl backend against the xla backend with 2 and 4 ranks sharing the GPU
#                    (all-reduce, reduce-scatter, all-gather), and setup/teardown
#   bench_codec      the codec on the GPU and the CPU
#   bench_allreduce  psum vs the xla and nccl backends, 2 and 4 ranks sharing the GPU
#   bench_sharded    reduce-scatter and all-gather: lax vs the xla and nccl backends, 2 ranks
#   nccl_transport   why the nccl backend trails the xla backend on one shared GPU: the same
#                    all-reduce with 1 segment and the automatic count, NCCL_DEBUG=INFO, and
#                    again under MPS if the machine allows it
#   train_step       the training step on 2 ranks sharing the GPU, with its profile
#   train_link       issue 29: the training step (MLP, then the transformer; 10 Gbit/s, then unlimited)
#                    on 2 ranks sharing the GPU, each in its own network namespace, NCCL's sockets over
#                    a tbf-shaped veth link (benchmarks/netem/run.py --gpu), jax_cgx beside PyTorch DDP
#                    on NCCL; unshaped loopback sockets where the kernel has no namespaces, veth or tbf
#   train_mps        the MLP at 10 Gbit/s as train_link runs it, the two ranks under MPS (their kernels at
#                    once, not in turns: closer to two GPUs)
#   auto_link        policy="auto" on the MLP at 10 Gbit/s with its calibration and decisions logged
#                    (it chose psum there on 2026-11-27, where 4-bit was 3.66x faster)
#   reference_gpu    the pure-JAX reference compiled by XLA:GPU against the CUDA kernels, bitwise
#   allreduce_link   issue 30: psum vs the xla and nccl backends (all-reduce, reduce-scatter,
#                    all-gather; 64 and 256 MiB) over the same 10 Gbit/s link, and on loopback
#   allreduce_mps    the same over the 10 Gbit/s link, the two ranks under MPS
#   auto_loopback    policy="auto" on the MLP, loopback sockets, no MPS (it chose psum there once)
#   train_charlm_mps the transformer at 10 Gbit/s under MPS, jax_cgx beside DDP
#   train_launch_mps the MLP on loopback under `python -m jax_cgx.launch --mps`
#   tests_cpu        the rest of the test suite (long: a call of its own)
#   prebuild         HERE, not on the GPU machine: the device_test variants for sm_90 into .prebuilt/
#                    (~35 s of one core each), which `kernels` and `profile_codec` then take instead of
#                    building them on the device (carry .prebuilt/; list it in .git/info/exclude)
#
# The link stages need ip and tc, which the device image lacks: fetch Debian's packages into .iproute/
# first (here, once; list it in .git/info/exclude and name it in the device call's carry):
#   mkdir -p .iproute && (cd .iproute && apt-get download iproute2 libbpf1 libmnl0 libxtables12 libelf1 \
#     libcap2 libbsd0 libmd0 libdb5.3 libselinux1 libpcre2-8-0 libtirpc3)
#
# A device call runs at most 10 minutes; the build took 72-78 s of them on an H200 (16 cores) before
# it compiled in pieces (predicted now: ~30-35 s; seconds when the machine is still warm from an
# earlier call): docs/gpu-results.md plans which
# stages go together in one call (`tests_codec_gpu` alone takes about 7 minutes). Logs, JSON and
# the results table go to OUTDIR (default: a temporary folder when $OUT is set, else
# ./gpu-check); with $OUT set they are also packed into $OUT/gpu-check-<stages>.tar.gz,
# with summary.txt beside it (the device tool brings back few files, so one archive).
set -uo pipefail
cd "$(dirname "$0")/.."

out=""
if [[ "${1:-}" == "-o" ]]; then out=$2; shift 2; fi
out="${out:-${OUT:+${TMPDIR:-/tmp}/gpu-check}}"
out="${out:-gpu-check}"
all=(build kernels profile_codec tests_codec_gpu tests_nccl_gpu bench_codec bench_allreduce bench_sharded
     nccl_transport train_step train_link train_mps auto_link reference_gpu allreduce_link allreduce_mps
     auto_loopback train_charlm_mps train_launch_mps tests_cpu)
# Not in the default run: prebuild runs where there is no GPU.
[[ " $* " == *" prebuild "* ]] && all+=(prebuild)
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=("${all[@]}")
for s in "${stages[@]}"; do
  [[ " ${all[*]} " == *" $s "* ]] || { echo "unknown stage '$s'; stages: ${all[*]}" >&2; exit 2; }
done
mkdir -p "$out"
status=0
# GPU_CHECK_BUDGET=SECONDS: no step starts after that many seconds (a device call has a hard limit;
# what ran is packed after every step, so a call cut short still brings back what it measured).
budget=${GPU_CHECK_BUDGET:-0}
step() {  # step NAME CMD...: run, log to $out/NAME.log, remember failures
  local name=$1; shift
  if (( budget > 0 && SECONDS >= budget )); then
    echo "== $name: skipped, past GPU_CHECK_BUDGET=$budget s" | tee -a "$out/summary.txt"
    return 1
  fi
  echo "== $name: $*" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - t0)) s)" | tee -a "$out/summary.txt"
  else
    echo "   FAILED (exit $?, $((SECONDS - t0)) s), see $name.log" | tee -a "$out/summary.txt"
    status=1
  fi
  pack
}
pack() {  # everything so far into $OUT (when the device tool's $OUT is set)
  [[ -n "${OUT:-}" && "$out" != "$OUT" ]] || return 0
  tar czf "$OUT/gpu-check.tar.gz" --exclude=train_step_profile --exclude='device_test_p?_m?_w?' \
    -C "$(dirname "$out")" "$(basename "$out")" 2>/dev/null
  cp "$out/summary.txt" "$OUT/summary.txt" 2>/dev/null
  return 0
}

# Tests and benchmarks start several processes on the one GPU: no preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_CGX_CUDA_ARCHITECTURES="${JAX_CGX_CUDA_ARCHITECTURES:-$(nvidia-smi --query-gpu=compute_cap \
  --format=csv,noheader 2>/dev/null | head -n1 | tr -d .)-real}"
[[ "$JAX_CGX_CUDA_ARCHITECTURES" == "-real" ]] && JAX_CGX_CUDA_ARCHITECTURES=90-real

built() { python -c "import jax_cgx; from jax_cgx import _cuda; assert _cuda.nccl_compiled()" >/dev/null 2>&1; }

stage_build() {
  { nvidia-smi; python --version; python -c "import jax; print(jax.__version__, jax.devices())"; } \
    >"$out/environment.log" 2>&1
  step build env JAX_CGX_CUDA=ON JAX_CGX_NCCL=ON python -m pip install --no-build-isolation --no-deps -v -e .
  step import python -c "import jax_cgx; assert jax_cgx.cuda_extension_available(); \
from jax_cgx import _cuda; assert _cuda.nccl_compiled(); print('cuda extension ok, NCCL', jax_cgx.nccl.load())"
}

# Build-time variants of the quantizing kernels (cuda/quantize_kernels.cuh):
# "PIPELINE MIN_BLOCKS WIDTHS", the first being the default build (xla_ffi/cuda_kernels.h).
# (The per-bucket grids, PIPELINE=0, were timed on 2026-11-27 and lost: docs/gpu-results.md.)
VARIANTS=("1 3 0" "1 1 0" "1 3 1" "1 1 1")
sm=${JAX_CGX_CUDA_ARCHITECTURES%%-*}
vname() { echo "p$1_m$2_w$3"; }  # vname PIPELINE MIN_BLOCKS WIDTHS: the variant's name
device_test_build() {  # device_test_build PIPELINE MIN_BLOCKS WIDTHS [DIR]: builds DIR/device_test_<vname> (DIR: $out)
  nvcc -std=c++17 -O3 --fmad=false --expt-relaxed-constexpr -arch="sm_$sm" \
    -DJAX_CGX_CODEC_PIPELINE="$1" -DJAX_CGX_QUANTIZE_MIN_BLOCKS="$2" -DJAX_CGX_CODEC_WIDTHS="$3" --resource-usage \
    -I. -Icuda/tests cuda/tests/device_test.cu cuda/codec_kernels.cu -o "${4:-$out}/device_test_$(vname "$1" "$2" "$3")"
}

# What device_test is built from: prebuilt binaries count only while this is unchanged.
sources_hash() {
  cat cuda/*.cu cuda/*.cuh cuda/tests/*.cu cuda/tests/*.h xla_ffi/codec_math.h xla_ffi/cuda_kernels.h \
    xla_ffi/float_type.h | sha256sum | cut -c1-16
}

# A variant built here before the call (stage prebuild), if it was built from these sources for this
# GPU and this machine can run it (ldd finds every library and symbol version): copied to $out
# instead of building it again.
prebuilt() {  # prebuilt PIPELINE MIN_BLOCKS WIDTHS: true if $out/device_test_<vname> came from .prebuilt/
  local dir=".prebuilt/sm$sm" name
  name=$(vname "$1" "$2" "$3")
  local exe="$dir/device_test_$name"
  [[ -x $exe && -f $dir/sources && $(cat "$dir/sources") == "$(sources_hash)" ]] || return 1
  [[ $(ldd "$exe" 2>&1) != *"not found"* ]] || return 1
  cp "$exe" "$out/" && cp "$dir/device_test_build_$name.log" "$out/" 2>/dev/null
  echo "   device_test_$name from $dir (built $(cat "$dir/built" 2>/dev/null))" | tee -a "$out/summary.txt"
}

stage_prebuild() {
  command -v nvcc >/dev/null || { echo "prebuild needs nvcc" >&2; status=1; return; }
  local dir=".prebuilt/sm$sm"
  rm -rf "$dir" && mkdir -p "$dir"
  local v pids=() failed=0
  for v in "${VARIANTS[@]}"; do
    # shellcheck disable=SC2086
    device_test_build $v "$dir" >"$dir/device_test_build_$(vname $v).log" 2>&1 &
    pids+=($!)
  done
  local i
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { echo "build ${VARIANTS[$i]} FAILED, see $dir" >&2; failed=1; }
  done
  if (( failed )); then
    rm -f "$dir"/device_test_p*; status=1; return
  fi
  # The stamps `prebuilt` checks: which sources, and (for the log) which commit and compiler.
  sources_hash >"$dir/sources"
  echo "$(git rev-parse --short HEAD) $(nvcc --version | tail -1)" >"$dir/built"
  ls -la "$dir"
}

stage_kernels() {
  local v pids=()
  for v in "${VARIANTS[@]}"; do
    # shellcheck disable=SC2086
    prebuilt $v && { pids+=(0); continue; }
    # shellcheck disable=SC2086
    device_test_build $v >"$out/device_test_build_$(vname $v).log" 2>&1 &
    pids+=($!)
  done
  local i
  for i in "${!pids[@]}"; do
    v=${VARIANTS[$i]}
    [[ ${pids[$i]} == 0 ]] && continue
    wait "${pids[$i]}" || { echo "   build $(vname $v) FAILED, see device_test_build_$(vname $v).log" |
      tee -a "$out/summary.txt"; status=1; }
  done
  for v in "${VARIANTS[@]}"; do
    local exe="$out/device_test_$(vname $v)"
    step "device_test_$(vname $v)" "$exe"
    step "device_bench_$(vname $v)" "$exe" bench
    tail -n +2 "$out/device_bench_$(vname $v).log" >>"$out/summary.txt"
  done
}

# ncu on the quantize (bucket 512: two register groups per lane) and dequantize launches of
# `device_test profile` (each operation once), for the default build and the one with a kernel per width.
stage_profile_codec() {
  command -v ncu >/dev/null || { echo "   no ncu" | tee -a "$out/summary.txt"; return; }
  local v exe
  for v in "1 3 0" "1 3 1"; do
    exe="$out/device_test_$(vname $v)"
    # shellcheck disable=SC2086
    [[ -x $exe ]] || prebuilt $v || device_test_build $v >/dev/null 2>&1
    step "ncu_quantize_$(vname $v)" ncu --kernel-name-base mangled \
      --kernel-name "regex:quantize_segments_kernel.*ArrayInput.*Li2E" --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats "$exe" profile
    step "ncu_dequantize_$(vname $v)" ncu --kernel-name-base mangled --kernel-name "regex:dequantize_sum_kernel" \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats "$exe" profile
  done
}

# One pytest process (-o addopts=-ra drops pyproject.toml's two xdist workers): the GPU tests own the GPU,
# and the device machine may not have pytest-xdist.
stage_tests_codec_gpu() { step tests_codec_gpu pytest -o addopts=-ra tests/codec -m gpu -q; }
stage_reference_gpu() { step reference_gpu pytest -o addopts=-ra tests/codec/test_codec_gpu.py -k reference -q; }
stage_tests_nccl_gpu() { step tests_nccl_gpu pytest -o addopts=-ra tests/nccl -m gpu -v; }

stage_bench_codec() {
  step bench_codec_gpu python -m jax_cgx.bench codec --platform gpu --sizes-mib 16 64 256 --bits 2 4 8 \
    --output "$out/bench_codec_gpu.json"
  step bench_codec_cpu python -m jax_cgx.bench codec --platform cpu --sizes-mib 64 --bits 4 8 \
    --output "$out/bench_codec_cpu.json"
}

stage_bench_allreduce() {
  for n in 2 4; do
    step "bench_allreduce_gpu_w$n" python -m jax_cgx.launch -n "$n" benchmarks/allreduce.py --share-gpu \
      --sizes-mib 16 64 256 --bits 4 8 --backends xla nccl --repeats 10 --output "$out/bench_allreduce_gpu_w$n.json"
  done
  python tools/results_table.py "$out"/bench_allreduce_gpu_w*.json >"$out/allreduce_table.md" 2>>"$out/summary.txt"
  cat "$out/allreduce_table.md" >>"$out/summary.txt" 2>/dev/null
}

stage_bench_sharded() {
  step bench_sharded_gpu_w2 python -m jax_cgx.launch -n 2 benchmarks/allreduce.py --share-gpu \
    --sizes-mib 16 64 --bits 4 8 --ops psum_scatter all_gather --backends xla nccl --repeats 10 \
    --output "$out/bench_sharded_gpu_w2.json"
}

# MPS: the ranks' kernels share the GPU at once instead of taking turns in time slices, as two GPUs
# would run them. mps_start is false (and says why) where the machine has no MPS daemon or it fails.
mps_start() {
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "   no MPS on this machine" | tee -a "$out/summary.txt"
    return 1
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! nvidia-cuda-mps-control -d; then
    echo "   MPS daemon did not start" | tee -a "$out/summary.txt"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    return 1
  fi
  # Stop the daemon however this ends (a killed call would leave it on a warm machine).
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "   MPS daemon started" | tee -a "$out/summary.txt"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control
  trap - EXIT
  cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$out/mps_control.log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# The nccl backend's all-reduce against psum and the xla backend, 2 ranks on the shared GPU:
# with one segment (two NCCL calls per all-reduce, as the xla backend makes) and with the
# automatic count (16 MiB of input per segment), NCCL's own log of the first, and the
# same under MPS (the ranks' kernels then share the GPU instead of taking turns).
transport_bench() {  # transport_bench NAME SEGMENTS: the 2-rank all-reduce, psum vs xla and nccl
  step "$1" python -m jax_cgx.launch -n 2 benchmarks/allreduce.py --share-gpu --sizes-mib 64 256 --bits 4 \
    --backends xla nccl --segments "$2" --repeats 5 --no-progress --output "$out/$1.json"
}

stage_nccl_transport() {
  transport_bench transport_seg1 1
  transport_bench transport_seg0 0
  step transport_nccl_debug env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,TUNING \
    python -m jax_cgx.launch -n 2 benchmarks/allreduce.py --share-gpu --sizes-mib 64 --bits 4 \
    --backends nccl --segments 1 --repeats 2 --no-progress
  if mps_start; then
    transport_bench transport_mps_seg1 1
    transport_bench transport_mps_seg0 0
    mps_stop
  fi
  local f
  for f in "$out"/transport_*.json; do
    [[ -f $f ]] || continue
    echo "### $(basename "$f" .json)"
    python tools/results_table.py "$f"
  done >"$out/transport_table.md" 2>>"$out/summary.txt"
  cat "$out/transport_table.md" >>"$out/summary.txt"
}

# policy="auto" calibrating on a GPU, and reduce_in_backward where XLA's latency-hiding
# scheduler may overlap it (the profile shows whether).
stage_train_step() {
  step train_step_gpu_w2 python -m jax_cgx.launch -n 2 benchmarks/train_step.py --share-gpu --steps 20 \
    --compressors none maxmin:4 maxmin:4+auto maxmin:4+backward --no-progress \
    --profile "$out/train_step_profile" --output "$out/train_step_gpu_w2.json"
}

# Issue 29: the step as users train, over an emulated Ethernet link. Most important first: the MLP
# at 10 Gbit/s (the targets), unlimited, then the transformer (compute matters: d_model 512, 4
# layers, 256 tokens of context, 32 sequences per GPU).
# The device image has no iproute2: ip and tc come from Debian packages carried in .iproute/
# (apt-get download iproute2 and its libraries), unpacked to /tmp/iproute; the wrappers put on
# LD_LIBRARY_PATH only the libraries this machine lacks (ldd's "not found").
ensure_iproute() {
  command -v ip >/dev/null && command -v tc >/dev/null && return 0
  compgen -G ".iproute/iproute2_*.deb" >/dev/null || { echo "no ip/tc and no .iproute/ debs"; return 1; }
  local root=/tmp/iproute f exe lib
  mkdir -p "$root/need" "$root/wrap"
  for f in .iproute/*.deb; do dpkg -x "$f" "$root/pkg"; done
  for exe in ip tc; do
    f=$(find "$root/pkg" -type f -name "$exe" -path "*bin/*" | head -1)
    for lib in $(ldd "$f" | awk '/not found/ {print $1}'); do
      ln -sf "$(find "$root/pkg" -name "$lib" | head -1)" "$root/need/$lib"
    done
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' "$root/need" "$f" \
      >"$root/wrap/$exe"
    chmod +x "$root/wrap/$exe"
  done
  export PATH="$root/wrap:$PATH"
  echo "ip and tc from .iproute/ (libraries added: $(ls "$root/need" | tr '\n' ' '))"
  ip -V
}

link_ok() {  # can this kernel make namespaces, veth pairs and tbf queues? (once; logged)
  if [[ -z "${link_checked:-}" ]]; then
    link_checked=1
    ensure_iproute >"$out/iproute.log" 2>&1
    cat "$out/iproute.log" >>"$out/summary.txt"
    { command -v ip tc unshare && ip netns add cgxprobe && ip -n cgxprobe link add name cgxa type veth peer name cgxb && ip -n cgxprobe link add name cgxbr type bridge &&
      tc -n cgxprobe qdisc add dev cgxa root tbf rate 10gbit burst 2500000b latency 50ms && echo LINK_OK
      ip netns delete cgxprobe; } >"$out/link_probe.log" 2>&1
    grep -q LINK_OK "$out/link_probe.log" && link_works=1 || link_works=0
    echo "   network namespaces, veth and tbf: $([[ $link_works == 1 ]] && echo yes || echo "NO (see link_probe.log): \
unshaped loopback sockets instead")" | tee -a "$out/summary.txt"
  fi
  [[ $link_works == 1 ]]
}

link_run() {  # link_run NAME RATE SCRIPT ARGS...: 2 ranks on the GPU over a RATE link (or loopback)
  local name=$1 rate=$2 script=$3; shift 3
  if link_ok; then
    step "$name" python benchmarks/netem/run.py -p 2 --rate "$rate" --gpu --timeout 240 --script "$script" -- \
      "$@" --output "$out/$name.json"
    # (Not under MPS: there the failure may be MPS's, and the link is still good for what follows.)
    if [[ ! -f "$out/$name.json" && -z ${CUDA_MPS_PIPE_DIRECTORY:-} ]] &&
      ! grep -q "skipped, past" <(tail -1 "$out/summary.txt"); then
      link_works=0  # the link runs fail: what follows goes over loopback (unlimited) so something is measured
      echo "   the shaped link failed: the unlimited runs that follow use loopback sockets" | tee -a "$out/summary.txt"
    fi
  elif [[ $rate == unlimited ]]; then
    step "$name" timeout 240 python -m jax_cgx.launch -n 2 "$script" --share-gpu "$@" --output "$out/$name.json"
  else
    echo "== $name: skipped (no shaped link on this machine)" | tee -a "$out/summary.txt"
  fi
  [[ -f "$out/$name.json" ]] && python tools/results_table.py "$out/$name.json" >>"$out/summary.txt" 2>&1
  pack
}

TRAIN_DDP=(ddp:none ddp:fp16 ddp:powersgd:2)
# The MLP step's run (train_link, train_mps): 30 steps, the first 5 left out, every compressor and DDP variant.
TRAIN_COMMON=(--steps 30 --warmup 5 --no-progress)
TRAIN_MLP=("${TRAIN_COMMON[@]}" --compressors none maxmin:4 maxmin:8 maxmin:4+backward maxmin:4+auto "${TRAIN_DDP[@]}")
# TRAIN_RATES: the links to train over, in this order (default "10gbit unlimited").
stage_train_link() {
  local rate
  local lm=(--model charlm --d-model 512 --layers 4 --context 256 --batch-per-device 32)
  for rate in ${TRAIN_RATES:-10gbit unlimited}; do
    local gbps=(); [[ $rate == unlimited ]] || gbps=(--link-gbps "${rate%gbit}")
    link_run "train_mlp_$rate" "$rate" benchmarks/train_step.py "${gbps[@]}" "${TRAIN_MLP[@]}"
    link_run "train_charlm_$rate" "$rate" benchmarks/train_step.py "${gbps[@]}" "${lm[@]}" "${TRAIN_COMMON[@]}" \
      --compressors none maxmin:4 maxmin:8 "${TRAIN_DDP[@]}"
  done
}

# Issue 29's fixed ~10 ms per step (4-bit: 20.1 ms where compute and wire take 8.2): the MLP at 10 Gbit/s
# again with the two ranks under MPS, every compressor and DDP variant in the same run as before.
stage_train_mps() {
  mps_start || return 0
  link_run train_mlp_10gbit_mps 10gbit benchmarks/train_step.py --link-gbps 10 "${TRAIN_MLP[@]}"
  mps_stop
}

stage_auto_link() {
  link_run auto_mlp_10gbit 10gbit benchmarks/train_step.py --link-gbps 10 --steps 20 --warmup 5 --no-progress \
    --compressors none maxmin:4 maxmin:4+auto
  grep "policy=" "$out/auto_mlp_10gbit.log" >>"$out/summary.txt" 2>/dev/null
  pack
}

# Issue 30: the nccl backend against the xla backend and psum on the same link, and on loopback
# sockets, with the library's default segmentation (one segment since 2026-11-27, after 8 measured
# 2-3x slower on two processes sharing the GPU: two NCCL calls per all-reduce, as the xla backend).
ALLREDUCE_BACKENDS=(--sizes-mib 64 256 --bits 4 --ops psum psum_scatter all_gather --backends xla nccl
                    --repeats 5 --no-progress)
stage_allreduce_link() {
  link_run allreduce_10gbit 10gbit benchmarks/allreduce.py "${ALLREDUCE_BACKENDS[@]}"
  link_run allreduce_unlimited unlimited benchmarks/allreduce.py "${ALLREDUCE_BACKENDS[@]}"
}

# The same over the 10 Gbit/s link with the ranks under MPS (closer to one process per GPU).
stage_allreduce_mps() {
  mps_start || return 0
  link_run allreduce_10gbit_mps 10gbit benchmarks/allreduce.py "${ALLREDUCE_BACKENDS[@]}"
  mps_stop
}

# policy="auto" where it chose psum on 2026-11-27 (loopback, no MPS: 4-bit 2.64x faster), now that
# the GPU's codec rates are timed on 64 MiB in batches.
stage_auto_loopback() {
  step auto_mlp_loopback python -m jax_cgx.launch -n 2 benchmarks/train_step.py --share-gpu --steps 20 \
    --warmup 5 --no-progress --compressors none maxmin:4 maxmin:4+auto --output "$out/auto_mlp_loopback.json"
  grep "policy=" "$out/auto_mlp_loopback.log" >>"$out/summary.txt" 2>/dev/null
  [[ -f "$out/auto_mlp_loopback.json" ]] && python tools/results_table.py "$out/auto_mlp_loopback.json" >>"$out/summary.txt" 2>&1
  pack
}

# The transformer at 10 Gbit/s with the ranks under MPS (target: 4-bit >= 3x psum).
stage_train_charlm_mps() {
  mps_start || return 0
  link_run train_charlm_10gbit_mps 10gbit benchmarks/train_step.py --link-gbps 10 --model charlm --d-model 512 \
    --layers 4 --context 256 --batch-per-device 32 "${TRAIN_COMMON[@]}" --compressors none maxmin:4 maxmin:8 \
    maxmin:4+auto "${TRAIN_DDP[@]}"
  mps_stop
}

# The documented one-liner: the launcher's --mps (its own daemon), the MLP on loopback sockets.
stage_train_launch_mps() {
  step train_mlp_unlimited_launch_mps python -m jax_cgx.launch -n 2 --mps benchmarks/train_step.py --share-gpu \
    "${TRAIN_COMMON[@]}" --compressors none maxmin:4 maxmin:8 maxmin:4+auto "${TRAIN_DDP[@]}" \
    --output "$out/train_mlp_unlimited_launch_mps.json"
  [[ -f "$out/train_mlp_unlimited_launch_mps.json" ]] &&
    python tools/results_table.py "$out/train_mlp_unlimited_launch_mps.json" >>"$out/summary.txt" 2>&1
  pack
}

stage_tests_cpu() { step tests_cpu pytest -o addopts=-ra tests -q -m "not gpu"; }

for s in "${stages[@]}"; do
  if [[ $s != build && $s != prebuild ]] && ! built; then stage_build; fi
  "stage_$s"
done
echo "exit status $status" | tee -a "$out/summary.txt"
if [[ -n "${OUT:-}" && "$out" != "$OUT" ]]; then
  name="gpu-check-$(IFS=-; echo "${stages[*]}")"
  name=${name:0:100}
  # The profile apart: the device tool brings back files of at most 16 MiB.
  tar czf "$OUT/$name.tar.gz" --exclude=train_step_profile --exclude='device_test_p?_m?_w?' -C "$(dirname "$out")" "$(basename "$out")"
  [[ -d "$out/train_step_profile" ]] && tar czf "$OUT/$name-profile.tar.gz" -C "$out" train_step_profile
  cp "$out/summary.txt" "$OUT/summary.txt"
fi
exit $status
