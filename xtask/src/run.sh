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
#   gpu-tests again with TP_GEMM_KERNEL=wgmma -> RESULTS_DIR/gpu-tests-wgmma.txt
#   tp-bench --quick -> RESULTS_DIR/bench.txt, results.json, results.csv, results.svg
#     (the full shape set takes longer than one device call: run `tp-bench --shapes squares`
#      and `tp-bench --shapes tp` as separate calls)
#   tp-comm-bench   -> RESULTS_DIR/comm-bench.txt (NCCL on every GPU, nccl-tests style)
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

for suite in gpu-tests gpu-comm-tests gpu-layer-tests; do
  "$here/$suite" --test-threads=1 > "$out/$suite.txt" 2>&1
  echo $? > "$out/$suite.rc"
  echo "== $suite (exit $(cat "$out/$suite.rc"))"
  tail -n 5 "$out/$suite.txt"
done

# The Hopper kernel is opt-in until it has passed here: run the main suite again through it.
TP_GEMM_KERNEL=wgmma "$here/gpu-tests" --test-threads=1 > "$out/gpu-tests-wgmma.txt" 2>&1
echo $? > "$out/gpu-tests-wgmma.rc"
echo "== gpu-tests with TP_GEMM_KERNEL=wgmma (exit $(cat "$out/gpu-tests-wgmma.rc"))"
tail -n 5 "$out/gpu-tests-wgmma.txt"

"$here/tp-bench" --quick --out "$out" > "$out/bench.txt" 2>&1
echo $? > "$out/bench.rc"
cat "$out/bench.txt"
"$here/tp-comm-bench" --max-bytes 1073741824 > "$out/comm-bench.txt" 2>&1
echo $? > "$out/comm-bench.rc"
tail -n 3 "$out/comm-bench.txt"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$out/gpu.csv" 2>&1
fi
