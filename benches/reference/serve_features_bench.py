"""Structured outputs and n-gram speculation of `tp serve`, each beside the same server without the
feature, in one run, on one machine, one server at a time.

What it does, in order:

1. Model (built once, cached under --work, default target/features-bench/): the TinyLlama-shaped
   random bf16 checkpoint of `tp-bench --write-model` (22 layers, hidden 2048, vocab 32000), with
   a byte-level BPE tokenizer of 32000 tokens trained by the `tokenizers` package on the Python
   standard library's source (so JSON, identifiers and whitespace tokenize as in a real code-aware
   tokenizer: merges of several bytes, many tokens that start with a quote or a brace), `<unk>`,
   `<s>`, `</s>` as ids 0-2 (`</s>` is the checkpoint's end-of-sequence id), and a small chat
   template.
2. Structured outputs: two servers in turn, the same flags; --clients concurrent clients (default
   8), each sending chat requests back to back, every request with its own seed, max_tokens 128,
   temperature 1. The constrained server's requests carry vLLM's `structured_outputs: {"json":
   SCHEMA, "disable_any_whitespace": true}` (an object of a nested object, bounded strings, a
   pattern, an enum, an integer range and a bounded array; no free whitespace, so a random
   model's answers can finish); the other's carry none and `ignore_eos` (so neither side stops
   early by chance). Output tokens/s = the server's `tp_generation_tokens_total` over a window of
   --seconds (default 60) once every client is decoding. The mask time per token is read from
   the constrained server's `tp_structured_output_mask_seconds` histogram (p50 and p99
   interpolated within buckets of a 1-2-5 ladder); answers that finished must parse.
3. Speculation (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
   "prompt_lookup_max": 4, "prompt_lookup_min": 2}'`) beside the same server without it, one
   client (speculation helps single streams), --spec-requests requests of 128 tokens each:
   (a) a prompt asking to repeat a passage, greedy (a random model does not copy: whatever
   acceptance there is comes from runs in its own output); (b) forced repetition (a logit_bias
   of +100 on one id, greedy: every draft holds, the mechanism's ceiling); (c) a prompt the
   answer does not copy: seeded sampling at temperature 1, where drafts are rarely right.
4. Copying, on a model that copies: the same checkpoint with every attention output and MLP down
   projection zeroed (WORK/model-bigram/: each position then sees only its own token, a bigram
   model at the full model's cost per token). Its greedy path from a start token falls into a
   cycle; the prompt holds the path and the cycle twice, and the answer goes on around the cycle,
   copying the prompt (checked). Speculation beside the same server without it, one client,
   --spec-requests requests of 128 tokens; needs torch and safetensors to write the folder. Tokens/s each, the ratio, and the drafted and accepted
   tokens from /metrics. The answers of both servers are compared (they must be equal).

Printed, and written as JSON to --out (default benches/results/serve_features-<date>.json), with
the date, CPU model, AMX flags, commit and load average before each side.

Needs `tokenizers` and `httpx` (pip); not part of CI. Build first:
  cargo build --release -p tp-cli -p tp-benches

usage: python3 benches/reference/serve_features_bench.py [--clients N] [--seconds S]
         [--spec-requests N] [--threads T] [--work DIR] [--out FILE]
"""

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import subprocess
import sys
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP = os.path.join(ROOT, "target/release/tp")
TP_BENCH = os.path.join(ROOT, "target/release/tp-bench")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["tool", "food", "place", "animal"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                  "required": ["city", "zip"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 4},
    },
    "required": ["name", "kind", "count", "where", "scores"],
    "additionalProperties": False,
}

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def model_dir(work):
    d = os.path.join(work, "model")
    if os.path.exists(os.path.join(d, "tokenizer.json")):
        return d
    src = subprocess.run([TP_BENCH, "--write-model"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip().splitlines()[-1]
    src = os.path.join(ROOT, src)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f.endswith(".json") and f != "tp-synthetic.json":
            target = os.path.join(d, f)
            if not os.path.exists(target):
                os.symlink(os.path.join(src, f), target)
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(lib, "**/*.py"), recursive=True))[:3000]

    def texts():
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    yield fh.read()
            except (UnicodeDecodeError, OSError):
                continue
    tok.train_from_iterator(texts(), trainer)
    check(tok.get_vocab_size() == 32000, f"the trained tokenizer has {tok.get_vocab_size()} tokens")
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}, f)
    return d


def bigram_dir(work, base):
    """The same checkpoint with every attention output and MLP down projection zeroed: each
    position's residual stream is then its own token's embedding, so the model is a bigram model
    (the next token a fixed function of the current one) at the full model's cost per token. Its
    greedy text follows that function into a cycle, so a prompt holding the cycle is text the
    answer copies from."""
    d = os.path.join(work, "model-bigram")
    if os.path.exists(os.path.join(d, "tokenizer.json")):
        return d
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(d, exist_ok=True)
    for f in sorted(os.listdir(base)):
        src = os.path.join(base, f)
        if f.endswith(".safetensors"):
            tensors = load_file(src)
            for k, v in tensors.items():
                if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                    tensors[k] = torch.zeros_like(v)
            save_file(tensors, os.path.join(d, f), metadata={"format": "pt"})
        elif f.endswith(".json"):
            with open(src) as a, open(os.path.join(d, f), "w") as b:
                b.write(a.read())
    return d


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


class Server:
    def __init__(self, model, extra, threads):
        env = dict(os.environ, TP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([TP, "serve", model, "--port", "0", "--served-model-name", "m"] + extra,
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        deadline = time.time() + 600
        self.base = None
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise SystemExit(f"tp serve exited: {self.proc.wait()}")
            if "listening on http://" in line:
                self.base = "http://" + line.split("listening on http://")[1].strip()
                break
        check(self.base, "tp serve did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        self.http = httpx.Client(timeout=600)

    def post(self, path, body):
        r = self.http.post(self.base + path, json=body)
        check(r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}")
        return r.json()

    def metrics(self):
        return self.http.get(self.base + "/metrics").text

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def histogram_quantiles(text, name, qs):
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1] if buckets else 0
    out = []
    for q in qs:
        want, prev_le, prev_n = q * total, 0.0, 0.0
        for le, n in buckets:
            if n >= want:
                frac = 0 if n == prev_n else (want - prev_n) / (n - prev_n)
                out.append(prev_le + frac * ((le if le != float("inf") else prev_le) - prev_le))
                break
            prev_le, prev_n = le, n
    return out, total


def counter(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def load_average():
    return os.getloadavg()[0]


def closed_loop(server, clients, seconds, body_of):
    """Clients sending back to back; output tokens/s over a window of `seconds` read from the
    server's own `tp_generation_tokens_total` (so partly generated answers count), and the
    requests that finished inside the window."""
    results = []
    stop = threading.Event()

    def client(c):
        i, done = 0, []
        while not stop.is_set():
            r = server.post("/v1/chat/completions", body_of(c, i))
            if not stop.is_set():
                done.append(r)
            i += 1
        return done

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, c) for c in range(clients)]
        time.sleep(min(10.0, seconds / 4))  # every client's first request admitted and decoding
        t0, n0 = time.time(), counter(server.metrics(), "tp_generation_tokens_total")
        time.sleep(seconds)
        t1, n1 = time.time(), counter(server.metrics(), "tp_generation_tokens_total")
        stop.set()
        for f in futures:
            results.extend(f.result())
    return (n1 - n0) / (t1 - t0), results


def structured(model, args):
    rows = {}
    for side in ["unconstrained", "constrained"]:
        load = load_average()
        s = Server(model, [], args.threads)
        try:
            def body(c, i, side=side):
                b = {"model": "m", "messages": [{"role": "user", "content": f"Describe thing {c}-{i} as JSON."}],
                     "max_tokens": 128, "seed": c * 1000 + i}
                if side == "constrained":
                    b["structured_outputs"] = {"json": SCHEMA, "disable_any_whitespace": True}
                else:
                    b["ignore_eos"] = True
                return b
            s.post("/v1/chat/completions", body(99, 0))  # warm-up
            tps, results = closed_loop(s, args.clients, args.seconds, body)
            row = {"tokens_per_s": tps, "requests": len(results), "load_before": load}
            if side == "constrained":
                (p50, p99), n = histogram_quantiles(s.metrics(), "tp_structured_output_mask_seconds", [0.5, 0.99])
                finished = [r for r in results if r["choices"][0]["finish_reason"] == "stop"]
                parsed = 0
                for r in finished:
                    json.loads(r["choices"][0]["message"]["content"])
                    parsed += 1
                row.update({"mask_p50_us": p50 * 1e6, "mask_p99_us": p99 * 1e6, "masks": n,
                            "finished_and_parsed": parsed, "cut_by_max_tokens": len(results) - len(finished)})
                check(parsed == len(finished), "a finished constrained answer did not parse")
            rows[side] = row
        finally:
            s.stop()
    rows["ratio"] = rows["constrained"]["tokens_per_s"] / rows["unconstrained"]["tokens_per_s"]
    return rows


def copy_case(model, args):
    """n-gram speculation on text the answer copies, on the bigram model: its greedy path from a
    start token runs into a cycle; the prompt is the path and the cycle twice, and the greedy
    answer goes on around the cycle, copying the prompt. Each side gets the same requests."""
    s = Server(model, [], args.threads)
    try:
        r = s.post("/v1/completions", {"prompt": [1, 500], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True})
    finally:
        s.stop()
    seq = [1, 500] + r["choices"][0]["token_ids"]
    first = {}
    start = period = None
    for j, t in enumerate(seq):
        if t in first:
            start, period = first[t], j - first[t]
            break
        first[t] = j
    check(period is not None, "the bigram model's greedy path did not cycle within 1000 tokens")
    prompt = seq[: start + 2 * period]
    check(len(prompt) + 128 <= 2048, f"a prompt of {len(prompt)} tokens leaves no room for the answer")
    out = {"cycle_length": period, "prompt_tokens": len(prompt)}
    texts = {}
    for side, extra in [("plain", []), ("ngram", ["--speculative-config", SPEC])]:
        load = load_average()
        srv = Server(model, extra, args.threads)
        try:
            srv.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 4})
            before = srv.metrics()
            t0, tokens, got = time.time(), 0, []
            for _ in range(args.spec_requests):
                a = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 128, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
                tokens += a["usage"]["completion_tokens"]
                got.append(a["choices"][0]["token_ids"])
            wall = time.time() - t0
            after = srv.metrics()
            out[side] = {"tokens_per_s": tokens / wall, "load_before": load,
                         "drafted": counter(after, "tp_spec_decode_num_draft_tokens_total")
                         - counter(before, "tp_spec_decode_num_draft_tokens_total"),
                         "accepted": counter(after, "tp_spec_decode_num_accepted_tokens_total")
                         - counter(before, "tp_spec_decode_num_accepted_tokens_total")}
            texts[side] = got
        finally:
            srv.stop()
    out["ratio"] = out["ngram"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    out["same_answers"] = texts["plain"] == texts["ngram"]
    # The answer copies the prompt: it goes on around the cycle.
    cycle = prompt[start:start + period]
    out["answer_copies_prompt"] = all(t == cycle[(len(prompt) - start + i) % period] for i, t in enumerate(texts["plain"][0]))
    return out


def speculation(model, args):
    passage = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 3).strip()
    cases = {
        "copies": lambda i: {"messages": [{"role": "user", "content": f"Repeat exactly: {passage} ({i})"}],
                             "temperature": 0},
        # The mechanism's ceiling: a bias makes every greedy token the same, so every draft holds.
        "forced_repeat": lambda i: {"messages": [{"role": "user", "content": f"Say one word, again and again ({i})."}],
                                    "temperature": 0, "logit_bias": {"400": 100}},
        "does_not_copy": lambda i: {"messages": [{"role": "user", "content": f"Write anything, number {i}."}],
                                    "temperature": 1.0, "seed": i},
    }
    out = {}
    answers = {}
    for side, extra in [("plain", []), ("ngram", ["--speculative-config", SPEC])]:
        load = load_average()
        s = Server(model, extra, args.threads)
        try:
            s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm"}], "max_tokens": 4})
            for case, make in cases.items():
                before = s.metrics()
                start = time.time()
                tokens, texts = 0, []
                for i in range(args.spec_requests):
                    body = dict(make(i), model="m", max_tokens=128, ignore_eos=True)
                    r = s.post("/v1/chat/completions", body)
                    tokens += r["usage"]["completion_tokens"]
                    texts.append(r["choices"][0]["message"]["content"])
                wall = time.time() - start
                after = s.metrics()
                drafted = counter(after, "tp_spec_decode_num_draft_tokens_total") - counter(
                    before, "tp_spec_decode_num_draft_tokens_total")
                accepted = counter(after, "tp_spec_decode_num_accepted_tokens_total") - counter(
                    before, "tp_spec_decode_num_accepted_tokens_total")
                out.setdefault(case, {})[side] = {"tokens_per_s": tokens / wall, "drafted": drafted,
                                                  "accepted": accepted, "load_before": load}
                answers.setdefault(case, {})[side] = texts
        finally:
            s.stop()
    for case in cases:
        out[case]["ratio"] = out[case]["ngram"]["tokens_per_s"] / out[case]["plain"]["tokens_per_s"]
        out[case]["same_answers"] = answers[case]["plain"] == answers[case]["ngram"]
    return out


def machine():
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    flags = open("/proc/cpuinfo").read()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"date": datetime.date.today().isoformat(), "cpu": model, "cores": os.cpu_count(),
            "amx": "amx_tile" in flags, "commit": commit + ("-dirty" if dirty else "")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--spec-requests", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=os.path.join(ROOT, "target/features-bench"))
    p.add_argument("--out", default=None)
    p.add_argument("--only", choices=["structured", "speculation", "copy"], default=None)
    args = p.parse_args()
    for b in [TP, TP_BENCH]:
        check(os.path.exists(b), f"{b} missing: cargo build --release -p tp-cli -p tp-benches")
    model = model_dir(args.work)
    result = {"machine": machine(), "args": vars(args)}
    if args.only in (None, "structured"):
        result["structured"] = structured(model, args)
        st = result["structured"]
        print(f"structured outputs, {args.clients} clients: unconstrained {st['unconstrained']['tokens_per_s']:.1f} "
              f"tok/s, constrained {st['constrained']['tokens_per_s']:.1f} tok/s ({st['ratio']:.2f}x); mask p50 "
              f"{st['constrained']['mask_p50_us']:.0f} us, p99 {st['constrained']['mask_p99_us']:.0f} us; "
              f"{st['constrained']['finished_and_parsed']} answers finished and parsed, "
              f"{st['constrained']['cut_by_max_tokens']} cut by max_tokens")
    if args.only in (None, "speculation"):
        result["speculation"] = speculation(model, args)
        for case, r in result["speculation"].items():
            print(f"ngram speculation, {case}: plain {r['plain']['tokens_per_s']:.2f} tok/s, ngram "
                  f"{r['ngram']['tokens_per_s']:.2f} tok/s ({r['ratio']:.2f}x), {r['ngram']['accepted']:.0f} of "
                  f"{r['ngram']['drafted']:.0f} drafted accepted, same answers: {r['same_answers']}")
    if args.only in (None, "copy"):
        bigram = bigram_dir(args.work, model)
        r = copy_case(bigram, args)
        result["copy"] = r
        print(f"ngram speculation, bigram model copying its prompt (cycle of {r['cycle_length']}): plain "
              f"{r['plain']['tokens_per_s']:.2f} tok/s, ngram {r['ngram']['tokens_per_s']:.2f} tok/s "
              f"({r['ratio']:.2f}x), {r['ngram']['accepted']:.0f} of {r['ngram']['drafted']:.0f} drafted accepted, "
              f"same answers: {r['same_answers']}, answer copies the prompt: {r['answer_copies_prompt']}")
    print(json.dumps(result["machine"]))
    out = args.out or os.path.join(ROOT, f"benches/results/serve_features-{result['machine']['date']}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
