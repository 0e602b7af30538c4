#!/usr/bin/env python3
"""ZeRO-1's memory: `tp train` on the SmolLM2-135M shape (random weights, made by train_bench.py's
builder) as 2 processes under mpirun at data parallelism 2, with the distributed optimizer
(`--zero 1`) and without, bf16 and f32. Reports each process's optimizer state (the log's
optimizer_bytes, rank 0) and peak resident memory (GNU time's maximum RSS per process), and the
ratio, as JSON under benches/results/.

Usage: python3 benches/reference/zero_bench.py [--work DIR] [--layers 30] [--steps 2]
(needs torch and transformers for the model folder, Open MPI's mpirun, and a release build of tp)."""
import argparse, json, os, platform, re, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_bench  # noqa: E402  (the model and data builders)


def run(tp, model, data, out, zero, dtype, steps, work):
    log = os.path.join(work, f"zero{zero}-{dtype}.jsonl")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "/usr/bin/time", "-f", "maxrss_kib %M",
           tp, "train", model, "--data", data, "--backend", "mpi", "-dp", "2", "--zero", str(zero), "--dtype", dtype,
           "--steps", str(steps), "--micro-batch-size", "1", "--grad-accum", "1", "--seq-len", "256",
           "--log-json", log]
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"tp train failed:\n{p.stdout}\n{p.stderr[-3000:]}")
    rss = [int(x) for x in re.findall(r"maxrss_kib (\d+)", p.stderr)]
    lines = [json.loads(l) for l in open(log)]
    return {"zero": zero, "dtype": dtype, "optimizer_mib_rank0": lines[-1]["optimizer_bytes"] / 2**20,
            "peak_rss_mib_per_process": [r / 1024 for r in rss], "seconds": time.time() - t,
            "loss": [l["loss"] for l in lines]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/tp-zero-bench")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", default=os.path.join(HERE, "../../target/release/tp"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    dirs = train_bench.build_models(a.work, a.layers)
    data = train_bench.build_data(a.work, 256, 64)
    rows = []
    for dtype in ["bf16", "f32"]:
        for zero in [0, 1]:
            r = run(os.path.abspath(a.tp), dirs["bf16" if dtype == "bf16" else "f32"], data, a.work, zero, dtype,
                    a.steps, a.work)
            print(json.dumps(r), flush=True)
            rows.append(r)
        base, shared = rows[-2], rows[-1]
        assert base["loss"] == shared["loss"], f"{dtype}: ZeRO-1 changed the losses"
        print(f"{dtype}: optimizer state per rank {shared['optimizer_mib_rank0']:.0f} vs "
              f"{base['optimizer_mib_rank0']:.0f} MiB = {shared['optimizer_mib_rank0'] / base['optimizer_mib_rank0']:.3f}x; "
              f"peak RSS {max(shared['peak_rss_mib_per_process']):.0f} vs {max(base['peak_rss_mib_per_process']):.0f} MiB",
              flush=True)
    cpu = train_bench.machine() if hasattr(train_bench, "machine") else platform.processor()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": cpu, "shape": f"SmolLM2-135M, {a.layers} layers",
              "layout": "mpirun -np 2, -dp 2", "rows": rows}
    out = a.out or os.path.join(HERE, f"../results/zero1-memory-{result['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
