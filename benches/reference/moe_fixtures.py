"""Reference fixtures for tp's mixture-of-experts models: tiny random checkpoints of each MoE family,
written by transformers, and transformers' float64 outputs on them.

For each case this writes, under crates/tp-models/tests/data/moe/<case>/:

  config.json, model.safetensors  a tiny random model saved by transformers' `save_pretrained` in float32
                                  (the Hub's layout: one tensor per expert)
  fused/                          (some cases) the same weights in transformers 5's fused layout: the
                                  model's own state dict, `mlp.experts.gate_up_proj: [E, 2I, H]` and
                                  `mlp.experts.down_proj: [E, H, I]`, beside the same config.json
  reference.safetensors           float64: `prompt` (i64 ids), `prefill` ([T, V] logits of the prompt),
                                  `tokens` (i64, the greedy continuation), `decode` ([N, V]: the logits
                                  that picked each continuation token, one decode step each)
  reference.json                  versions, prompt length, steps, each MoE layer's routing counts, the
                                  prompt's smallest router gap, transformers' own bf16 error

Cases (every quirk on): qwen3_moe (per-head q/k norm, norm_topk_prob, a dense first layer through
mlp_only_layers, attention biases), qwen2_moe (shared expert with its sigmoid gate, qkv biases,
decoder_sparse_step 2, top-k not renormalised), mixtral (w1/w3/w2 experts, renormalised f32 weights,
sliding window 6), olmoe (full-width q/k norm), gpt_oss (attention sinks, q/k/v/o biases, sliding window 4
on the even layers, the class's default YaRN, a router bias, experts with biases and the clamped SwiGLU in
gpt-oss's interleaved fused layout, which is its only layout). All: vocab 97, hidden 24, 8 query heads of 6 (2 KV
heads; OLMoE 4 heads of 6 and 4 KV heads), 3 layers, 8 experts of 20 features, 2 per token, eager
attention, no bos/eos/pad ids.

Prompts are drawn until the float64 routing of the prompt and of every greedy step is clear of ties
(the k-th and (k+1)-th router probabilities apart by MIN_GAP) and every greedy pick too (top two logits
apart by 4% of the largest): bf16's roundings then route and pick as float64 does, and a bf16 run can
be held to bf16's rounding (transformers' own bf16 error on the prompt is recorded beside it).

The reference runs in float64 on exactly the saved f32 weights: transformers' float32 casts (RMSNorm,
RoPE, the routers' softmax) are lifted to float64 while it runs (train_fixtures.full_f64), and the RoPE
inverse frequencies are recomputed in float64. Self-check: the float64 prefill agrees with unpatched
transformers in float32 within 1e-4, and the fused folder loads in transformers to the same logits.

Needs torch, transformers, safetensors and numpy; not part of CI (the fixtures are committed).
Deterministic; re-running rewrites the case folders.

usage: python3 benches/reference/moe_fixtures.py [CASE ...]
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

sys.path.insert(0, os.path.dirname(__file__))
from train_fixtures import exact_f64_buffers, full_f64, make_model  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "crates", "tp-models", "tests", "data", "moe")
PROMPT_LEN, STEPS = 10, 5


def base(**kw):
    d = dict(vocab_size=97, hidden_size=24, head_dim=6, intermediate_size=40, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
             eos_token_id=None, bos_token_id=None, pad_token_id=None, num_experts_per_tok=2,
             tie_word_embeddings=False)
    d.update(kw)
    # A setting given as None is left at the config's default (OLMoE's head_dim), but the token ids
    # are set to None on purpose.
    return {k: v for k, v in d.items() if v is not None or k.endswith("token_id")}


CASES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  base(num_experts=8, moe_intermediate_size=20, norm_topk_prob=True, mlp_only_layers=[0],
                       attention_bias=True), True),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  base(num_experts=8, moe_intermediate_size=20, shared_expert_intermediate_size=28,
                       decoder_sparse_step=2, qkv_bias=True, norm_topk_prob=False), False),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                base(num_local_experts=8, intermediate_size=20, sliding_window=6), True),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM,
              base(num_experts=8, intermediate_size=20, num_attention_heads=4,
                   num_key_value_heads=4, head_dim=None, norm_topk_prob=False), False),
    # swiglu_limit 1.0 (7 by default) so that the clamps act on these small random weights.
    "gpt_oss": (GptOssConfig, GptOssForCausalLM,
                base(num_local_experts=8, intermediate_size=20, sliding_window=4, swiglu_limit=1.0), False),
    # The same with experts whose weights MXFP4 holds exactly (hidden and intermediate sizes multiples of
    # its 32-element groups); mxfp4/ holds them as the Hub ships gpt-oss (see write_mxfp4). The default
    # swiglu_limit (7, which a GGUF file cannot change: llama.cpp fixes it), the experts' gate/up weights
    # scaled up so that it clamps.
    "gpt_oss_mxfp4": (GptOssConfig, GptOssForCausalLM,
                      base(num_local_experts=8, hidden_size=32, head_dim=8, intermediate_size=32, sliding_window=4),
                      False),
}

# transformers' FP4 (E2M1) values, by code.
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                   dtype=torch.float64)


def mxfp4_round(w):
    """`w: [..., K]` (K a multiple of 32) rounded to MXFP4 along its last dim: per group of 32 the
    power-of-two scale 2^s putting the largest magnitude within FP4's 6, each element the nearest
    FP4 value times it. Returns (codes uint8 [..., K], scale bytes uint8 [..., K / 32], the values)."""
    g = w.double().reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    s = torch.ceil(torch.log2(amax / 6.0))
    codes = (g / 2.0 ** s).unsqueeze(-1).sub(FP4).abs().argmin(dim=-1).to(torch.uint8)
    values = FP4[codes.long()] * 2.0 ** s
    return codes.reshape(w.shape), (s[..., 0] + 127).to(torch.uint8), values.reshape(w.shape)


# The MXFP4 case's gate/up weights times this, so that the default clamp at 7 acts.
GATE_UP_GAIN = 3.0


def mxfp4_experts(d):
    """Rounds the saved model's expert weights to MXFP4 in place (its dense checkpoint then holds
    exactly what the MXFP4 one does), the gate/up weights scaled by GATE_UP_GAIN first."""
    sd = load_file(os.path.join(d, "model.safetensors"))
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj"):
            v = v * GATE_UP_GAIN
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            # [E, in, out] -> groups along `in` of the output-major [E, out, in].
            sd[k] = mxfp4_round(v.transpose(1, 2))[2].transpose(1, 2).to(v.dtype).contiguous()
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def clamped_fraction(m, prompt):
    """The fraction of the prompt's gate/up values (every expert, every token) past gpt-oss's clamp."""
    seen = []

    def hook(mod, args):
        x = args[0]
        gate_up = torch.einsum("th,ehk->etk", x, mod.gate_up_proj) + mod.gate_up_proj_bias[:, None]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        seen.append(float(((gate > mod.limit) | (up.abs() > mod.limit)).double().mean()))

    hooks = [mod.register_forward_pre_hook(hook) for mod in m.modules() if mod.__class__.__name__ == "GptOssExperts"]
    with torch.no_grad():
        m(prompt)
    for h in hooks:
        h.remove()
    return sum(seen) / len(seen)


def write_mxfp4(d):
    """d/mxfp4: the model with its experts as the Hub ships gpt-oss: `*_blocks: [E, out, in/32, 16]`
    (element 2j in the low nibble of byte j, 2j+1 in the high one) and `*_scales: [E, out, in/32]`,
    the rest unchanged; checked against transformers' own MXFP4 decoder."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    md = os.path.join(d, "mxfp4")
    os.makedirs(md)
    shutil.copy(os.path.join(d, "config.json"), md)
    sd = load_file(os.path.join(d, "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            codes, scales, values = mxfp4_round(v.transpose(1, 2))
            assert torch.equal(values, v.transpose(1, 2).double()), k
            c = codes.reshape(*codes.shape[:-1], -1, 32)
            blocks = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).double(), v.double()), k
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales.contiguous()
        else:
            out[k] = v
    save_file(out, os.path.join(md, "model.safetensors"), metadata={"format": "pt"})


def load(d, dtype):
    # The eager experts (a loop over the experts hit, as the modeling file writes it), not the
    # grouped-GEMM integration, which takes no float64.
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager",
                                                             experts_implementation="eager")


def routing_counts(m, ids):
    """Tokens per expert in each MoE layer of the prompt's forward (transformers' own router)."""
    counts = {}
    hooks = []
    for name, mod in m.named_modules():
        if mod.__class__.__name__.endswith("TopKRouter"):
            def hook(mod, args, out, name=name):
                idx = out[2].flatten().tolist()
                counts[name] = [idx.count(e) for e in range(mod.num_experts)]
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    return counts


class Margins:
    """The smallest gap, over every token and MoE layer routed while active, between the k-th and the
    (k+1)-th largest router probability: routing far from ties is the same in bf16 as in float64."""

    def __init__(self, m):
        self.gap, self.hooks = 1.0, []
        for mod in m.modules():
            if mod.__class__.__name__.endswith("TopKRouter"):
                self.hooks.append(mod.register_forward_hook(self.hook))

    def hook(self, mod, args, out):
        p = torch.softmax(out[0].double(), dim=-1).sort(dim=-1, descending=True).values
        self.gap = min(self.gap, float((p[:, mod.top_k - 1] - p[:, mod.top_k]).min()))

    def remove(self):
        for h in self.hooks:
            h.remove()


def greedy(m, prompt):
    """Prefill logits, the greedy tokens and the logits that picked each."""
    prefill = m(prompt).logits[0]
    tokens, decode = [], []
    out = m(prompt, use_cache=True)
    past, nxt = out.past_key_values, out.logits[0, -1]
    for _ in range(STEPS):
        t = int(torch.argmax(nxt))
        tokens.append(t)
        decode.append(nxt)
        out = m(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[0, -1]
    return prefill, tokens, decode


# The smallest router probability gap a fixture's prompt may have (bf16 rounds hidden states by
# about 0.4%, which moves router probabilities by far less than this).
MIN_GAP = 0.012


def run_case(name, cfg_cls, model_cls, kw, fused, seed):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    make_model(d, (cfg_cls, model_cls), kw, seed, scale=0.3)
    if name.endswith("_mxfp4"):
        mxfp4_experts(d)
    rng = np.random.default_rng(seed)

    m = load(d, torch.float32).double()
    m.eval()
    exact_f64_buffers(m)  # YaRN's frequencies included (gpt-oss)
    # A prompt whose routing (prefill and every greedy step) stays clear of ties.
    for attempt in range(2000):
        prompt = torch.from_numpy(rng.integers(0, kw["vocab_size"], (1, PROMPT_LEN)))
        margins = Margins(m)
        with torch.no_grad(), full_f64():
            prefill, tokens, decode = greedy(m, prompt)
        margins.remove()
        # And greedy picks clear of ties: the top two logits of each step apart by 4% of the largest.
        top2 = [torch.topk(row, 2).values for row in decode]
        token_gap = min(float((v[0] - v[1]) / row.abs().max()) for v, row in zip(top2, decode))
        if margins.gap >= MIN_GAP and token_gap >= 0.04:
            break
    else:
        sys.exit(f"{name}: no prompt with router gaps of {MIN_GAP} in 2000 tries")
    # Self-check: unpatched transformers in float32 agrees.
    m32 = load(d, torch.float32)
    with torch.no_grad():
        p32 = m32(prompt).logits[0].double()
    dev = float((p32 - prefill).abs().max() / prefill.abs().max())
    assert dev < 1e-4, dev
    # transformers' own bf16 run, for the scale of bf16's rounding: per prompt position, the
    # largest error over the row's largest logit, the worst position kept.
    with torch.no_grad():
        p16 = load(d, torch.bfloat16)(prompt).logits[0].double()
    bf16_err = float(((p16 - prefill).abs().max(dim=-1).values / prefill.abs().max(dim=-1).values).max())
    # The greedy tokens as transformers' own generate picks them in float64.
    gen = m.generate(prompt, max_new_tokens=STEPS, do_sample=False)[0, PROMPT_LEN:].tolist()
    assert gen == tokens, (gen, tokens)

    save_file({"prompt": prompt[0].to(torch.int64), "prefill": prefill.contiguous(),
               "tokens": torch.tensor(tokens, dtype=torch.int64), "decode": torch.stack(decode).contiguous()},
              os.path.join(d, "reference.safetensors"))
    if fused:
        # The model's own state dict: transformers 5's fused expert tensors.
        fd = os.path.join(d, "fused")
        os.makedirs(fd)
        shutil.copy(os.path.join(d, "config.json"), fd)
        sd = {k: v.contiguous() for k, v in m32.state_dict().items() if k != "lm_head.weight" or
              not m32.config.tie_word_embeddings}
        assert any(k.endswith("experts.gate_up_proj") for k in sd), sorted(sd)[:20]
        save_file(sd, os.path.join(fd, "model.safetensors"), metadata={"format": "pt"})
        mf = load(fd, torch.float32)
        with torch.no_grad():
            assert torch.allclose(mf(prompt).logits, m32(prompt).logits, rtol=0, atol=1e-5)
    clamped = None
    if name.endswith("_mxfp4"):
        write_mxfp4(d)
        clamped = clamped_fraction(m, prompt)
        assert clamped > 0.01, clamped
    ref = {"torch": torch.__version__, "transformers": transformers.__version__, "prompt_len": PROMPT_LEN,
           "steps": STEPS, "routing": routing_counts(m32, prompt), "min_router_gap": margins.gap,
           "transformers_bf16_error": bf16_err,
           "prompt_tries": attempt + 1, "fused": fused, "swiglu_clamped_fraction": clamped}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    keys = sorted(load_file(os.path.join(d, "model.safetensors")))
    print(f"{name:10s} f32 vs f64 {dev:.1e}  tokens {tokens}  tensors {len(keys)}  fused {fused}  "
          f"router gap {margins.gap:.3f} after {attempt + 1} prompts")


def main():
    only = sys.argv[1:]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; cases: {' '.join(CASES)}")
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    for seed, (name, (cfg_cls, model_cls, kw, fused)) in enumerate(CASES.items()):
        if not only or name in only:
            run_case(name, cfg_cls, model_cls, kw, fused, 2000 + seed)


if __name__ == "__main__":
    main()
