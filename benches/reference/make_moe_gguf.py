"""Writes the mixture-of-experts GGUF file tp-bench's `moe` rows run, tp and llama.cpp on the same file:
Qwen3-MoE's shape (`qwen3moe`: per-head q/k norms, 8 of the experts per token, renormalised) scaled
to about 2B parameters with 64 experts, in llama.cpp's Q4_K_M mixture (Q6_K for `attn_v`,
`ffn_down_exps` and `output`, Q4_K for the other matrices, F32 norms and routers).

    make_moe_gguf.py OUT.gguf [--layers 18] [--hidden 1024] [--experts 64] [--used 8] [--expert-ffn 512]
    make_moe_gguf.py OUT.gguf --arch gpt-oss   (16 layers, hidden 1024, 32 experts of 1024, 4 per token)

`--arch gpt-oss` writes gpt-oss's shape instead (`gpt-oss`: attention sinks, q/k/v/o biases, YaRN,
a window of 128 on the even layers, a router with a bias, experts with biases) with its experts in
MXFP4, as gpt-oss ships them (seeded random codes, E8M0 scales of 2^-7 so that weights are of
order 1/sqrt(fan_in)), and every other matrix Q8_0 (quantized from seeded N(0, 1/fan_in) values):
about 1.7B parameters, 0.3B active per token.

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


# The shape flags' defaults of each architecture.
ARCH_DEFAULTS = {"qwen3moe": {"layers": 18, "experts": 64, "used": 8, "expert_ffn": 512},
                 "gpt-oss": {"layers": 16, "experts": 32, "used": 4, "expert_ffn": 1024}}


def write_tokenizer(w, vocab):
    """A synthetic SentencePiece-style tokenizer of `vocab` pieces (write_gguf.py's `spm-space`)."""
    tokens, scores, types, _ = W.synthetic_vocab(vocab, "spm-space")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    # Defaults per --arch (ARCH_DEFAULTS) where the two shapes differ.
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int)
    p.add_argument("--used", type=int)
    p.add_argument("--expert-ffn", type=int)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--arch", choices=sorted(ARCH_DEFAULTS), default="qwen3moe")
    a = p.parse_args()
    for key, value in ARCH_DEFAULTS[a.arch].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.arch == "gpt-oss":
        return gpt_oss(a)
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
    write_tokenizer(w, a.vocab)

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


def gpt_oss(a):
    """The gpt-oss-shaped file (see the module docs)."""
    layers, experts, used, i = a.layers, a.experts, a.used, a.expert_ffn
    h, d = a.hidden, a.head_dim
    q, kv = a.heads * d, a.kv_heads * d
    rng = np.random.default_rng(20261208)
    cfg = {"architectures": ["GptOssForCausalLM"], "hidden_size": h, "intermediate_size": i,
           "num_hidden_layers": layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
           "head_dim": d, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": a.vocab,
           "num_local_experts": experts, "num_experts_per_tok": used, "sliding_window": 128,
           "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                               "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
    w = gguf.GGUFWriter(a.out, "gpt-oss")
    w.add_name("tp gpt-oss bench model")
    W.write_metadata(w, "gpt-oss", cfg, a.heads, a.kv_heads, d)
    write_tokenizer(w, a.vocab)
    params = 0

    def q8(name, shape):
        nonlocal params
        params += int(np.prod(shape))
        x = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)

    def mxfp4(name, shape):
        nonlocal params
        params += int(np.prod(shape))
        *lead, cols = shape
        blocks = int(np.prod(lead)) * cols // 32
        raw = rng.integers(0, 256, size=(blocks, 17), dtype=np.uint8)
        raw[:, 0] = 121  # 2^(121 - 128): codes of |2|..|12| give weights of order 1/sqrt(1024)
        w.add_tensor(name, raw.reshape(*lead, cols // 32 * 17), raw_dtype=T.MXFP4)

    def vector(name, shape, value):
        nonlocal params
        params += int(np.prod(shape))
        w.add_tensor(name, value(shape).astype(np.float32))

    near_one = lambda s: 1.0 + 0.05 * rng.standard_normal(s)  # noqa: E731
    small = lambda s: 0.02 * rng.standard_normal(s)  # noqa: E731
    q8("token_embd.weight", (a.vocab, h))
    for b in range(layers):
        blk = f"blk.{b}"
        vector(f"{blk}.attn_norm.weight", (h,), near_one)
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            q8(f"{blk}.{name}.weight", (rows, h))
            vector(f"{blk}.{name}.bias", (rows,), small)
        q8(f"{blk}.attn_output.weight", (h, q))
        vector(f"{blk}.attn_output.bias", (h,), small)
        vector(f"{blk}.attn_sinks.weight", (a.heads,), lambda s: rng.standard_normal(s))
        vector(f"{blk}.post_attention_norm.weight", (h,), near_one)
        vector(f"{blk}.ffn_gate_inp.weight", (experts, h), lambda s: rng.standard_normal(s) / np.sqrt(h))
        vector(f"{blk}.ffn_gate_inp.bias", (experts,), small)
        for name, shape in (("ffn_gate_exps", (experts, i, h)), ("ffn_up_exps", (experts, i, h)),
                            ("ffn_down_exps", (experts, h, i))):
            mxfp4(f"{blk}.{name}.weight", shape)
            vector(f"{blk}.{name}.bias", shape[:2], small)
    vector("output_norm.weight", (h,), near_one)
    q8("output.weight", (a.vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    active = params - layers * 3 * (experts - used) * i * h - a.vocab * h
    print(f"{a.out}: {params / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token "
          f"({os.path.getsize(a.out) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
