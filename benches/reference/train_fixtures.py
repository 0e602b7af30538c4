"""Reference fixtures for tp-train: a few training steps of tiny random models, by torch autograd.

For each case (one model family with its quirks switched on) this writes, under
crates/tp-train/tests/fixtures/<case>/:

  config.json, model.safetensors  a tiny random model, saved by transformers' own
                                  `save_pretrained(dir, safe_serialization=True)` in float32
  data.jsonl                      the training rows (identical for every case)
  grads.safetensors               float32 gradients of step 1 (before clipping and before the
                                  update), keyed by the checkpoint names of model.safetensors
  weights_after.safetensors       float32 parameters after all steps (checkpoint names)
  reference.json                  {"torch", "transformers", "hyper", "steps", "step1_loss",
                                   "weights_after"}

Cases: llama (GQA), llama_tied_biases (tied embeddings, attention and MLP biases), qwen2 (q/k/v
biases), qwen3 (per-head q/k norm), mistral (sliding window 4), gemma3 (sliding + full layer,
window 4, tied, final-logit soft-capping 5, query_pre_attn_scalar 10), phi3 (fused qkv_proj and
gate_up_proj, default RoPE), olmo2 (full-width q/k norm), llama_tied_pad (tied embeddings with
pad_token_id 76, a token the first step's rows hold, as SmolLM2 pads with a real token: the
embedding's padding_idx row gets the LM head's gradient only), phi3_longrope (LongRoPE with
original_max_position_embeddings 8: rows on both sides of it share micro-batches, and each must
take the factors of its own length); the mixtures qwen3_moe, qwen2_moe, mixtral, olmoe and gpt_oss
(sinks, biases, a window on layer 0, YaRN, the clamped SwiGLU, experts fused and interleaved in the
checkpoint as gpt-oss ships them). All: vocab 97, hidden 24, head_dim 6, 2 KV heads,
intermediate 40, 2 layers, max positions 64, rms_norm_eps 1e-5, no bos/eos ids and no pad id
(but in llama_tied_pad), eager attention. Qwen2, Phi-3 and OLMo 2 have no head_dim setting (head_dim = hidden / heads):
they use 4 query heads (head_dim 6), the others 8 query heads of 6 (q width 48 != hidden 24).
Weights are drawn with a fixed seed per case: matrices and biases N(0, 0.2^2), norm weights their
init (1, or 0 for Gemma's 1 + w) plus N(0, 0.1^2).

Data (data.jsonl, one {"input_ids": [...], "labels": [...]} a line): 10 rows of 3 to 20 ids in
[0, 97); labels as long as input_ids, equal to the ids except a masked prompt (-100) at the start
of some rows; one row (20 ids) is longer than seq_len. Labels are UNSHIFTED, as in transformers:
position t's logits predict labels[t + 1].

Training semantics (hyper-parameters in reference.json "hyper"):
  seq_len=16, micro_batch_size=2, grad_accum=2, steps=3, lr=1e-3, warmup_steps=1,
  lr_schedule="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
  max_grad_norm=1.0.
  - Rows are taken in file order, wrapping at the end; a step takes the next
    micro_batch_size * grad_accum = 4 rows. A row longer than seq_len keeps its first seq_len ids
    and labels.
  - Target tokens: positions t with labels[t + 1] != -100, predicting labels[t + 1]. The loss of a
    step is the sum of the cross-entropy over all target tokens of its rows divided by the number
    of target tokens of the whole step (transformers' num_items_in_batch). Each row runs on its own
    (batch of 1, no padding).
  - Gradient of that loss w.r.t. every parameter; grad_norm is the global L2 norm over all
    parameters before clipping (torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm);
    a tied embedding counts once and its gradient is the sum of both uses).
  - torch.optim.AdamW, two groups: parameters with ndim == 1 (biases, norm weights) and gpt-oss's
    fused expert biases (`*_bias`) weight decay 0, all others 0.1; betas (0.9, 0.95), eps 1e-8, lr 1e-3.
  - transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=3),
    scheduler.step() after each optimizer.step() (as the Trainer): step s (from 1) uses the
    schedule at s - 1, so step 1 has lr 0 (Adam moments still update), step 2 1e-3, step 3 5e-4.
  - Per step: {"step", "loss", "grad_norm", "lr" (the lr that step used), "tokens" (its target
    tokens)}.

The reference is float64 arithmetic on exactly the saved f32 weights: the saved checkpoint is
reloaded in f32 and converted with `.double()`. transformers' modeling code casts some things to
float32 on the way (RMSNorm, RoPE cos/sin, the eager softmax, Gemma's norms); while the reference
runs, those float32 casts are turned into float64 ones (`full_f64`), the RoPE inverse frequencies
and Gemma's embedding scale are recomputed in float64, and a dispatch check asserts that no
float32 tensor is produced. The fixtures are written as float32.

Self-checks (printed): transformers' own f32 `model(input_ids, labels=labels).loss` on each row
equals this script's per-row CE sum / target count (shift convention), the float64 losses agree
with unpatched transformers in float64, and the folder sizes.

Needs torch, transformers, safetensors and numpy; not part of CI (the fixtures are committed).
Deterministic (fixed seeds, one CPU thread) and re-runnable; it rewrites the case folders.

usage: python3 benches/reference/train_fixtures.py [CASE ...]   (no CASE: all cases)
"""
import contextlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM, get_cosine_schedule_with_warmup)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "crates", "tp-train", "tests", "fixtures")

HYPER = dict(seq_len=16, micro_batch_size=2, grad_accum=2, steps=3, lr=1e-3, warmup_steps=1, lr_schedule="cosine",
             weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, max_grad_norm=1.0)


def base(**kw):
    d = dict(vocab_size=97, hidden_size=24, head_dim=6, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)
    d.update(kw)
    return d


def no_head_dim(**kw):
    """Families whose config has no head_dim: head_dim = hidden / heads = 24 / 4 = 6."""
    d = base(num_attention_heads=4, **kw)
    del d["head_dim"]
    return d


# The padding token of llama_tied_pad: an id the first step's rows hold (rows 1 and 3), in the
# middle of the vocabulary so that uneven vocabulary splits put it on a rank other than the first.
PAD = 76

LLAMA, QWEN2, MISTRAL = (LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM), (MistralConfig,
                                                                                          MistralForCausalLM)
QWEN3, GEMMA3 = (Qwen3Config, Qwen3ForCausalLM), (Gemma3TextConfig, Gemma3ForCausalLM)
PHI3, OLMO2 = (Phi3Config, Phi3ForCausalLM), (Olmo2Config, Olmo2ForCausalLM)
QWEN3MOE, QWEN2MOE = (Qwen3MoeConfig, Qwen3MoeForCausalLM), (Qwen2MoeConfig, Qwen2MoeForCausalLM)
MIXTRAL, OLMOE = (MixtralConfig, MixtralForCausalLM), (OlmoeConfig, OlmoeForCausalLM)
GPTOSS = (GptOssConfig, GptOssForCausalLM)
CASES = {
    "llama": (LLAMA, base()),
    "llama_tied_biases": (LLAMA, base(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "qwen2": (QWEN2, no_head_dim()),
    "qwen3": (QWEN3, base()),
    "mistral": (MISTRAL, base(sliding_window=4)),
    "gemma3": (GEMMA3, base(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                            tie_word_embeddings=True, final_logit_softcapping=5.0, query_pre_attn_scalar=10,
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": (PHI3, no_head_dim(original_max_position_embeddings=64)),
    "olmo2": (OLMO2, no_head_dim()),
    # Appended after the others so that their seeds (1000 + index) stay as they were.
    "llama_tied_pad": (LLAMA, base(tie_word_embeddings=True, pad_token_id=PAD)),
    "phi3_longrope": (PHI3, no_head_dim(original_max_position_embeddings=8, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5], "long_factor": [1.0, 2.0, 4.0]})),
    # Mixtures of experts: 8 experts of 20 features, 2 per token, the load-balancing loss on (coefficient 0.05,
    # far above the default so that its gradient shows) except in Mixtral.
    "qwen3_moe": (QWEN3MOE, base(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True,
                                 mlp_only_layers=[0], attention_bias=True, output_router_logits=True,
                                 router_aux_loss_coef=0.05)),
    "qwen2_moe": (QWEN2MOE, no_head_dim(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
                                        shared_expert_intermediate_size=28, output_router_logits=True,
                                        router_aux_loss_coef=0.05)),
    "mixtral": (MIXTRAL, base(num_local_experts=8, num_experts_per_tok=2, intermediate_size=20, sliding_window=4)),
    "olmoe": (OLMOE, no_head_dim(num_experts=8, num_experts_per_tok=2, intermediate_size=20, num_key_value_heads=4,
                                 output_router_logits=True, router_aux_loss_coef=0.05)),
    # gpt-oss: attention sinks, q/k/v/o biases, a sliding window of 4 on layer 0, the class's default YaRN, a router
    # bias, experts with biases in its fused interleaved layout, and the clamped SwiGLU (limit 1 so that the clamps
    # act on these small weights).
    "gpt_oss": (GPTOSS, base(num_local_experts=8, num_experts_per_tok=2, intermediate_size=20, sliding_window=4,
                             swiglu_limit=1.0, output_router_logits=True, router_aux_loss_coef=0.05)),
}

# (length, masked prompt length); row 1 is longer than seq_len, row 4 exactly seq_len.
ROWS = [(7, 3), (20, 2), (3, 0), (12, 5), (16, 0), (5, 0), (9, 4), (4, 2), (14, 6), (11, 0)]


def make_data():
    rng = np.random.default_rng(20240611)
    rows = []
    for n, masked in ROWS:
        ids = [int(x) for x in rng.integers(0, 97, n)]
        rows.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return rows


def make_model(d, classes, kw, seed, scale=0.2):
    """Saves a random model to d: matrices and biases N(0, scale^2), norm weights their init plus N(0, 0.1^2)."""
    torch.manual_seed(seed)
    m = classes[1](classes[0](attn_implementation="eager", experts_implementation="eager", **kw)).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    m.save_pretrained(d, safe_serialization=True)
    gc = os.path.join(d, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)


def load(d, dtype):
    # The eager experts (the modeling file's loop), not the grouped-GEMM integration, which takes no float64.
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                          experts_implementation="eager")
    saved = load_file(os.path.join(d, "model.safetensors"))
    sd = m.state_dict()
    sd = by_checkpoint_name(m, sorted(saved), {id(p): sd[k] for k, p in m.named_parameters()})
    for k, v in saved.items():
        assert torch.equal(sd[k], v), k
    if dtype == torch.float64:
        m = m.double()
    return m, sorted(saved)


def exact_f64_buffers(m):
    """RoPE inverse frequencies and Gemma's embedding scale, recomputed in float64 (default RoPE,
    and LongRoPE: the short factors' frequencies in the buffers, the long ones set in advance as
    the attribute transformers would otherwise compute in float32 on the first long row)."""
    cfg = m.config
    for mod in m.modules():
        if getattr(mod, "rope_type", None) == "yarn":
            with full_f64():
                inv, scaling = ROPE_INIT_FUNCTIONS["yarn"](mod.config, None)
            assert inv.dtype == torch.float64 and torch.allclose(inv, mod.inv_freq, rtol=1e-6)
            mod.inv_freq.copy_(inv)
            mod.original_inv_freq.copy_(inv)
            assert scaling == mod.attention_scaling
            continue
        for name, buf in list(mod.named_buffers(recurse=False)):
            if name.endswith("inv_freq"):
                lt = name[:-len("inv_freq")].replace("original_", "").rstrip("_")
                rp = cfg.rope_parameters[lt] if lt else cfg.rope_parameters
                assert rp["rope_type"] in ("default", "longrope"), rp
                dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                assert buf.shape[0] == dim // 2
                base_inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
                short = torch.tensor(rp.get("short_factor", [1.0] * (dim // 2)), dtype=torch.float64)
                assert torch.allclose(base_inv / short, buf, rtol=1e-6)
                buf.copy_(base_inv / short)
                if rp["rope_type"] == "longrope":
                    assert not lt, "per-layer LongRoPE"
                    mod.long_inv_freq = base_inv / torch.tensor(rp["long_factor"], dtype=torch.float64)
            elif name == "embed_scale":
                buf.copy_(torch.tensor(mod.scalar_embed_scale, dtype=torch.float64))


@contextlib.contextmanager
def full_f64():
    """While active, float32 casts (Tensor.float, Tensor.to(float32), softmax(dtype=float32)) give float64."""
    f32, f64 = torch.float32, torch.float64
    orig_to, orig_float, orig_softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def to(self, *a, **kw):
        a = tuple(f64 if x is f32 else x for x in a)
        if kw.get("dtype") is f32:
            kw["dtype"] = f64
        return orig_to(self, *a, **kw)

    def softmax(x, *a, **kw):
        if kw.get("dtype") is f32:
            kw["dtype"] = f64
        return orig_softmax(x, *a, **kw)

    torch.Tensor.to, torch.Tensor.float = to, lambda self, *a, **kw: orig_to(self, f64)
    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = orig_to, orig_float, orig_softmax


class NoLowPrecision(TorchDispatchMode):
    """Fails on any op that produces a floating tensor narrower than float64."""

    # transformers' load-balancing loss counts the experts chosen in float32 (zeros, then a histogram of the
    # chosen ids): whole numbers, exact in any float type.
    EXACT = (torch.ops.aten.zeros.default, torch.ops.aten.histc.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.EXACT:
            return out
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                raise AssertionError(f"{func} produced {t.dtype}")
        return out


def row_ce(m, row, seq_len):
    """(sum of CE over the row's target tokens, number of target tokens), the row truncated to seq_len."""
    ce, n, _ = row_ce_aux(m, row, seq_len)
    return ce, n


def row_ce_aux(m, row, seq_len):
    """row_ce and the row's load-balancing loss (transformers' `aux_loss` of the row alone, unweighted; 0 for a
    dense model or a config without output_router_logits)."""
    ids = torch.tensor([row["input_ids"][:seq_len]])
    labels = torch.tensor(row["labels"][:seq_len])
    moe = getattr(m.config, "output_router_logits", False)
    out = m(ids, output_router_logits=True) if moe else m(ids)
    logits = out.logits[0]
    tgt = labels[1:]
    mask = tgt != -100
    ce = torch.nn.functional.cross_entropy(logits[:-1][mask], tgt[mask], reduction="sum")
    return ce, int(mask.sum()), (out.aux_loss if moe else 0.0)


def aux_coef(m):
    """The load-balancing loss's weight in the loss (0 without output_router_logits)."""
    return m.config.router_aux_loss_coef if getattr(m.config, "output_router_logits", False) else 0.0


def no_decay(name, p):
    """Megatron's rule: no weight decay on biases (gpt-oss's fused expert biases `*_bias` are 2-D) and 1-D
    parameters (norm weights, gpt-oss's sinks)."""
    return p.ndim == 1 or name.endswith("_bias")


def train(m, rows, h):
    decay = [p for n, p in m.named_parameters() if not no_decay(n, p)]
    no_decay_params = [p for n, p in m.named_parameters() if no_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": h["weight_decay"]},
                             {"params": no_decay_params, "weight_decay": 0.0}], lr=h["lr"],
                            betas=(h["adam_beta1"], h["adam_beta2"]), eps=h["adam_eps"])
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=h["warmup_steps"], num_training_steps=h["steps"])
    per_step = h["micro_batch_size"] * h["grad_accum"]
    steps, grads1, nxt = [], None, 0
    m.train()
    for s in range(1, h["steps"] + 1):
        batch = [rows[(nxt + i) % len(rows)] for i in range(per_step)]
        nxt += per_step
        opt.zero_grad(set_to_none=True)
        parts = [row_ce_aux(m, r, h["seq_len"]) for r in batch]
        n = sum(c for _, c, _ in parts)
        # A mixture's load-balancing loss: each row's own (its forward alone), the mean over the step's rows.
        loss = sum(ce for ce, _, _ in parts) / n + aux_coef(m) * sum(a for _, _, a in parts) / len(parts)
        loss.backward()
        if s == 1:
            grads1 = {id(p): p.grad.detach().clone() for p in m.parameters()}
        gn = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=h["max_grad_norm"])
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        steps.append({"step": s, "loss": loss.item(), "grad_norm": gn.item(), "lr": lr, "tokens": n})
    return steps, grads1


def by_checkpoint_name(m, names, values):
    """{checkpoint name: f32 tensor} for every parameter; values maps id(param) to a tensor. transformers 5 holds
    a mixture's experts fused (`experts.gate_up_proj: [E, 2I, H]`, `experts.down_proj: [E, H, I]`); the checkpoint
    (and tp) name them per expert, so those are split, except where the checkpoint holds them fused too
    (gpt-oss)."""
    params = dict(m.named_parameters())  # a tied lm_head appears once, as model.embed_tokens.weight
    # Mixtral's checkpoints name the block `block_sparse_moe` and the projections w1 (gate), w3 (up), w2 (down).
    mixtral = any(".block_sparse_moe." in n for n in names)
    proj = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    out = {}
    for k, p in params.items():
        v = values[id(p)].detach().to(torch.float32)
        if mixtral:
            k = k.replace(".mlp.", ".block_sparse_moe.")
        if k in names:
            out[k] = v.contiguous()
        elif k.endswith(".experts.gate_up_proj") or k.endswith(".experts.down_proj"):
            prefix = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    i = v.shape[1] // 2
                    out[f"{prefix}.{e}.{proj['gate']}.weight"] = v[e, :i].contiguous()
                    out[f"{prefix}.{e}.{proj['up']}.weight"] = v[e, i:].contiguous()
                else:
                    out[f"{prefix}.{e}.{proj['down']}.weight"] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    assert sorted(out) == names, (sorted(out), names)
    return out


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def run_case(name, classes, kw, seed, rows):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    make_model(d, classes, kw, seed)
    with open(os.path.join(d, "data.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")

    # Check 1: transformers' own f32 loss on each row equals our per-row CE sum / count.
    m32, _ = load(d, torch.float32)
    m32.eval()
    worst = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["input_ids"][:HYPER["seq_len"]]])
            labels = torch.tensor([r["labels"][:HYPER["seq_len"]]])
            hf = m32(ids, labels=labels).loss.item()
            ce, n, aux = row_ce_aux(m32, r, HYPER["seq_len"])
            worst = max(worst, abs(hf - (ce.item() / n + aux_coef(m32) * float(aux))) / abs(hf))
    assert worst < 1e-6, worst

    # The reference: float64 throughout, on exactly the saved weights.
    m, names = load(d, torch.float64)
    exact_f64_buffers(m)
    with full_f64():
        with NoLowPrecision():  # one forward and backward, float64 only
            ce, _ = row_ce(m, rows[0], HYPER["seq_len"])
            ce.backward()
        m.zero_grad(set_to_none=True)
        steps, grads1 = train(m, rows, HYPER)
    save_file(by_checkpoint_name(m, names, grads1), os.path.join(d, "grads.safetensors"))
    save_file(by_checkpoint_name(m, names, {id(p): p for p in m.parameters()}),
              os.path.join(d, "weights_after.safetensors"))

    # Check 2: unpatched transformers in float64 (its f32 casts) gives the same step-1 loss.
    m64, _ = load(d, torch.float64)
    with torch.no_grad():
        parts = [row_ce_aux(m64, r, HYPER["seq_len"])
                 for r in rows[:HYPER["micro_batch_size"] * HYPER["grad_accum"]]]
    plain = (sum(c for c, _, _ in parts).item() / sum(n for _, n, _ in parts)
             + aux_coef(m64) * sum(float(a) for _, _, a in parts) / len(parts))
    dev64 = abs(plain - steps[0]["loss"]) / steps[0]["loss"]
    assert dev64 < 1e-5, dev64
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)

    ref = {"torch": torch.__version__, "transformers": transformers.__version__, "hyper": HYPER, "steps": steps,
           "step1_loss": steps[0]["loss"], "weights_after": "weights_after.safetensors"}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{name:18s} {dir_size(d) / 1024:6.1f} KiB  hf-vs-ours row loss {worst:.1e}  f64 vs hf-f64 {dev64:.1e}  "
          + "  ".join(f"s{s['step']}: loss {s['loss']:.6f} gn {s['grad_norm']:.4f} lr {s['lr']:.0e} n {s['tokens']}"
                      for s in steps))


def main():
    only = sys.argv[1:]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {' '.join(CASES)}")
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    rows = make_data()
    for seed, (name, (classes, kw)) in enumerate(CASES.items()):
        if not only or name in only:
            run_case(name, classes, kw, 1000 + seed, rows)


if __name__ == "__main__":
    main()
