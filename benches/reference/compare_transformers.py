"""tp's `generate` example against Hugging Face transformers, on tiny random checkpoints.

For each case (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3 and OLMo 2 with their quirks switched
on) this writes a small random model with transformers' own `save_pretrained`
(several safetensors files and an index), runs transformers' forward (prefill, then greedy decode
steps through its KV cache) and runs tp's `generate` with `--logits-out` at world sizes 1..8, in
f32 and bf16. It prints, per run, the largest logit difference relative to the largest logit,
and whether the greedy tokens agree.

Pass criteria: f32, prefill and decode logits within 1e-5 of transformers' (relative to the
largest logit) and the same tokens; bf16, our error against transformers' own f32 logits at most
1.5x transformers' bf16 error against them (+1e-3), tokens not compared (near ties flip).

Needs torch, transformers and numpy (`pip install torch transformers numpy`); not part of CI.

usage: python3 benches/reference/compare_transformers.py GENERATE_BIN OUTDIR [CASE ...]
  GENERATE_BIN: target/release/examples/generate (cargo build --release -p tp-models --example generate)
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

WORLDS = [1, 2, 3, 4, 5, 6, 7, 8]
PROMPT_LEN, NEW_TOKENS = 20, 12


def base(**kw):
    d = dict(vocab_size=1001, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)
    d.update(kw)
    return d


def rope(kind, **kw):
    return dict(rope_parameters=dict(rope_type=kind, **kw))


LLAMA, QWEN2, MISTRAL = (LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM), (MistralConfig,
                                                                                          MistralForCausalLM)
QWEN3, GEMMA3 = (Qwen3Config, Qwen3ForCausalLM), (Gemma3TextConfig, Gemma3ForCausalLM)
PHI3, OLMO2 = (Phi3Config, Phi3ForCausalLM), (Olmo2Config, Olmo2ForCausalLM)
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]
CASES = {
    # 12 query heads over 4 KV heads: at 3, 5..8 ranks some ranks' heads straddle two KV heads.
    "llama": (LLAMA, base()),
    "llama_tied_biases": (LLAMA, base(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama_head_dim": (LLAMA, base(head_dim=10, num_attention_heads=6, num_key_value_heads=2)),
    "llama_mqa": (LLAMA, base(num_key_value_heads=1)),
    "llama_mha": (LLAMA, base(num_key_value_heads=12)),
    "llama3_rope": (LLAMA, base(**rope("llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=16))),
    "linear_rope": (LLAMA, base(**rope("linear", rope_theta=10000.0, factor=4.0))),
    # original_max_position_embeddings below the sequence: the ramp falls inside the pairs.
    "yarn_rope": (LLAMA, base(**rope("yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8))),
    "yarn_mscale": (LLAMA, base(head_dim=16, num_attention_heads=6, num_key_value_heads=2,
                                **rope("yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=16,
                                       beta_fast=16, beta_slow=2, mscale=0.707, mscale_all_dim=1.0,
                                       truncate=False))),
    # Within max_position_embeddings dynamic NTK equals the default frequencies (as in transformers).
    "dynamic_rope": (LLAMA, base(**rope("dynamic", rope_theta=10000.0, factor=4.0))),
    "qwen2_tied": (QWEN2, base(tie_word_embeddings=True, **rope("default", rope_theta=1000000.0))),
    "qwen2": (QWEN2, base(num_key_value_heads=2)),
    "mistral_window": (MISTRAL, base(sliding_window=7)),
    "mistral_no_window": (MISTRAL, base(sliding_window=None)),
    # Qwen3: per-head q/k RMSNorm before RoPE (its default head_dim is 128: set ours).
    "qwen3": (QWEN3, base(head_dim=8)),
    "qwen3_bias_tied": (QWEN3, base(head_dim=8, attention_bias=True, tie_word_embeddings=True,
                                    num_key_value_heads=2)),
    # Gemma 3: (1 + w) norms, sandwich norms, GeGLU, sqrt(hidden)-scaled embeddings,
    # query_pre_attn_scalar, per-head q/k norm, two sliding layers (window 7, their own rope base)
    # before a global one.
    "gemma3": (GEMMA3, base(head_dim=16, num_attention_heads=6, num_key_value_heads=2, query_pre_attn_scalar=24,
                            sliding_window=7, layer_types=GEMMA_LAYERS,
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # ... with final-logit soft-capping low enough to bend the logits, linear scaling on the global
    # layers (as Gemma 3 4B+ has) and an untied head.
    "gemma3_softcap_linear": (GEMMA3, base(head_dim=16, num_attention_heads=6, num_key_value_heads=1,
                                           query_pre_attn_scalar=16, sliding_window=5, layer_types=GEMMA_LAYERS,
                                           final_logit_softcapping=2.0, tie_word_embeddings=False,
                                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                               "rope_theta": 1e6},
                                                            "sliding_attention": {"rope_type": "default",
                                                                                  "rope_theta": 1e4}})),
    # Phi-3: fused qkv_proj and gate_up_proj; with and without a sliding window.
    "phi3": (PHI3, base()),
    "phi3_window": (PHI3, base(sliding_window=7, num_key_value_heads=12)),
    # LongRoPE: short factors within the original length (16), long ones past it (the prompt is
    # 20 tokens), cos/sin times sqrt(1 + ln(256/16) / ln 16).
    "phi3_longrope": (PHI3, base(head_dim=8, original_max_position_embeddings=16,
                                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                      short_factor=[1.0, 1.2, 1.5, 2.0],
                                                      long_factor=[1.0, 2.0, 4.0, 8.0]))),
    # As Phi-4-mini: partial rotary (0.75 of head_dim 16: 12 features turn, 4 pass through) with
    # LongRoPE over the 6 rotated pairs.
    "phi3_partial_longrope": (PHI3, base(head_dim=16, num_attention_heads=6, num_key_value_heads=2,
                                         original_max_position_embeddings=16, partial_rotary_factor=0.75,
                                         rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                              partial_rotary_factor=0.75,
                                                              short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                              long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0]))),
    # OLMo 2: q/k RMSNorm over the full width (split across ranks), post-attention and
    # post-feed-forward norms only.
    "olmo2": (OLMO2, base()),
    "olmo2_mqa": (OLMO2, base(num_key_value_heads=1)),
}


def make(out, name, classes, kw, seed):
    """A random model (norm weights and biases random too) saved by transformers in shards."""
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    torch.manual_seed(seed)
    m = classes[1](classes[0](**kw)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5) * 1.5)
    m.save_pretrained(d, max_shard_size="300KB")
    return d, m


def hf_run(m, prompt, n):
    """transformers' prefill logits, the logits of decode steps 1..n-1, and the greedy tokens."""
    with torch.no_grad():
        out = m(torch.tensor([prompt]), use_cache=True)
        pre, past = out.logits[0].float().numpy(), out.past_key_values
        tok = int(torch.argmax(out.logits[0, -1]))
        toks, dec = [tok], []
        for _ in range(n - 1):
            o = m(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            dec.append(o.logits[0, -1].float().numpy())
            tok = int(torch.argmax(o.logits[0, -1]))
            toks.append(tok)
    return pre, np.array(dec).reshape(n - 1, -1), toks


def ours(binary, out, d, prompt, n, world, dtype):
    f = os.path.join(out, "logits.safetensors")
    if os.path.exists(f):
        os.remove(f)
    cmd = [binary, "--model", d, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n),
           "--world-size", str(world), "--dtype", dtype, "--logits-out", f, "--ignore-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip()
    return load_file(f), None


def main():
    binary, out = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3:])
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    failures = 0
    for i, (name, (classes, kw)) in enumerate(CASES.items()):
        prompt = [int(x) for x in rng.integers(0, kw["vocab_size"], PROMPT_LEN)]
        if only and name not in only:
            continue
        d, m = make(out, name, classes, kw, i)
        pre32, dec32, toks32 = hf_run(m, prompt, NEW_TOKENS)
        scale = np.abs(pre32).max()
        cap = getattr(m.config, "final_logit_softcapping", None)
        if cap is not None:
            # Soft-capping squeezes the logits into (-cap, cap): errors are measured against the
            # logits before the cap (the capping itself only shrinks differences).
            m.config.final_logit_softcapping = None
            scale = max(scale, np.abs(hf_run(m, prompt, 2)[0]).max())
            m.config.final_logit_softcapping = cap
        for dtype in ["f32", "bf16"]:
            if dtype == "f32":
                pre, dec, toks, hf_err = pre32, dec32, toks32, 0.0
            else:
                pre, dec, toks = hf_run(m.to(torch.bfloat16), prompt, NEW_TOKENS)
                hf_err = np.abs(pre - pre32).max() / scale
            for world in WORLDS:
                if world > kw["num_attention_heads"]:
                    continue
                t, err = ours(binary, out, d, prompt, NEW_TOKENS, world, dtype)
                if t is None:
                    failures += 1
                    print(f"{name:18s} {dtype:4s} W{world}: ERROR {err}")
                    continue
                same = list(t["tokens"]) == toks
                e_pre = np.abs(t["prefill_logits"] - pre).max() / scale
                k = 0  # decode rows compare while our tokens equal transformers'
                while k < NEW_TOKENS - 1 and t["tokens"][k] == toks[k]:
                    k += 1
                e_dec = np.abs(t["decode_logits"][:k] - dec[:k]).max() / scale if k else 0.0
                e32 = np.abs(t["prefill_logits"] - pre32).max() / scale
                ok = (e_pre < 1e-5 and e_dec < 1e-5 and same) if dtype == "f32" else e32 < 1.5 * hf_err + 1e-3
                failures += not ok
                print(f"{name:18s} {dtype:4s} W{world}: prefill {e_pre:.1e} decode {e_dec:.1e} tokens "
                      f"{'same' if same else 'differ'}; vs f32: ours {e32:.1e}, transformers {hf_err:.1e} "
                      f"{'ok' if ok else 'FAIL'}")
    print("failures:", failures)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
