"""Training throughput of `tp train` beside torch, on the same model, data and threads, in one run.

What it does, in order:

1. Model (built once, cached under --work, default target/train-bench/): a random model shaped as
   SmolLM2-135M, made with transformers' own LlamaConfig / LlamaForCausalLM (hidden 576,
   intermediate 1536, 30 layers, 9 heads, 3 KV heads, head_dim 64, vocab 49152, tied embeddings,
   rope_theta 100000, max_position_embeddings 2048, rms_norm_eps 1e-5; torch.manual_seed(0) and
   transformers' init), saved with `save_pretrained` twice: in float32 (WORK/model-L<layers>-f32/)
   and in bfloat16 (WORK/model-L<layers>-bf16/, the same weights rounded). `--layers N` makes the
   model shallower (a quick smoke run); a folder is reused when its config.json is already there.
2. Data: WORK/data-s<seq>-r<rows>.jsonl, random token rows of exactly --seq ids (seed 0), labels =
   input_ids (unshifted, as transformers; every position but the last is a target), as many rows
   as --steps x --micro-batch need. Both sides read the same rows in the same order.
3. torch (in a child process of this script, so its peak RSS is its own, read with os.wait4):
   OMP_NUM_THREADS / MKL_NUM_THREADS = T and torch.set_num_threads(T);
   AutoModelForCausalLM.from_pretrained(folder, dtype=float32 | bfloat16, attn_implementation=
   "sdpa"), model.train(), use_cache off. Each step: the next B rows as one [B, seq] batch,
   `model(input_ids, labels=labels, num_items_in_batch=N).loss` (N = the batch's target tokens,
   so the loss is sum(CE) / N, as tp's), backward, clip_grad_norm_(1.0), torch.optim.AdamW
   (lr 1e-4, betas 0.9/0.999, eps 1e-8, fused=False, foreach left at its CPU default; weight
   decay --weight-decay, default 0 as tp's default, on 2-D+ params only), zero_grad. The forward,
   the backward and clip+optimizer are timed separately (CPU torch is synchronous). After the
   training steps, --fwd-steps forward passes of the same batch shape under torch.no_grad
   (one untimed first) give the backward/forward ratio.
   bf16: the bf16 checkpoint is loaded as bf16 and trained as is (bf16 weights, bf16 AdamW state,
   as a user calling .to(torch.bfloat16) gets); tp in bf16 keeps fp32 master weights and
   optimizer state, so it does more optimizer work and holds more memory than this torch baseline.
4. tp: `TP_BIN train FOLDER --data FILE --tensor-parallel-size N --dtype D --seq-len SEQ
   --micro-batch-size B --grad-accum 1 --steps S --lr 1e-4 --lr-schedule constant --weight-decay W
   --log-json LOG` with TP_NUM_THREADS=T (tp-cpu's host pool, caller included; with TP 2 both rank
   threads share those T pool threads, and a rank whose pool is busy runs its kernels inline), for
   each --tp-sizes (default 1,2). `--lr-schedule constant` only matches torch's constant lr (tp's
   default is linear decay); it costs nothing. Peak RSS from os.wait4 on the child.
5. Throughput, both sides: tokens/s = B * seq * (steps - warmup) / (time of steps warmup+1..steps);
   for tp that time is elapsed_s[last] - elapsed_s[warmup] from --log-json (tp's elapsed_s clock
   starts before its ranks load the weights, so step 1's elapsed_s includes the load; the first
   --warmup steps are dropped anyway). tokens counts input tokens (B * seq), not target tokens.

Printed, and written as JSON to --out (default benches/results/train_bench-<date>.json; with --quick
WORK/train_bench-quick-<date>.json, so a smoke run leaves the results folder alone): per case
(f32, bf16) and side (torch, tp TP1, tp TP2): tokens/s, ratio to torch's tokens/s, peak RSS MiB,
seconds per step, cores kept busy (the child's user + system CPU seconds / its wall seconds,
loading included), step-1 loss and grad norm (same weights and rows, so they should agree: a cheap
check that both sides train the same thing), and for torch the (forward+backward)/forward and
backward/forward ratios, forward being the no_grad forward. Recorded beside: date, git commit (and
whether the tree was dirty), tp binary's mtime, CPU model (lscpu "Model name"), core count and
affinity, AMX / AVX-512 flags from /proc/cpuinfo, torch and transformers versions, load average
before the run and before each side.

Peak RSS of the torch side includes the Python interpreter with torch and transformers imported
(a few hundred MiB, recorded separately as rss_after_import_mib); tp is one native process. A
child's ru_maxrss also counts its parent's RSS at the fork (Linux keeps the old address space's
high-water mark across exec), so this parent never imports torch (the models are built in a child
too) and records that floor as rss_floor_mib (the peak RSS os.wait4 reports for /bin/true).

With --lora R both sides train LoRA adapters of rank R (lora_alpha 2R, every linear projection of the
blocks: PEFT's "all-linear", dropout 0) on the frozen model: torch through PEFT's get_peft_model (its
default autocast keeps a bf16 model's adapters in f32, as tp does), AdamW over the adapters only, the
gradient norm over them; tp with `--lora-r R --lora-alpha 2R --lora-target-modules all-linear`. A third
side, tp's full fine-tune at TP 1 on the same rows, gives the memory the adapters save (the issue's
"peak memory <= 0.6x tp's full fine-tune").

Needs torch and transformers (safetensors with them; peft for --lora); not part of CI. Build tp first:
  cargo build --release -p tp-cli

With --shape olmoe the model is instead a tiny OLMoE-shaped mixture of experts (OlmoeConfig: 64 experts,
8 per token, experts of 256 features, hidden 512, 8 heads of 64, full-width q/k norm, vocabulary 50304,
4 layers by default), trained on both sides with its load-balancing loss (output_router_logits,
router_aux_loss_coef 0.01); torch runs transformers' default experts implementation. Results go to
benches/results/train_bench-olmoe-<date>.json.

usage: python3 benches/reference/train_bench.py [--shape smollm2|olmoe] [--quick] [--layers N] [--seq L] [--micro-batch B]
           [--steps S] [--warmup W] [--threads T] [--tp-sizes 1,2] [--cases f32,bf16]
           [--fwd-steps N] [--weight-decay W] [--tp-bin PATH] [--tp-extra "ARGS"] [--work DIR]
           [--out FILE]
  --quick: layers 2, steps 4, warmup 1 (smoke test). Full run (defaults: 30 layers, seq 256,
  micro-batch 4, 6 steps of which 2 warmup, 2 threads) on a quiet machine:
    python3 benches/reference/train_bench.py
"""
import argparse
import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from importlib.metadata import version

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CASES = ("f32", "bf16")
LR = 1e-4
MAX_GRAD_NORM = 1.0


def smollm2_config(layers):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                       rope_theta=100000.0, max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu",
                       bos_token_id=0, eos_token_id=0, pad_token_id=None)


def olmoe_config(layers):
    """A tiny OLMoE-shaped mixture of experts (OLMoE-1B-7B's 64 experts, 8 per token, full-width
    q/k norm, vocabulary 50304; hidden 512, 8 heads of 64, experts of 256 features), trained with
    its load-balancing loss (output_router_logits, coefficient 0.01)."""
    from transformers import OlmoeConfig
    return OlmoeConfig(hidden_size=512, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=50304, num_experts=64, num_experts_per_tok=8,
                       norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=0.01,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=50279, pad_token_id=1)


# --shape: (config builder, model class name, default depth, vocabulary).
SHAPES = {"smollm2": (smollm2_config, "LlamaForCausalLM", 30, 49152),
          "olmoe": (olmoe_config, "OlmoeForCausalLM", 4, 50304)}


def model_dir(work, layers, case, shape="smollm2"):
    prefix = "model" if shape == "smollm2" else f"model-{shape}"
    return os.path.join(work, f"{prefix}-L{layers}-{case}")


def build_models(work, layers, shape="smollm2"):
    """The f32 and bf16 folders (cached: rebuilt only when a config.json is missing), built in a child
    process: this parent never imports torch, so that its RSS, which a child inherits into its
    ru_maxrss when it forks and execs, stays small."""
    dirs = {c: model_dir(work, layers, c, shape) for c in CASES}
    if not all(os.path.exists(os.path.join(d, "config.json")) for d in dirs.values()):
        env = dict(os.environ, HF_HUB_DISABLE_PROGRESS_BARS="1")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build-models", work, str(layers), shape],
                       check=True, env=env)
    return dirs


def build_models_worker(work, layers, shape="smollm2"):
    dirs = {c: model_dir(work, layers, c, shape) for c in CASES}
    import torch
    import transformers
    config, cls, _, _ = SHAPES[shape]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config(layers)).float()
    n = sum(p.numel() for p in model.parameters())
    print(f"building {layers}-layer {shape}-shaped model ({n / 1e6:.1f}M params) under {work}", flush=True)
    model.save_pretrained(dirs["f32"], safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(dirs["bf16"], safe_serialization=True)


def build_data(work, seq, rows, vocab=49152):
    path = os.path.join(work, f"data-s{seq}-r{rows}.jsonl" if vocab == 49152 else f"data-v{vocab}-s{seq}-r{rows}.jsonl")
    if not os.path.exists(path):
        rng = random.Random(0)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for _ in range(rows):
                ids = [rng.randrange(vocab) for _ in range(seq)]
                f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
        os.replace(tmp, path)
    return path


def mib(kib):
    return kib / 1024.0


def wait_child(cmd, env, log_path):
    """Runs cmd with stdout+stderr into log_path; returns (exit code, peak RSS MiB, wall seconds, CPU
    seconds (user + system))."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, mib(ru.ru_maxrss), time.perf_counter() - t0, ru.ru_utime + ru.ru_stime


def tail(path, n=30):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------- torch side (child process)

def vm_hwm_mib():
    """This process's peak RSS so far (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def torch_worker(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    rss_import = vm_hwm_mib()
    torch.set_num_threads(spec["threads"])
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[spec["case"]]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    load_s = time.perf_counter() - t0
    rss_load = vm_hwm_mib()
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model
        r = spec["lora"]
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear",
                                                 lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            fused=False)
    rows = []
    with open(spec["data"]) as f:
        for line in f:
            rows.append(json.loads(line))
    B, steps = spec["micro_batch"], spec["steps"]

    def batch(step):  # step from 0; wraps like tp's reader
        take = [rows[(step * B + i) % len(rows)] for i in range(B)]
        ids = torch.tensor([r["input_ids"] for r in take], dtype=torch.long)
        labels = torch.tensor([r["labels"] for r in take], dtype=torch.long)
        n = int((labels[:, 1:] != -100).sum())
        return ids, labels, n

    log = []
    for s in range(steps):
        ids, labels, n = batch(s)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        gn = torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        log.append({"step": s + 1, "loss": float(loss), "grad_norm": float(gn), "tokens": n, "fwd_s": t1 - t0,
                    "bwd_s": t2 - t1, "opt_s": t3 - t2, "step_s": t3 - t0})
        print(f"torch {spec['case']} step {s + 1}/{steps} loss {float(loss):.4f} grad_norm {float(gn):.3f} "
              f"{t3 - t0:.2f}s (fwd {t1 - t0:.2f} bwd {t2 - t1:.2f} opt {t3 - t2:.2f})", flush=True)
    rss_train = vm_hwm_mib()
    fwd_nograd = []
    with torch.no_grad():
        for s in range(spec["fwd_steps"] + 1):
            ids, labels, n = batch(s)
            t0 = time.perf_counter()
            model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
            if s > 0:  # the first is untimed
                fwd_nograd.append(time.perf_counter() - t0)
    out = {"log": log, "fwd_nograd_s": fwd_nograd, "load_s": load_s, "rss_after_import_mib": rss_import,
           "rss_after_load_mib": rss_load, "rss_after_train_mib": rss_train,
           "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "param_dtype": str(next(model.parameters()).dtype), "trainable_params": sum(p.numel() for p in trainable)}
    with open(spec["out"], "w") as f:
        json.dump(out, f)


# ---------------------------------------------------------------- the two sides, from the parent

def thread_env(threads):
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TP_NUM_THREADS"):
        env[k] = str(threads)
    return env


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def run_torch(a, case, model, data, work):
    tag = f"torch-{case}"
    spec_path, out_path, log_path = (os.path.join(work, f"{tag}.{x}") for x in ("spec.json", "out.json", "log"))
    for p in (out_path,):
        if os.path.exists(p):
            os.remove(p)
    with open(spec_path, "w") as f:
        json.dump({"case": case, "model": model, "data": data, "threads": a.threads, "micro_batch": a.micro_batch,
                   "steps": a.steps, "fwd_steps": a.fwd_steps, "weight_decay": a.weight_decay, "out": out_path,
                   "lora": a.lora}, f)
    load = os.getloadavg()
    rc, rss, wall, cpu = wait_child([sys.executable, os.path.abspath(__file__), "--torch-worker", spec_path],
                                    thread_env(a.threads), log_path)
    row = {"case": case, "side": "torch + PEFT" if a.lora else "torch", "loadavg_before": load, "peak_rss_mib": rss, "wall_s": wall, "cpu_s": cpu,
           "cores_busy": cpu / wall, "rc": rc, "log_file": log_path}
    if rc != 0 or not os.path.exists(out_path):
        row["error"] = tail(log_path)
        print(f"torch {case} failed (rc {rc}):\n{row['error']}", file=sys.stderr)
        return row
    with open(out_path) as f:
        out = json.load(f)
    timed = out["log"][a.warmup:]
    t = sum(s["step_s"] for s in timed)
    fwd, bwd, opt = (mean([s[k] for s in timed]) for k in ("fwd_s", "bwd_s", "opt_s"))
    fnog = mean(out["fwd_nograd_s"])
    row.update({"tokens_per_s": a.micro_batch * a.seq * len(timed) / t, "step_s": t / len(timed),
                "fwd_s": fwd, "bwd_s": bwd, "opt_s": opt, "fwd_nograd_s": fnog,
                "fwdbwd_over_fwd": (fwd + bwd) / fnog, "bwd_over_fwd": bwd / fnog,
                "loss1": out["log"][0]["loss"], "grad_norm1": out["log"][0]["grad_norm"]})
    for k in ("load_s", "rss_after_import_mib", "rss_after_load_mib", "rss_after_train_mib", "torch_threads",
              "torch_interop_threads", "param_dtype", "log"):
        row[k] = out[k]
    row["fwd_nograd_steps_s"] = out["fwd_nograd_s"]
    return row


def run_tp(a, case, tp, model, data, work, lora=None):
    tag = f"tp{tp}-{case}" + ("-lora" if lora else "")
    log_json, log_path = os.path.join(work, f"{tag}.steps.jsonl"), os.path.join(work, f"{tag}.log")
    if os.path.exists(log_json):
        os.remove(log_json)
    cmd = [a.tp_bin, "train", model, "--data", data, "--tensor-parallel-size", str(tp), "--dtype", case,
           "--seq-len", str(a.seq), "--micro-batch-size", str(a.micro_batch), "--grad-accum", "1",
           "--steps", str(a.steps), "--lr", str(LR), "--lr-schedule", "constant",
           "--weight-decay", str(a.weight_decay), "--log-json", log_json] + shlex.split(a.tp_extra)
    if lora:
        cmd += ["--lora-r", str(lora), "--lora-alpha", str(2 * lora), "--lora-target-modules", "all-linear"]
    load = os.getloadavg()
    rc, rss, wall, cpu = wait_child(cmd, thread_env(a.threads), log_path)
    side = f"tp TP{tp}" + (" LoRA" if lora else (" full FT" if a.lora else ""))
    row = {"case": case, "side": side, "tp": tp, "cmd": " ".join(shlex.quote(c) for c in cmd),
           "loadavg_before": load, "peak_rss_mib": rss, "wall_s": wall, "cpu_s": cpu, "cores_busy": cpu / wall,
           "rc": rc, "log_file": log_path}
    steps = []
    if os.path.exists(log_json):
        with open(log_json) as f:
            steps = [json.loads(l) for l in f if l.strip()]
    row["log"] = steps
    if rc != 0 or len(steps) < a.steps:
        row["error"] = tail(log_path)
        print(f"tp TP{tp} {case} failed (rc {rc}, {len(steps)} step lines):\n{row['error']}", file=sys.stderr)
        return row
    el = {s["step"]: s["elapsed_s"] for s in steps}
    counted = a.steps - a.warmup
    t = el[a.steps] - el[a.warmup]
    row.update({"tokens_per_s": a.micro_batch * a.seq * counted / t, "step_s": t / counted,
                "first_step_elapsed_s": el[1], "loss1": steps[0]["loss"], "grad_norm1": steps[0]["grad_norm"]})
    return row


# ---------------------------------------------------------------- the record

def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine():
    model_name = ""
    for line in sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            model_name = line.split(":", 1)[1].strip()
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "cpu_model": model_name,
            "amx": sorted(f for f in flags if f.startswith("amx")),
            "avx512": sorted(f for f in flags if f.startswith("avx512")), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "mem_total": sh(["grep", "MemTotal", "/proc/meminfo"]),
            "kernel": platform.release(), "python": platform.python_version(), "torch": version("torch"),
            "transformers": version("transformers"), "git_commit": sh(["git", "rev-parse", "HEAD"]),
            "git_dirty": bool(dirty), "loadavg_before": os.getloadavg()}


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x == x else "-"


def table(rows):
    head = ["case", "side", "tok/s", "x torch", "peak RSS MiB", "s/step", "cores", "loss@1", "gnorm@1", "(f+b)/f",
            "b/f"]
    body = []
    for case in CASES:
        base = next((r.get("tokens_per_s") for r in rows if r["case"] == case and r["side"].startswith("torch")), None)
        for r in (r for r in rows if r["case"] == case):
            tps = r.get("tokens_per_s")
            ratio = tps / base if tps and base else None
            if r.get("error") is not None:
                body.append([case, r["side"], "FAILED", "", fmt(r.get("peak_rss_mib"), ".0f"), "", "", "", "", "", ""])
                continue
            body.append([case, r["side"], fmt(tps, ".1f"), fmt(ratio, ".2f"), fmt(r["peak_rss_mib"], ".0f"),
                         fmt(r["step_s"], ".2f"), fmt(r["cores_busy"], ".2f"), fmt(r["loss1"], ".4f"), fmt(r["grad_norm1"], ".3f"),
                         fmt(r.get("fwdbwd_over_fwd"), ".2f"), fmt(r.get("bwd_over_fwd"), ".2f")])
    w = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).rjust(n) if i >= 2 else str(x).ljust(n) for i, (x, n) in enumerate(zip(row, w)))
             for row in [head] + body]
    lines.insert(1, "  ".join("-" * n for n in w))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="What is measured and how: the docstring at the top of this file.")
    ap.add_argument("--torch-worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--build-models", nargs=3, metavar=("WORK", "LAYERS", "SHAPE"), help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2",
                    help="smollm2 (SmolLM2-135M, default) or olmoe (a tiny OLMoE-shaped mixture of experts)")
    ap.add_argument("--quick", action="store_true", help="smoke test: layers 2, steps 4, warmup 1")
    ap.add_argument("--layers", type=int, default=None, help="model depth (default 30; 2 with --quick)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (default 256)")
    ap.add_argument("--micro-batch", type=int, default=4, help="rows per step, B (default 4)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 6; 4 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 2; 1 with --quick)")
    ap.add_argument("--threads", type=int, default=2, help="T: torch.set_num_threads and TP_NUM_THREADS (default 2)")
    ap.add_argument("--tp-sizes", default="1,2", help="tp TP degrees to run (default 1,2)")
    ap.add_argument("--cases", default="f32,bf16", help="dtypes to run (default f32,bf16)")
    ap.add_argument("--fwd-steps", type=int, default=3, help="timed no_grad forwards for torch (default 3)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="both sides (default 0, tp's default)")
    ap.add_argument("--tp-bin", default=os.path.join(ROOT, "target", "release", "tp"))
    ap.add_argument("--tp-extra", default="", help='extra flags for tp train, e.g. "--recompute full"')
    ap.add_argument("--work", default=os.path.join(ROOT, "target", "train-bench"), help="cache and logs")
    ap.add_argument("--out", default=None, help="JSON results (default benches/results/train_bench-<date>.json)")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train LoRA adapters of rank R on both sides (PEFT on torch's), plus tp's full fine-tune")
    a = ap.parse_args()
    if a.torch_worker:
        return torch_worker(a.torch_worker)
    if a.build_models:
        return build_models_worker(a.build_models[0], int(a.build_models[1]), a.build_models[2])
    a.layers = a.layers if a.layers is not None else (2 if a.quick else SHAPES[a.shape][2])
    a.steps = a.steps if a.steps is not None else (4 if a.quick else 6)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if not 0 <= a.warmup < a.steps:
        ap.error("need 0 <= --warmup < --steps")
    if a.fwd_steps < 1:
        ap.error("--fwd-steps must be at least 1")
    cases = [c for c in a.cases.split(",") if c]
    if any(c not in CASES for c in cases):
        ap.error(f"--cases: {a.cases} (known: {','.join(CASES)})")
    tps = [int(x) for x in a.tp_sizes.split(",") if x]
    if not os.access(a.tp_bin, os.X_OK):
        sys.exit(f"{a.tp_bin}: not found; build it with `cargo build --release -p tp-cli`")
    os.makedirs(a.work, exist_ok=True)
    day = datetime.date.today().isoformat()
    if a.out is None:
        tag = ("" if a.shape == "smollm2" else f"-{a.shape}") + (f"-lora{a.lora}" if a.lora else "")
        a.out = (os.path.join(a.work, f"train_bench{tag}-quick-{day}.json") if a.quick else
                 os.path.join(ROOT, "benches", "results", f"train_bench{tag}-{day}.json"))

    env = machine()
    env["tp_bin_mtime"] = datetime.datetime.fromtimestamp(os.path.getmtime(a.tp_bin)).astimezone().isoformat(
        timespec="seconds")
    print(f"{env['date']}  CPU {env['cpu_model']} ({env['affinity']} usable of {env['nproc']} cores), "
          f"AMX: {' '.join(env['amx']) or 'none'}, torch {env['torch']}, transformers {env['transformers']}, "
          f"load average {' '.join(f'{x:.2f}' for x in env['loadavg_before'])}", flush=True)
    dirs = build_models(a.work, a.layers, a.shape)
    data = build_data(a.work, a.seq, a.steps * a.micro_batch, SHAPES[a.shape][3])
    env["rss_floor_mib"] = wait_child(["true"], dict(os.environ), os.path.join(a.work, "floor.log"))[1]
    settings = {k: getattr(a, k) for k in ("lora", "shape", "quick", "layers", "seq", "micro_batch", "steps", "warmup", "threads",
                                           "fwd_steps", "weight_decay", "tp_bin", "tp_extra")}
    settings.update({"grad_accum": 1, "lr": LR, "lr_schedule": "constant", "max_grad_norm": MAX_GRAD_NORM,
                     "tp_sizes": tps, "cases": cases, "data": data, "models": dirs})
    print(f"layers {a.layers}, seq {a.seq}, micro-batch {a.micro_batch}, steps {a.steps} "
          f"(first {a.warmup} untimed), threads {a.threads}; a child's RSS floor {env['rss_floor_mib']:.0f} MiB",
          flush=True)

    rows = []
    for case in cases:
        print(f"[{case}] torch ...", flush=True)
        rows.append(run_torch(a, case, dirs[case], data, a.work))
        for tp in tps:
            print(f"[{case}] tp TP{tp} ...", flush=True)
            rows.append(run_tp(a, case, tp, dirs[case], data, a.work, a.lora))
        if a.lora:
            print(f"[{case}] tp TP1 full fine-tune ...", flush=True)
            rows.append(run_tp(a, case, 1, dirs[case], data, a.work))

    notes = [
        "tokens/s counts input tokens, B * seq per step, over the steps after --warmup.",
        "torch bf16 trains the bf16 weights directly (bf16 params, bf16 AdamW state); tp bf16 keeps fp32 master "
        "weights and fp32 optimizer state.",
        "torch: one [B, seq] batch per step, sdpa attention, AdamW fused=False (the per-parameter for-loop "
        "implementation on CPU); (f+b)/f and b/f divide by a no_grad forward of the same batch.",
        "torch's peak RSS includes the interpreter with torch and transformers imported "
        "(rss_after_import_mib).",
        f"tp runs with TP_NUM_THREADS={a.threads}; at TP 2 both rank threads share that one pool.",
        "cores: the child's CPU seconds (user + system, whole process, loading included) / its wall seconds.",
        "tp's elapsed_s clock starts before its ranks load the weights: step 1's time includes the load "
        "(first_step_elapsed_s), left out with the warmup.",
    ]
    print()
    print(table(rows))
    print()
    for n in notes:
        print("note: " + n)
    result = {"env": env, "settings": settings, "rows": rows, "notes": notes}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {a.out}")
    return 1 if any(r.get("error") is not None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
