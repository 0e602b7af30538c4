#!/usr/bin/env python3
"""Writes a Hugging Face causal-LM folder as a GGUF file, the way llama.cpp's converter lays it
out, with the `gguf` package's writer and quantizers, for tp's tests and benchmarks.

    write_gguf.py HF_DIR OUT.gguf --type Q4_0 [--ref REF_DIR] [--seed N] [--tokenizer spm|bpe]

* Names and metadata follow llama.cpp (`blk.N.attn_q.weight`, `llama.embedding_length`, ...);
  the rows of Q and K are permuted into llama.cpp's rotary layout for the `llama` architecture
  (as its converter does for Llama and Mistral checkpoints).
* `--type` is the type of every 2-D weight (norms and biases stay F32): F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1 quantize the checkpoint's values with `gguf.quants`; the K-quants
  (Q2_K .. Q6_K), which `gguf` cannot quantize, are written as seeded random blocks of that
  type with small, finite scales: a valid file whose weights are whatever those blocks hold.
  `MIXED_K` gives the tensors the types of llama.cpp's Q4_K_M mixture (Q6_K for `attn_v`,
  `ffn_down` and `output`, Q4_K elsewhere), and `MIXED_LEGACY` alternates Q4_0 / Q8_0 / Q5_1.
* `--ref REF_DIR` writes the same model as a Hugging Face folder in f32 holding exactly the
  weights the GGUF file holds (each tensor dequantized by `gguf.quants.dequantize`, the Q/K
  permutation undone): the independent reference the tests load beside the GGUF file.
* The tokenizer (`tokenizer.ggml.*`) is a synthetic one of the config's vocabulary size:
  SentencePiece-style (`llama`: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, pieces with
  scores) or byte-level BPE (`gpt2`: tokens and merges).
"""

import argparse
import json
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
PERMUTES_QK = {"llama"}

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path):
    """Every tensor of one safetensors file, as f32 arrays."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        a = np.frombuffer(data[s:e], dtype=ST_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32).reshape(info["shape"])
    return out


def read_checkpoint(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(d, f)))
    return tensors


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def permute(w, heads):
    """llama.cpp's rotary row order: within each head, rows (0, d/2, 1, d/2+1, ...) -> pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w, heads):
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def type_for(kind, gname):
    if kind == "MIXED_K":
        return T.Q6_K if any(k in gname for k in ("attn_v", "ffn_down", "output.weight")) else T.Q4_K
    if kind == "MIXED_LEGACY":
        return [T.Q4_0, T.Q8_0, T.Q5_1][sum(map(ord, gname)) % 3]
    return T[kind]


# Per K-quant type: the byte offsets of its f16 super-block scales (d, then dmin where it has
# one), the typical |w| / d of random blocks (so that d = 1 / (that * sqrt(cols)) gives weights of
# order 1/sqrt(fan_in), like a trained layer's), and dmin / d that centres the weights on zero.
K_SCALES = {
    T.Q2_K: ([80, 82], 10.0, 1.5),
    T.Q3_K: ([108], 32.0, None),
    T.Q4_K: ([0, 2], 240.0, 7.5),
    T.Q5_K: ([0, 2], 500.0, 15.5),
    T.Q6_K: ([208], 1000.0, None),
}


def random_k_blocks(qtype, shape, rng):
    """Seeded random blocks of a K-quant type for a [rows, cols] weight: random quants and
    sub-block scales, super-block scales that give zero-centred weights of order 1/sqrt(cols)."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    n = rows * cols // elems
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    offsets, typical, dmin_ratio = K_SCALES[qtype]
    d = rng.uniform(0.5, 1.5, size=n).astype(np.float32) / (typical * np.sqrt(cols))
    scales = [d] if dmin_ratio is None else [d, d * dmin_ratio]
    for off, v in zip(offsets, scales):
        raw[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // elems * size)


def encode(a, qtype, rng):
    """(the GGUF payload, its dequantized f32 values) of the f32 array `a` as `qtype`."""
    if qtype == T.F32:
        return a.astype(np.float32), a.astype(np.float32)
    if qtype in K_SCALES:
        q = random_k_blocks(qtype, a.shape, rng)
    else:
        q = gguf.quants.quantize(a.astype(np.float32), qtype)
    return q, gguf.quants.dequantize(q, qtype).reshape(a.shape).astype(np.float32)


def word(i):
    """The i-th lowercase word: a .. z, aa .. zz, aaa .. (bijective base 26)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    while True:
        s = letters[i % 26] + s
        i = i // 26 - 1
        if i < 0:
            return s


def synthetic_vocab(n, kind):
    if kind == "spm":
        tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
        types = [2, 3, 3] + [6] * 256
        i = 0
        while len(tokens) < n:
            # Every (parity, i // 2) a distinct word: llama.cpp refuses a vocabulary with repeats.
            tokens.append(("\u2581" if i % 2 == 0 else "") + word(i // 2))
            types.append(1)
            i += 1
        tokens, types = tokens[:n], types[:n]
        scores = [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(n - 259)]
        return tokens, scores[:n], types, None
    tokens = [bytes([b]).decode("latin-1") for b in range(256)]
    merges = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    for a in letters:
        for b in letters:
            if len(tokens) >= n - 1:
                break
            tokens.append(a + b)
            merges.append(a + " " + b)
    while len(tokens) < n - 1:
        tokens.append("<extra_%d>" % len(tokens))
    tokens.append("<|endoftext|>")
    types = [1] * (n - 1) + [3]
    return tokens, None, types, merges


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="F32")
    p.add_argument("--ref")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=["spm", "bpe"], default="spm")
    a = p.parse_args()

    cfg = json.load(open(os.path.join(a.hf_dir, "config.json")))
    arch = ARCH.get(cfg["architectures"][0])
    if arch is None:
        sys.exit("write_gguf.py: unsupported architecture " + cfg["architectures"][0])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tensors = read_checkpoint(a.hf_dir)
    rng = np.random.default_rng(a.seed)

    w = gguf.GGUFWriter(a.out, arch)
    w.add_name("tp test model")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window") and cfg["architectures"][0] == "MistralForCausalLM":
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(0)

    tokens, scores, types, merges = synthetic_vocab(cfg["vocab_size"], a.tokenizer)
    w.add_tokenizer_model("llama" if a.tokenizer == "spm" else "gpt2")
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
        w.add_tokenizer_pre("default")
        w.add_eos_token_id(len(tokens) - 1)
    else:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")

    ref = {}
    for name, t in tensors.items():
        if name in TOP_NAMES:
            gname = TOP_NAMES[name]
        else:
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                sys.exit("write_gguf.py: unexpected tensor " + name)
            gname = "blk.%s.%s" % (parts[2], LAYER_NAMES[".".join(parts[3:])])
        if arch in PERMUTES_QK and (".q_proj." in name or ".k_proj." in name):
            t = permute(t, heads if ".q_proj." in name else kv)
        qtype = T.F32 if t.ndim == 1 else type_for(a.type, gname)
        data, deq = encode(t, qtype, rng)
        if arch in PERMUTES_QK and (".q_proj." in name or ".k_proj." in name):
            deq = unpermute(deq, heads if ".q_proj." in name else kv)
        ref[name] = deq
        if qtype in (T.F32,):
            w.add_tensor(gname, data)
        elif qtype in (T.F16,):
            w.add_tensor(gname, data, raw_dtype=T.F16)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    if a.ref:
        os.makedirs(a.ref, exist_ok=True)
        rc = dict(cfg)
        rc["torch_dtype"] = "float32"
        rc.pop("dtype", None)
        json.dump(rc, open(os.path.join(a.ref, "config.json"), "w"), indent=1)
        write_safetensors(os.path.join(a.ref, "model.safetensors"), ref)


if __name__ == "__main__":
    main()
