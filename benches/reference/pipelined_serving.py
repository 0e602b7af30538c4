#!/usr/bin/env python3
"""Pipelined serving beside stages taking turns: `tp serve -pp 2 --backend mpi` as two processes
under mpirun, each bound to one core, on a TinyLlama-shaped bf16 model (hidden 2048, 32 heads
over 4 KV heads, MLP 5632; 8 layers, random weights, a byte-level tokenizer), 16 concurrent
greedy streams of 64 tokens each; once with pipelined steps (the default) and once with
TP_PIPELINE_TURNS=1 (one step at a time). Output tokens per second of each, and the ratio, as
JSON under benches/results/.

Usage: python3 benches/reference/pipelined_serving.py --tokenizer-from DIR [--layers 8]
[--streams 16] [--tokens 64] (DIR: a folder with tokenizer.json and tokenizer_config.json, e.g.
one a tp-cli test wrote; needs torch and transformers, Open MPI, and a release build of tp)."""
import argparse, concurrent.futures, json, os, re, shutil, subprocess, sys, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def build(work, layers, tok_dir):
    d = os.path.join(work, f"tinyllama-L{layers}-bf16")
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=1001, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tok_dir, f), d)
    return d


def serve_and_load(tp, model, streams, tokens, turns):
    env = dict(os.environ)
    cmd = ["mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "core", "--map-by", "core"]
    if turns:
        cmd += ["-x", "TP_PIPELINE_TURNS=1"]
        env["TP_PIPELINE_TURNS"] = "1"
    else:
        env.pop("TP_PIPELINE_TURNS", None)
    cmd += [tp, "serve", model, "--port", "0", "--backend", "mpi", "-pp", "2", "--batch-invariant"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    addr = None
    deadline = time.time() + 300
    while time.time() < deadline:
        line = p.stderr.readline()
        m = re.search(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
            break
    if not addr:
        p.kill()
        sys.exit("the server did not start")

    def one(i):
        body = json.dumps({"prompt": f"request {i}: hello", "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://{addr}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            v = json.load(r)
        return v["usage"]["completion_tokens"], v["choices"][0]["text"]

    one(-1)  # warm-up
    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(streams) as ex:
        outs = list(ex.map(one, range(streams)))
    wall = time.time() - t
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    p.terminate()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
    busy = [float(x) for x in re.findall(r'tp_stage_busy_seconds_total\{[^}]*stage="\d+"\} (\S+)', metrics)]
    toks = sum(n for n, _ in outs)
    return {"turns": turns, "output_tokens": toks, "seconds": wall, "tokens_per_s": toks / wall,
            "texts": [t for _, t in outs], "stage0_busy_s": busy[0] if busy else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/tp-pp-bench")
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tp", default=os.path.join(HERE, "../../target/release/tp"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    model = build(a.work, a.layers, a.tokenizer_from)
    turns = serve_and_load(os.path.abspath(a.tp), model, a.streams, a.tokens, True)
    piped = serve_and_load(os.path.abspath(a.tp), model, a.streams, a.tokens, False)
    same = turns["texts"] == piped["texts"]
    for r in (turns, piped):
        print(f"{'turns' if r['turns'] else 'pipelined'}: {r['output_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:.1f} tokens/s", flush=True)
    ratio = piped["tokens_per_s"] / turns["tokens_per_s"]
    print(f"pipelined / turns = {ratio:.2f}x; the same texts: {same}")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    out = os.path.join(HERE, f"../results/pipelined-serving-{time.strftime('%Y-%m-%d')}.json")
    for r in (turns, piped):
        r.pop("texts")
    json.dump({"date": time.strftime("%Y-%m-%d"), "cpu": model_name, "layout": "mpirun -np 2 --bind-to core, -pp 2",
               "model": f"TinyLlama-shaped bf16, {a.layers} layers, random weights", "streams": a.streams,
               "tokens_per_stream": a.tokens, "turns": turns, "pipelined": piped, "ratio": ratio,
               "same_texts": same}, open(out, "w"), indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
