#!/usr/bin/env python3
"""`tp serve` beside llama.cpp's `llama-server` on the same GGUF file, under an outside load
generator (guidellm, the vLLM project's benchmark tool): synthetic prompts of exactly --prompt
tokens, exactly --output tokens asked for (max_tokens, ignore_eos), closed-loop concurrency
(each of N streams sends its next request when the last one finished), one server at a time.

    load_vs_llama_server.py --tp target/release/tp --llama-server PATH --guidellm PATH
        [--gguf FILE] [--streams 1,4,16,64] [--prompt 128] [--output 64] [--requests 32]
        [--threads 2] [--out benches/results/load-DATE.json]

* --gguf: the file both serve. Default: the TinyLlama-shaped bench checkpoint (`tp-bench
  --write-model`) written as a Q4_K_M-typed file (Q6_K for attn_v, ffn_down and output, Q4_K
  elsewhere; random K-quant blocks) by crates/tp-testing/gguf/write_gguf.py with a
  SentencePiece vocabulary that has "\u2581" as a piece (`--tokenizer spm-space`), so that
  llama.cpp, transformers and tp split the prompts into the same tokens (checked: the script
  compares both servers' /tokenize on a sample and stops if they differ).
* The tokenizer guidellm counts with is the file's own, converted by transformers
  (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
* llama-server runs with `-np` slots = the concurrency, `-t` threads, a context of 1024
  positions per slot, continuous batching (its default); tp serve with its defaults (plus
  --tp-args) and `--served-model-name m`, with `TP_NUM_THREADS` = --threads.

Prints one row per server and concurrency (output tokens/s, TTFT p50/p90, ITL p50) and the
ratios tp / llama-server; writes everything, with the machine and versions, to --out.
"""

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def post(url, body):
    r = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=60) as resp:
        return json.loads(resp.read())


def wait_healthy(url, proc, deadline_s=300):
    end = time.time() + deadline_s
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} was not ready within {deadline_s} s")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def guidellm(binary, url, tokenizer, out, streams, prompt, output, requests):
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": "m", "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": prompt, "output_tokens": output}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "constraints": [{"kind": "max_requests", "count": max(requests, streams)}],
        },
        "benchmarks": [{"profile.streams": streams}],
    }
    with tempfile.TemporaryDirectory() as d:
        sp = Path(d) / "scenario.json"
        sp.write_text(json.dumps(scenario))
        p = subprocess.run(
            [binary, "run", "--scenario", str(sp), "--output", f"kind=json,path={out}", "--disable-console-interactive"],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            sys.exit(f"guidellm failed ({p.returncode}): {(p.stderr or p.stdout)[-2000:]}")
    b = json.loads(Path(out).read_text())["benchmarks"][0]
    m = b["metrics"]
    toks = m["output_token_count"]["successful"]["total_sum"]
    dur = b.get("duration") or 1e-9
    return {
        "streams": streams,
        "ok": m["request_latency"]["successful"]["count"],
        "errored": m["request_latency"]["errored"]["count"],
        "output_tokens_per_s": toks / dur,
        "ttft_p50_ms": m["time_to_first_token_ms"]["successful"]["percentiles"]["p50"],
        "ttft_p90_ms": m["time_to_first_token_ms"]["successful"]["percentiles"]["p90"],
        "itl_p50_ms": m["inter_token_latency_ms"]["successful"]["percentiles"]["p50"],
    }


def make_gguf(path):
    model = ROOT / "target/bench-model/tinyllama-bf16"
    if not model.is_dir():
        sys.exit(f"{model} is missing: run `target/release/tp-bench --write-model` first")
    script = ROOT / "crates/tp-testing/gguf/write_gguf.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, str(script), str(model), str(path), "--type", "MIXED_K", "--tokenizer", "spm-space"],
        check=True,
    )


def make_tokenizer(gguf, out):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    t.save_pretrained(str(out))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--tp", default=str(ROOT / "target/release/tp"))
    a.add_argument("--llama-server", required=True)
    a.add_argument("--guidellm", required=True, help="the guidellm executable (pip install guidellm==0.8.1)")
    a.add_argument("--gguf", default=str(ROOT / "target/load-bench/tinyllama-q4km.gguf"))
    a.add_argument("--streams", default="1,4,16,64")
    a.add_argument("--prompt", type=int, default=128)
    a.add_argument("--output", type=int, default=64)
    a.add_argument("--requests", type=int, default=32)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--only", choices=["tp", "llama"], help="run one server only")
    a.add_argument("--tp-args", default="", help="more flags for tp serve")
    a.add_argument("--out", default=str(ROOT / f"benches/results/load-{datetime.date.today()}.json"))
    o = a.parse_args()
    gguf = Path(o.gguf)
    if not gguf.exists():
        make_gguf(gguf)
    tok = gguf.parent / (gguf.stem + "-tokenizer")
    if not (tok / "tokenizer.json").exists():
        make_tokenizer(gguf, tok)
    streams = [int(s) for s in o.streams.split(",")]
    servers = {
        "tp": lambda n: [o.tp, "serve", str(gguf), "--port", "8190", "--served-model-name", "m", *o.tp_args.split()],
        "llama": lambda n: [o.llama_server, "-m", str(gguf), "--port", "8191", "-t", str(o.threads), "-np", str(n),
                            "-c", str(1024 * n), "--log-disable"],
    }
    ports = {"tp": 8190, "llama": 8191}
    results = {"tp": [], "llama": []}
    sample = "It was the best of times, it was the worst of times; 42 \"quotes\" and UPPER words: naive cafe."
    tokens = {}
    for name in ["tp", "llama"]:
        if o.only and o.only != name:
            continue
        for n in streams:
            env = dict(os.environ)
            if name == "tp":
                env["TP_NUM_THREADS"] = str(o.threads)
            log = open(Path(tempfile.gettempdir()) / f"load-{name}-{n}.log", "w")
            proc = subprocess.Popen(servers[name](n), stdout=log, stderr=subprocess.STDOUT, env=env)
            url = f"http://127.0.0.1:{ports[name]}"
            try:
                wait_healthy(url, proc)
                if name not in tokens:
                    body = {"content": sample} if name == "llama" else {"model": "m", "prompt": sample,
                                                                         "add_special_tokens": False}
                    tokens[name] = post(url + "/tokenize", body)["tokens"]
                with tempfile.TemporaryDirectory() as d:
                    r = guidellm(o.guidellm, url, tok, Path(d) / "out.json", n, o.prompt, o.output, o.requests)
            finally:
                stop(proc)
            results[name].append(r)
            print(f"{name:>6} {n:>4} streams: {r['output_tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.0f} ms"
                  f"  p90 {r['ttft_p90_ms']:8.0f} ms  ITL p50 {r['itl_p50_ms']:7.1f} ms  ({r['ok']} ok, "
                  f"{r['errored']} errors)", flush=True)
    if "tp" in tokens and "llama" in tokens and tokens["tp"] != tokens["llama"]:
        sys.exit(f"the servers tokenize differently ({len(tokens['tp'])} vs {len(tokens['llama'])} tokens): "
                 "the comparison would not be of the same work")
    if results["tp"] and results["llama"]:
        print("\nstreams  tok/s ratio  TTFT p50 ratio  ITL p50 ratio   (tp / llama-server)")
        for t, l in zip(results["tp"], results["llama"]):
            print(f"{t['streams']:>7}  {t['output_tokens_per_s'] / l['output_tokens_per_s']:11.2f}x"
                  f"  {t['ttft_p50_ms'] / l['ttft_p50_ms']:13.2f}x  {t['itl_p50_ms'] / l['itl_p50_ms']:12.2f}x")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    doc = {
        "date": str(datetime.date.today()),
        "machine": {"cpu": cpu, "threads": o.threads, "flags_amx": "amx_tile" in open("/proc/cpuinfo").read(),
                    "platform": platform.platform()},
        "gguf": str(gguf),
        "workload": {"prompt_tokens": o.prompt, "output_tokens": o.output, "requests": o.requests,
                     "profile": "concurrent (closed loop)", "generator": "guidellm 0.8.1"},
        "tp_args": o.tp_args,
        "results": results,
    }
    Path(o.out).parent.mkdir(parents=True, exist_ok=True)
    Path(o.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {o.out}")


if __name__ == "__main__":
    main()
