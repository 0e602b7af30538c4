"""Writes the mixture-of-experts GGUF file tp-bench's `moe` rows run, tp and llama.cpp on the same file:
Qwen3-MoE's shape (`qwen3moe`: per-head q/k norms, 8 of the experts per token, renormalised) scaled
to about 2B parameters with 64 experts, in llama.cpp's Q4_K_M mixture (Q6_K for `attn_v`,
`ffn_down_exps` and `output`, Q4_K for the other matrices, F32 norms and routers).

    make_moe_gguf.py OUT.gguf [--layers 18] [--hidden 1024] [--experts 64] [--used 8] [--expert-ffn 512]

The K-quant blocks are seeded random blocks with small, finite scales (crates/tp-testing/gguf/write_gguf.py's
`random_k_blocks`: weights of order 1/sqrt(fan_in)); norms are near 1 and routers N(0, 1/hidden), so the
router spreads tokens over the experts. Deterministic; needs numpy and the `gguf` package. The defaults
give 1.95B parameters, about 0.28B active per token (attention, the router, 8 of 64 experts, the LM head).
"""
import argparse
import os
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "crates", "tp-testing", "gguf"))
import write_gguf as W  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--used", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    rng = np.random.default_rng(20261207)
    h, e, i, d = a.hidden, a.experts, a.expert_ffn, a.head_dim
    q, kv = a.heads * d, a.kv_heads * d
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": h, "intermediate_size": 4 * i,
           "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
           "head_dim": d, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "vocab_size": a.vocab, "num_experts": e, "num_experts_per_tok": a.used, "moe_intermediate_size": i}
    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_name("tp moe bench model")
    W.write_metadata(w, "qwen3moe", cfg, a.heads, a.kv_heads, d)
    tokens, scores, types, _ = W.synthetic_vocab(a.vocab, "spm-space")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    params = 0

    def matrix(name, shape, qtype):
        nonlocal params
        params += int(np.prod(shape))
        w.add_tensor(name, W.random_k_blocks(qtype, shape, rng), raw_dtype=qtype)

    def vector(name, shape, value):
        nonlocal params
        params += int(np.prod(shape))
        w.add_tensor(name, value(shape).astype(np.float32))

    near_one = lambda s: 1.0 + 0.05 * rng.standard_normal(s)  # noqa: E731
    matrix("token_embd.weight", (a.vocab, h), T.Q4_K)
    for b in range(a.layers):
        blk = f"blk.{b}"
        vector(f"{blk}.attn_norm.weight", (h,), near_one)
        matrix(f"{blk}.attn_q.weight", (q, h), T.Q4_K)
        matrix(f"{blk}.attn_k.weight", (kv, h), T.Q4_K)
        matrix(f"{blk}.attn_v.weight", (kv, h), T.Q6_K)
        matrix(f"{blk}.attn_output.weight", (h, q), T.Q4_K)
        vector(f"{blk}.attn_q_norm.weight", (d,), near_one)
        vector(f"{blk}.attn_k_norm.weight", (d,), near_one)
        vector(f"{blk}.ffn_norm.weight", (h,), near_one)
        vector(f"{blk}.ffn_gate_inp.weight", (e, h), lambda s: rng.standard_normal(s) / np.sqrt(h))
        matrix(f"{blk}.ffn_gate_exps.weight", (e, i, h), T.Q4_K)
        matrix(f"{blk}.ffn_up_exps.weight", (e, i, h), T.Q4_K)
        matrix(f"{blk}.ffn_down_exps.weight", (e, h, i), T.Q6_K)
    vector("output_norm.weight", (h,), near_one)
    matrix("output.weight", (a.vocab, h), T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    active = params - a.layers * 3 * (e - a.used) * i * h - a.vocab * h
    print(f"{a.out}: {params / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
          f"({os.path.getsize(a.out) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
