"""`tp serve`'s prompt logprobs (`echo` with `logprobs`, `max_tokens: 0`; and `prompt_logprobs`)
against transformers' log-softmax of the same prompt, in float32.

It serves a model folder with `tp serve --dtype f32` (TP 1 and TP 2, one after the other), sends
prompts as lm-evaluation-harness's log-likelihood requests do (`echo: true, logprobs: 1,
max_tokens: 0`, token ids as the prompt), and compares every prompt token's logprob, its rank
and the top alternative with `torch.log_softmax(model(ids).logits.float(), -1)` from
`AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)` on the same ids. Prints the
largest absolute difference and writes a JSON record to --out. Ranks must agree up to the
number of ids whose logprob is within 1e-4 of the token's (near ties fall either way).

Default folder: target/features-bench/model (benches/reference/serve_features_bench.py builds
it: a TinyLlama-shaped random bf16 checkpoint with a trained byte-level BPE tokenizer).

Needs torch, transformers and httpx (serve_features_bench.py's `Server` runs tp serve); not part of CI. Build first: cargo build --release -p tp-cli
usage: python3 benches/reference/echo_vs_transformers.py [--model DIR] [--out FILE]
"""

import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_features_bench import Server  # noqa: E402  (its tp serve process, started and stopped)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "target/features-bench/model"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompts = [[1] + [int(x) for x in torch.randint(3, min(vocab, 32000), (n,))] for n in (7, 33, 120)]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    want = []
    with torch.no_grad():
        for ids in prompts:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            rows = []
            for p in range(1, len(ids)):
                row = lp[p - 1]
                t = ids[p]
                # Ids within 1e-4 of the token's logprob: a rank may differ by as many (near ties
                # fall either way under another summation order).
                close = int(((row - row[t]).abs() < 1e-4).sum()) - 1
                rows.append((float(row[t]), int((row >= row[t]).sum()), int(row.argmax()), close))
            want.append(rows)
    record = {"date": datetime.date.today().isoformat(), "model": args.model, "cases": []}
    for tp in (1, 2):
        server = Server(args.model, ["--dtype", "f32", "-tp", str(tp)], threads=2)
        try:
            worst = 0.0
            for ids, w in zip(prompts, want):
                r = server.post("/v1/completions", {
                    "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "prompt_logprobs": 1})
                c = r["choices"][0]
                got = c["logprobs"]["token_logprobs"]
                assert got[0] is None, got[:2]
                for p in range(1, len(ids)):
                    worst = max(worst, abs(got[p] - w[p - 1][0]))
                    d = c["prompt_logprobs"][p]
                    assert abs(d[str(ids[p])]["rank"] - w[p - 1][1]) <= w[p - 1][3], (p, d, w[p - 1])
                    top = [k for k, v in d.items() if v["rank"] == 1]
                    assert int(top[0]) == w[p - 1][2] or w[p - 1][1] == 1, (p, d, w[p - 1])
            print(f"TP {tp}: {sum(len(i) - 1 for i in prompts)} prompt logprobs, largest |tp - transformers| = {worst:.2e}")
            record["cases"].append({"tp": tp, "max_abs_diff": worst})
        finally:
            server.stop()
    out = args.out or os.path.join(ROOT, f"benches/results/echo_vs_transformers-{record['date']}.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
