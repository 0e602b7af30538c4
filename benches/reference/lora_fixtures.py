"""Reference fixtures for LoRA training in tp-train: PEFT adapters on the tiny models of train_fixtures.py,
trained a few steps by torch autograd in float64.

For each case below (a folder train_fixtures.py wrote, whose model.safetensors and data.jsonl are reused as they
are) this writes crates/tp-train/tests/fixtures/<case>/lora/:

  adapter_init/               the starting adapter, written by PEFT's own `save_pretrained` (adapter_config.json
                              and adapter_model.safetensors, float32): A and B drawn N(0, 0.2^2) with a fixed
                              seed (B is not zero, unlike PEFT's default, so that step 1 moves A too)
  grads.safetensors           float32 gradients of step 1 (before clipping), under the tensor names of PEFT's
                              adapter_model.safetensors (`base_model.model.<module>.lora_A.weight`)
  weights_after.safetensors   the adapters after all steps, same names
  merged.safetensors          the adapted weights of PEFT's `merge_and_unload()` of the starting adapter on the
                              f32 base (W + scaling * B A, in float32 as PEFT merges), checkpoint names
  logits.safetensors          `logits`: float32 logits of row 0 (truncated to seq_len) through the base with the
                              starting adapter (eval mode): what serving that adapter must give
  reference.json              {"torch", "transformers", "peft", "lora" (r, alpha, targets, rslora), "hyper",
                              "steps"}

The base is frozen: only the adapters train. Everything else is train_fixtures.py's semantics (its docstring):
the same rows, loss, global gradient norm (over the adapters), AdamW with weight decay 0.1 on the (2-D) adapters,
cosine schedule. PEFT's LoRA layer computes `base(x) + lora_B(lora_A(dropout(x))) * scaling` with
scaling = alpha / r (rsLoRA: alpha / sqrt(r)); dropout is 0.

Run: python3 benches/reference/lora_fixtures.py [CASE ...]  (after train_fixtures.py; deterministic).
"""

import json
import os
import shutil
import sys

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_fixtures as tf  # noqa: E402

# case: (r, lora_alpha, target_modules, use_rslora)
CASES = {
    "llama": (4, 8.0, "all-linear", False),
    "llama_tied_biases": (2, 4.0, ["q_proj", "v_proj"], False),
    "qwen2": (3, 6.0, "all-linear", True),
    "qwen3": (4, 16.0, ["q_proj", "k_proj", "o_proj", "down_proj"], False),
    "mistral": (4, 8.0, "all-linear", False),
    "gemma3": (4, 8.0, "all-linear", True),
    "phi3": (4, 8.0, "all-linear", False),
    "olmo2": (2, 2.0, ["gate_proj", "up_proj", "down_proj"], False),
    "qwen3_moe": (2, 4.0, ["q_proj", "v_proj", "o_proj"], False),
}


def peft_name(n):
    """A trainable parameter's name as PEFT saves it (without the adapter's name)."""
    return n.replace(".default", "")


def make_adapter(d, out, r, alpha, targets, rslora, seed):
    """The starting adapter of d's model, written by PEFT."""
    m32, _ = tf.load(d, torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                     bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(m32, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn_like(p))
    pm.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model card
    # PEFT records target_modules from a set: sorted, so that reruns write the same file.
    path = os.path.join(out, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if isinstance(cfg["target_modules"], list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = os.path.relpath(d, tf.ROOT)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def train(m, rows, h):
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trainable, "weight_decay": h["weight_decay"]}], lr=h["lr"],
                            betas=(h["adam_beta1"], h["adam_beta2"]), eps=h["adam_eps"])
    sched = tf.get_cosine_schedule_with_warmup(opt, num_warmup_steps=h["warmup_steps"], num_training_steps=h["steps"])
    per_step = h["micro_batch_size"] * h["grad_accum"]
    steps, grads1, nxt = [], None, 0
    m.train()
    for s in range(1, h["steps"] + 1):
        batch = [rows[(nxt + i) % len(rows)] for i in range(per_step)]
        nxt += per_step
        opt.zero_grad(set_to_none=True)
        parts = [tf.row_ce_aux(m, r, h["seq_len"]) for r in batch]
        n = sum(c for _, c, _ in parts)
        loss = sum(ce for ce, _, _ in parts) / n + tf.aux_coef(m) * sum(a for _, _, a in parts) / len(parts)
        loss.backward()
        if s == 1:
            grads1 = {peft_name(k): p.grad.detach().clone() for k, p in m.named_parameters() if p.requires_grad}
        gn = torch.nn.utils.clip_grad_norm_(trainable, max_norm=h["max_grad_norm"])
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        steps.append({"step": s, "loss": loss.item(), "grad_norm": gn.item(), "lr": lr, "tokens": n})
    return steps, grads1


def run_case(name, r, alpha, targets, rslora, seed, rows):
    d = os.path.join(tf.OUT, name)
    out = os.path.join(d, "lora")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    init = os.path.join(out, "adapter_init")
    make_adapter(d, init, r, alpha, targets, rslora, seed)

    # PEFT's merge in float32: the adapted weights, under the checkpoint's names.
    m32, _ = tf.load(d, torch.float32)
    merged = PeftModel.from_pretrained(m32, init).merge_and_unload()
    sd = merged.state_dict()
    modules = sorted({k.split(".lora_")[0].removeprefix("base_model.model.")
                      for k in load_file(os.path.join(init, "adapter_model.safetensors"))})
    save_file({f"{mod}.weight": sd[f"{mod}.weight"].contiguous() for mod in modules},
              os.path.join(out, "merged.safetensors"))

    # float64 throughout, the adapter read back by PEFT from the file it wrote.
    base, _ = tf.load(d, torch.float64)
    tf.exact_f64_buffers(base)
    m = PeftModel.from_pretrained(base, init, is_trainable=True)
    for p in m.parameters():
        if p.requires_grad:
            p.data = p.data.double()
    assert all(p.dtype == torch.float64 for p in m.parameters())
    h = tf.HYPER
    with tf.full_f64():
        m.eval()
        with torch.no_grad():
            ids = torch.tensor([rows[0]["input_ids"][:h["seq_len"]]])
            logits = m(ids).logits[0].detach().clone()
        with tf.NoLowPrecision():
            ce, _ = tf.row_ce(m, rows[0], h["seq_len"])
            ce.backward()
        m.zero_grad(set_to_none=True)
        steps, grads1 = train(m, rows, h)
    # Rounded to f32 outside full_f64 (which turns float32 casts into float64).
    save_file({"logits": logits.to(torch.float32).contiguous()}, os.path.join(out, "logits.safetensors"))
    grads1 = {k: v.to(torch.float32).contiguous() for k, v in grads1.items()}
    save_file(grads1, os.path.join(out, "grads.safetensors"))
    after = {k: v.to(torch.float32).contiguous() for k, v in get_peft_model_state_dict(m).items()}
    assert sorted(after) == sorted(grads1), (sorted(after), sorted(grads1))
    save_file(after, os.path.join(out, "weights_after.safetensors"))
    ref = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "lora": {"r": r, "lora_alpha": alpha, "target_modules": targets, "use_rslora": rslora},
           "hyper": h, "steps": steps}
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{name:18s} {len(after) // 2:2d} modules  " + "  ".join(
        f"s{s['step']}: loss {s['loss']:.6f} gn {s['grad_norm']:.4f}" for s in steps))


def main():
    only = sys.argv[1:]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {' '.join(CASES)}")
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    rows = tf.make_data()
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(CASES.items()):
        if not only or name in only:
            run_case(name, r, alpha, targets, rslora, 2000 + seed, rows)


if __name__ == "__main__":
    main()
