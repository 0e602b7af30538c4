#!/usr/bin/env bash
# run.sh RESULTS_DIR -- runs tp's GPU test suite and benchmark on a GPU host with no Rust
# toolchain, and writes everything under RESULTS_DIR. Made by `cargo xtask bundle`.
#
# It finds libcuda, libnvrtc, libcublas(Lt) and libnccl in the system library paths, under
# CUDA_HOME, and in Python's site-packages (nvidia/*/lib, as the NVIDIA wheels install them),
# puts those folders on LD_LIBRARY_PATH, records what it found, then runs:
#   gpu-tests       -> RESULTS_DIR/gpu-tests.txt (exit status in gpu-tests.rc)
#   gpu-comm-tests  -> RESULTS_DIR/gpu-comm-tests.txt (NCCL at world 1, LocalGroup on one GPU)
#   gpu-layer-tests -> RESULTS_DIR/gpu-layer-tests.txt (layers on LocalGroup ranks sharing GPU 0)
#   gpu-model-tests -> RESULTS_DIR/gpu-model-tests.txt (whole models on GPU 0, 1..4 ranks)
#   gpu-tests again with TP_GEMM_KERNEL=wgmma -> RESULTS_DIR/gpu-tests-wgmma.txt
#   tp-bench --quick -> RESULTS_DIR/bench.txt, results.json, results.csv, results.svg
#     (the full shape set takes longer than one device call: run `tp-bench --shapes squares`
#      and `tp-bench --shapes tp` as separate calls)
#   tp-comm-bench   -> RESULTS_DIR/comm-bench.txt (NCCL on every GPU, nccl-tests style)
#   compute-sanitizer memcheck / racecheck on the decoder and copy kernels, when the host has
#     compute-sanitizer (PATH or CUDA_HOME/bin) -> RESULTS_DIR/sanitize-*.txt
# Every step runs under `timeout` (STEP_SECS, default 240 s; the benchmark BENCH_SECS, default
# 300 s) and within the whole run's budget (TOTAL_SECS, default 540 s: one device call), so a
# hung kernel costs one step, not the device window. In NAME.rc, 124 means the step timed out
# and 125 that the budget was spent before it started.
set -u
out=${1:?usage: run.sh RESULTS_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

dirs=()
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
  [ -d "$d" ] && dirs+=("$d")
done
for py in python3 python; do
  command -v "$py" >/dev/null 2>&1 || continue
  for site in $("$py" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do [ -d "$d" ] && dirs+=("$d"); done
  done
  break
done
joined=$(IFS=:; echo "${dirs[*]}")
export LD_LIBRARY_PATH="${joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat "$here/COMMIT" 2>/dev/null || echo unknown)"
  echo "host: $(uname -a)"
  # Any version counts (cudarc also loads e.g. libcublas.so.12); report what the loader will see.
  for lib in libcuda.so libnvrtc.so libcublas.so libcublasLt.so libnccl.so; do
    found=""
    IFS=: read -ra search <<< "$LD_LIBRARY_PATH"
    for d in "${search[@]}"; do
      for f in "$d/$lib".*; do [ -e "$f" ] && { found="$f"; break 2; }; done
    done
    echo "$lib: ${found:-not found}"
  done
} > "$out/env.txt"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu \
    --format=csv > "$out/gpu.csv" 2>&1
fi
cat "$out/env.txt"

step_secs=${STEP_SECS:-240}
run_end=$(( $(date +%s) + ${TOTAL_SECS:-540} ))
# step NAME SECONDS CMD...: runs CMD under a deadline (the smaller of SECONDS and what is left of
# the run's budget) into NAME.txt, its status into NAME.rc.
step() {
  local name=$1 secs=$2
  shift 2
  local left=$(( run_end - $(date +%s) - 15 ))
  if [ "$left" -lt "$secs" ]; then secs=$left; fi
  if [ "$secs" -le 0 ]; then
    echo "skipped: the run's TOTAL_SECS budget was spent" > "$out/$name.txt"
    echo 125 > "$out/$name.rc"
    echo "== $name (skipped, no time left)"
    return
  fi
  timeout --kill-after=10 "$secs" "$@" > "$out/$name.txt" 2>&1
  echo $? > "$out/$name.rc"
  echo "== $name (exit $(cat "$out/$name.rc"))"
  tail -n 5 "$out/$name.txt"
}

for suite in gpu-tests gpu-comm-tests gpu-layer-tests gpu-model-tests; do
  step "$suite" "$step_secs" "$here/$suite" --test-threads=1
done

# The Hopper kernel is opt-in until it has passed here: run the main suite again through it.
step gpu-tests-wgmma "$step_secs" env TP_GEMM_KERNEL=wgmma "$here/gpu-tests" --test-threads=1

step bench "${BENCH_SECS:-300}" "$here/tp-bench" --quick --out "$out"
step comm-bench "$step_secs" "$here/tp-comm-bench" --max-bytes 1073741824

# compute-sanitizer, where the host has it: memcheck (out-of-bounds and misaligned accesses) and
# racecheck (shared-memory races) on the kernels whose tests are small enough to run under it.
sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$sanitizer" ]; then
  step sanitize-memcheck "$step_secs" "$sanitizer" --tool memcheck --error-exitcode 1 \
    "$here/gpu-tests" --test-threads=1 decoder_kernels narrow gather casts small_sizes
  step sanitize-racecheck "$step_secs" "$sanitizer" --tool racecheck --error-exitcode 1 \
    "$here/gpu-tests" --test-threads=1 decoder_kernels_agree
else
  echo "compute-sanitizer not found: memcheck and racecheck not run" > "$out/sanitize.txt"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$out/gpu.csv" 2>&1
fi
