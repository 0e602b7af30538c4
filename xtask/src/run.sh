#!/usr/bin/env bash
# run.sh RESULTS_DIR -- runs tp's GPU test suite and benchmark on a GPU host with no Rust
# toolchain, and writes everything under RESULTS_DIR. Made by `cargo xtask bundle`.
#
# It finds libcuda, libnvrtc, libcublas(Lt) and libnccl in the system library paths (among them
# /usr/local/nvidia/lib64, where container runtimes mount the driver), under CUDA_HOME, and in
# Python's site-packages (nvidia/*/lib, as the NVIDIA wheels install them), appends those
# folders to LD_LIBRARY_PATH (the inherited entries stay first, so a stray libcuda.so.1 in a
# system folder cannot shadow the driver's), records what the loader will find (the
# LD_LIBRARY_PATH folders, then `ldconfig -p`), then runs:
#   gpu-tests       -> RESULTS_DIR/gpu-tests.txt (exit status in gpu-tests.rc)
#   gpu-quant-tests -> RESULTS_DIR/gpu-quant-tests.txt (ggml-format weight kernels vs tp-cpu)
#   gpu-grad-tests  -> RESULTS_DIR/gpu-grad-tests.txt (training's kernels vs the host ops)
#   gpu-comm-tests  -> RESULTS_DIR/gpu-comm-tests.txt (NCCL at world 1, LocalGroup on one GPU)
#   gpu-layer-tests -> RESULTS_DIR/gpu-layer-tests.txt (layers on LocalGroup ranks sharing GPU 0)
#   gpu-model-tests -> RESULTS_DIR/gpu-model-tests.txt (whole models on GPU 0, 1..4 ranks)
#   gpu-tests again with TP_GEMM_KERNEL=wgmma -> RESULTS_DIR/gpu-tests-wgmma.txt
#   tp-bench --quick -> RESULTS_DIR/bench.txt, results.json, results.csv, results.svg
#     (the full shape set takes longer than one device call: run `tp-bench --shapes squares`
#      and `tp-bench --shapes tp` as separate calls)
#   tp-comm-bench   -> RESULTS_DIR/comm-bench.txt (NCCL on every GPU, nccl-tests style)
#   compute-sanitizer memcheck / racecheck on the decoder and copy kernels, when the host has
#     compute-sanitizer (PATH or CUDA_HOME/bin) and a probe on one small test shows it supports
#     the device -> RESULTS_DIR/sanitize-*.txt; otherwise RESULTS_DIR/sanitize.txt says why not
# A failed GPU suite whose output names a kernel fault (LAUNCH_FAILED, ILLEGAL_INSTRUCTION, ...)
# gets a note: the fault poisons the CUDA context, so only its first failure is the real one.
# Every step runs under `timeout` (STEP_SECS, default 240 s; the benchmark BENCH_SECS, default
# 300 s) and within the whole run's budget (TOTAL_SECS, default 540 s: one device call), so a
# hung kernel costs one step, not the device window. In NAME.rc, 124 means the step timed out
# and 125 that the budget was spent before it started.
set -u
out=${1:?usage: run.sh RESULTS_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"

# The whole run's budget starts now (TOTAL_SECS, default 540 s: one device call).
run_end=$(( $(date +%s) + ${TOTAL_SECS:-540} ))

# The binaries travel packed (bins.tar.gz): unpack them into a temporary folder (else one beside
# the bundle, should TMPDIR be missing, read-only or mounted noexec), never into RESULTS_DIR
# (whose files are fetched back). A bundle with loose binaries runs them in place.
bin="$here"
unpack() { # unpack DIR: the binaries into DIR, runnable there
  tar -xzf "$here/bins.tar.gz" -C "$1" 2>/dev/null ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$here/bins.tar.gz" "$1" ||
    return 1
  [ -x "$1/gpu-tests" ] && "$1/gpu-tests" --list >/dev/null 2>&1
}
if [ -f "$here/bins.tar.gz" ]; then
  bin=""
  for parent in "${TMPDIR:-/tmp}" "$here"; do
    d=$(mktemp -d "$parent/tp-bundle.XXXXXX" 2>/dev/null) || continue
    if unpack "$d"; then bin=$d; break; fi
    rm -rf "$d"
  done
  if [ -z "$bin" ]; then
    echo "run.sh: cannot unpack $here/bins.tar.gz into a folder where it can run (needs tar with gzip, or python3)" >&2
    exit 1
  fi
  trap 'rm -rf "$bin"' EXIT
fi

dirs=()
# add_dir DIR: appends DIR to dirs if it exists and is not there yet.
add_dir() {
  local e
  [ -d "$1" ] || return 0
  for e in ${dirs[@]+"${dirs[@]}"}; do [ "$e" = "$1" ] && return 0; done
  dirs+=("$1")
}
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/nvidia/lib64 \
  /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib; do
  add_dir "$d"
done
for py in python3 python; do
  command -v "$py" >/dev/null 2>&1 || continue
  for site in $("$py" -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
    for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do add_dir "$d"; done
  done
  break
done
joined=$(IFS=:; echo "${dirs[*]}")
if [ -n "$joined" ]; then export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}${joined}"; fi

ldconfig_bin=$(command -v ldconfig || { [ -x /sbin/ldconfig ] && echo /sbin/ldconfig; } || true)
ld_cache=$([ -n "$ldconfig_bin" ] && timeout -k 5 20 "$ldconfig_bin" -p 2>/dev/null || true)

# find_lib NAME: where the loader finds NAME (any version: cudarc also loads e.g.
# libcublas.so.12): the first LD_LIBRARY_PATH folder holding NAME or NAME.*, else the first
# 64-bit entry of the ld.so cache; empty when neither has it.
find_lib() {
  local lib=$1 d f
  local -a search
  IFS=: read -ra search <<< "${LD_LIBRARY_PATH:-}"
  for d in "${search[@]}"; do
    [ -n "$d" ] || continue
    for f in "$d/$lib" "$d/$lib".*; do
      if [ -e "$f" ]; then echo "$f"; return; fi
    done
  done
  # `ldconfig -p` lines: "<TAB>libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1".
  f=$(printf '%s\n' "$ld_cache" | awk -v lib="$lib" \
    '($1 == lib || index($1, lib ".") == 1) && $2 ~ /64/ { print $NF; exit }')
  [ -n "$f" ] && echo "$f (ld.so cache)"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat "$here/COMMIT" 2>/dev/null || echo unknown)"
  echo "host: $(uname -a)"
  echo "LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-}"
  for lib in libcuda.so libnvrtc.so libcublas.so libcublasLt.so libnccl.so; do
    found=$(find_lib "$lib")
    echo "$lib: ${found:-not found}"
  done
} > "$out/env.txt"
# nvidia-smi can hang on a wedged driver: every call has a deadline.
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout -k 5 20 nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  timeout -k 5 20 nvidia-smi \
    --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,temperature.gpu \
    --format=csv > "$out/gpu.csv" 2>&1
fi
cat "$out/env.txt"

step_secs=${STEP_SECS:-240}
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

# note_fault NAME: after a failed suite whose output names a kernel fault, says once what that
# means for the rest of the suite.
note_fault() {
  [ "$(cat "$out/$1.rc")" = 0 ] && return
  if grep -Eq 'LAUNCH_FAILED|ILLEGAL_INSTRUCTION|ILLEGAL_ADDRESS|MISALIGNED_ADDRESS|HARDWARE_STACK_ERROR|INVALID_PC|INVALID_ADDRESS_SPACE|CUDA_ERROR_ASSERT' "$out/$1.txt"; then
    echo "note: $1: a CUDA launch failure/illegal instruction poisons the context: every later test of this" \
      "suite fails with it too, so the first failure in $1.txt is the real one"
  fi
}

for suite in gpu-tests gpu-quant-tests gpu-grad-tests gpu-comm-tests gpu-layer-tests gpu-model-tests; do
  step "$suite" "$step_secs" "$bin/$suite" --test-threads=1
  note_fault "$suite"
done

# The Hopper kernel is opt-in until it has passed here: run the main suite again through it.
step gpu-tests-wgmma "$step_secs" env TP_GEMM_KERNEL=wgmma "$bin/gpu-tests" --test-threads=1
note_fault gpu-tests-wgmma

step bench "${BENCH_SECS:-300}" "$bin/tp-bench" --quick --out "$out"
step comm-bench "$step_secs" "$bin/tp-comm-bench" --max-bytes 1073741824

# compute-sanitizer, where the host has it: memcheck (out-of-bounds and misaligned accesses) and
# racecheck (shared-memory races) on the kernels whose tests are small enough to run under it.
sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer 2>/dev/null || true)
# It can be installed yet not support the device ("Device not supported", error 999): probe it
# once on the smallest test, and skip both steps with the reason rather than report them red.
if [ -n "$sanitizer" ]; then
  probe_secs=$(( run_end - $(date +%s) - 15 ))
  if [ "$probe_secs" -gt 60 ]; then probe_secs=60; fi
  if [ "$probe_secs" -le 0 ]; then
    echo "skipped: the run's TOTAL_SECS budget was spent" > "$out/sanitize.txt"
    sanitizer=""
  else
    probe=$(timeout --kill-after=5 "$probe_secs" "$sanitizer" --tool memcheck --error-exitcode 1 \
      "$bin/gpu-tests" --test-threads=1 --exact device_reports_itself_and_round_trips_bytes 2>&1)
    probe_rc=$?
    why=$(printf '%s\n' "$probe" | grep -Ei -m1 'not supported|error 999|internal sanitizer error' || true)
    if [ "$probe_rc" -eq 124 ] || [ "$probe_rc" -eq 137 ]; then
      why="the probe did not finish in $probe_secs s"
    fi
    if [ -n "$why" ]; then
      echo "unsupported: $why" > "$out/sanitize.txt"
      sanitizer=""
    fi
  fi
  [ -z "$sanitizer" ] && echo "== sanitize ($(cat "$out/sanitize.txt"))"
else
  echo "compute-sanitizer not found: memcheck and racecheck not run" > "$out/sanitize.txt"
fi
if [ -n "$sanitizer" ]; then
  step sanitize-memcheck "$step_secs" "$sanitizer" --tool memcheck --error-exitcode 1 \
    "$bin/gpu-tests" --test-threads=1 decoder_kernels narrow gather casts small_sizes paged write_slots sampling_kernels
  step sanitize-racecheck "$step_secs" "$sanitizer" --tool racecheck --error-exitcode 1 \
    "$bin/gpu-tests" --test-threads=1 decoder_kernels_agree
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  if [ $(( run_end - $(date +%s) )) -ge 25 ]; then
    timeout -k 5 20 nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$out/gpu.csv" 2>&1
  fi
fi
