#!/usr/bin/env python3
"""Writes a Hugging Face causal-LM folder as a GGUF file, the way llama.cpp's converter lays it
out, with the `gguf` package's writer and quantizers, for tp's tests and benchmarks.

    write_gguf.py HF_DIR OUT.gguf --type Q4_0 [--ref REF_DIR] [--seed N] [--tokenizer spm|spm-space|bpe]
                  [--meta KEY=N] [--drop-tensor NAME] [--extra-tensor NAME] [--pad ID]

* Names and metadata follow llama.cpp's converter (`blk.N.attn_q.weight`,
  `llama.embedding_length`, ...; names from the `gguf` package's tensor map, as the converter
  takes them) for the architectures `llama` (Llama, Mistral), `qwen2`, `qwen3`, `gemma3`, `phi3`
  and `olmo2`, with what it changes in the tensors:
  - `llama`: the rows of Q and K permuted into llama.cpp's rotary layout;
  - `gemma3`: every norm stored as `1 + w` (Gemma3RMSNorm's weight); the global rope base and
    any linear scaling, the local base (`rope.freq_base_swa`), `attention.key_length`,
    `final_logit_softcapping`, `attention.sliding_window` (unless `sliding_window_pattern` is
    1). llama.cpp takes every 6th layer as full attention; where the config's layer types differ
    from that, `attention.sliding_window_pattern` (one bool per layer, which llama.cpp's loader
    reads) is written too. A `query_pre_attn_scalar` other than the one llama.cpp assumes
    (`head_dim`; 27B: `hidden / heads`) is refused: the file would be another model;
  - `phi3`: fused `attn_qkv` and `ffn_up` (gate and up) as the checkpoint holds them;
    `rope.dimension_count` the rotated features (`int(partial_rotary_factor * hidden) //
    heads`), `rope.scaling.original_context_length`, `attention.sliding_window` (0: none); with
    LongRoPE, `rope.scaling.attn_factor` and the `rope_factors_long` / `rope_factors_short`
    tensors (F32);
  - `olmo2`: norms after attention and after the MLP (`post_attention_norm`, `post_ffw_norm`);
  - `gpt-oss`: the interleaved fused experts split as its converter splits them (gate rows even,
    up rows odd, transposed to `[E, rows, columns]`), their biases as `ffn_*_exps.bias: [E, rows]`,
    the router's as `ffn_gate_inp.bias`, the sinks as `attn_sinks`, `attention.sliding_window`,
    YaRN's `rope.scaling.{type,factor,original_context_length}`, `expert_feed_forward_length`;
    the --ref folder holds its experts one tensor per expert and projection (tp reads that
    layout too);
  - mixtures of experts (`llama` for Mixtral, `qwen2moe`, `qwen3moe`, `olmoe`): `expert_count`,
    `expert_used_count`, `expert_feed_forward_length` and `expert_shared_feed_forward_length`
    (Qwen); the router as `ffn_gate_inp` (F32, as the converter keeps it), each projection's
    experts stacked into one 3-D tensor (`ffn_{gate,up,down}_exps: [E, rows, columns]`), Qwen2-MoE's
    shared expert as `ffn_{gate,up,down}_shexp` and its gate as the vector `ffn_gate_inp_shexp`.
* `--type` is the type of every 2-D weight (norms and biases stay F32): F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1 quantize the checkpoint's values with `gguf.quants`; the K-quants
  (Q2_K .. Q6_K), which `gguf` cannot quantize, are written as seeded random blocks of that
  type with small, finite scales: a valid file whose weights are whatever those blocks hold.
  `MXFP4` quantizes with `gguf.quants` too; `MXFP4_EXPERTS` makes the experts MXFP4 and every
  other weight F32 (a gpt-oss file whose experts hold exactly MXFP4-representable values stays
  exact). `MIXED_K` gives the tensors the types of llama.cpp's Q4_K_M mixture (Q6_K for `attn_v`,
  `ffn_down` and `output`, Q4_K elsewhere), and `MIXED_LEGACY` alternates Q4_0 / Q8_0 / Q5_1.
* `--ref REF_DIR` writes the same model as a Hugging Face folder in f32 holding exactly the
  weights the GGUF file holds (each tensor dequantized by `gguf.quants.dequantize`, the Q/K
  permutation undone, Gemma's stored norms less 1 in f32, as transformers' GGUF loader reads
  them back), its config the original's with LongRoPE factors rounded to f32 as the file holds
  them: the independent reference the tests load beside the GGUF file.
* `--meta KEY=N` sets `{arch}.KEY` to the u32 `N`, `--drop-tensor` leaves a GGUF tensor out,
  `--extra-tensor` adds a 1-D F32 tensor of zeros: files tp must refuse, for its tests.
  `--pad ID` writes `tokenizer.ggml.padding_token_id` (default: the config's `pad_token_id`).
* The tokenizer (`tokenizer.ggml.*`) is a synthetic one of the config's vocabulary size:
  SentencePiece-style (`llama`: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, pieces with
  scores) or byte-level BPE (`gpt2`: tokens and merges). `spm-space` adds "\u2581" as a piece
  of its own, as real SentencePiece vocabularies have, so that llama.cpp, transformers and tp
  split a text into the same tokens (for serving comparisons).
"""

import argparse
import json
import math
import os
import re
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
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt-oss",
}
# An MoE layer's per-expert projections (Hugging Face: experts.{e}.NAME) and llama.cpp's stacked tensors.
EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
               "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
SHARED_PROJ = {"gate_proj": "ffn_gate_shexp", "up_proj": "ffn_up_shexp", "down_proj": "ffn_down_shexp"}
PERMUTES_QK = {"llama"}
NORM_PLUS_ONE = {"gemma3"}

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
    if kind == "MXFP4_EXPERTS":
        return T.MXFP4 if "_exps." in gname else T.F32
    if kind == "MIXED_K":
        q6 = gname == "output.weight" or any(k in gname for k in (".attn_v.", ".ffn_down."))
        return T.Q6_K if q6 else T.Q4_K
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
    """Seeded random blocks of a K-quant type for a [.., rows, cols] weight: random quants and
    sub-block scales, super-block scales that give zero-centred weights of order 1/sqrt(cols)."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    rows = int(np.prod(lead))
    n = rows * cols // elems
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    offsets, typical, dmin_ratio = K_SCALES[qtype]
    d = rng.uniform(0.5, 1.5, size=n).astype(np.float32) / (typical * np.sqrt(cols))
    scales = [d] if dmin_ratio is None else [d, d * dmin_ratio]
    for off, v in zip(offsets, scales):
        raw[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(*lead, cols // elems * size)


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
    if kind in ("spm", "spm-space"):
        tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
        types = [2, 3, 3] + [6] * 256
        if kind == "spm-space":
            # "\u2581" as a piece of its own, as real SentencePiece vocabularies have: without
            # it, llama.cpp merges "\u2581" + "w" by string while transformers' converted
            # tokenizer (and tp's) falls back to its bytes, so the two count different tokens.
            tokens.append("\u2581")
            types.append(1)
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


def rope_params(cfg):
    """The rope parameters as llama.cpp's converter reads them: transformers 5's
    `rope_parameters`, else 4's `rope_scaling`, with the top-level keys mirrored in."""
    p = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" not in p and "sliding_attention" not in p:
        if cfg.get("rope_local_base_freq") is not None:
            p["sliding_attention"] = {"rope_theta": cfg["rope_local_base_freq"]}
        if "rope_theta" not in p and cfg.get("rope_theta") is not None:
            p["rope_theta"] = cfg["rope_theta"]
        if "rope_type" not in p and p.get("type") is not None:
            p["rope_type"] = p["type"]
        for k in ("partial_rotary_factor", "original_max_position_embeddings"):
            if k not in p and cfg.get(k) is not None:
                p[k] = cfg[k]
    return p


def gemma3_layer_types(cfg):
    """Per layer, whether it slides (Gemma3TextConfig's rule)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return [t == "sliding_attention" for t in cfg["layer_types"]]
    period = cfg.get("sliding_window_pattern", 6)
    return [bool((i + 1) % period) for i in range(n)]


def write_gemma3(w, cfg, rp, head_dim):
    full = rp.get("full_attention", rp)
    kind = full.get("rope_type", "default")
    if kind == "linear" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif kind != "default":
        sys.exit("write_gguf.py: gemma3 rope type %r is not written" % kind)
    w.add_rope_freq_base(float(full.get("rope_theta", 1_000_000.0)))
    local = rp.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        w.add_rope_freq_base_swa(float(local))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("attn_logit_softcapping") is not None:
        sys.exit("write_gguf.py: llama.cpp's converter refuses Gemma 3 with attn_logit_softcapping")
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg.get("sliding_window") or 4096)
        types = gemma3_layer_types(cfg)
        if types != [i % 6 < 5 for i in range(len(types))]:
            w.add_sliding_window_pattern(types)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    implied = cfg["hidden_size"] // heads if layers == 62 else head_dim
    if cfg.get("query_pre_attn_scalar", 256) != implied:
        sys.exit("write_gguf.py: query_pre_attn_scalar %s is not the %s llama.cpp assumes"
                 % (cfg.get("query_pre_attn_scalar", 256), implied))


def write_phi3(w, cfg, rp):
    """Phi-3's metadata; returns its extra tensors (LongRoPE's factors)."""
    n_embd, heads, max_pos = cfg["hidden_size"], cfg["num_attention_heads"], cfg["max_position_embeddings"]
    orig = rp.get("original_max_position_embeddings", 4096)
    rope_dims = int(rp.get("partial_rotary_factor", 1.0) * n_embd) // heads
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(float(rp.get("full_attention", rp).get("rope_theta", 10000.0)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    long, short = rp.get("long_factor"), rp.get("short_factor")
    if not long:
        return []
    scale = max_pos / orig
    kind = rp.get("rope_type", "").lower()
    if kind in ("su", "longrope"):
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif kind == "yarn":
        attn_factor = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
    else:
        sys.exit("write_gguf.py: phi3 rope type %r is not written" % kind)
    w.add_rope_scaling_attn_factors(attn_factor)
    if len(long) != len(short) or len(long) != rope_dims / 2:
        sys.exit("write_gguf.py: LongRoPE factors must number rope dims / 2 = %s" % (rope_dims / 2))
    return [("rope_factors_long.weight", np.array(long, dtype=np.float32)),
            ("rope_factors_short.weight", np.array(short, dtype=np.float32))]


def write_metadata(w, arch, cfg, heads, kv, head_dim):
    """The model's metadata as llama.cpp's converter writes it for `arch`; returns the extra
    tensors it generates."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)
    rp = rope_params(cfg)
    if arch == "gemma3":
        write_gemma3(w, cfg, rp, head_dim)
        return []
    if arch == "phi3":
        return write_phi3(w, cfg, rp)
    # The base as transformers 5 writes it (in rope_parameters), else the top-level key.
    w.add_rope_freq_base(float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch == "olmo2":
        if cfg.get("head_dim") is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if "sliding_window" in cfg:
            w.add_sliding_window(cfg["sliding_window"])
        return []
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if cfg.get("sliding_window") and cfg["architectures"][0] in ("MistralForCausalLM", "MixtralForCausalLM"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gpt-oss":
        w.add_sliding_window(cfg.get("sliding_window") or 128)
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        if rp.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp.get("original_max_position_embeddings", 4096))
    write_moe(w, cfg)
    return []


def split_gpt_oss(tensors):
    """gpt-oss's interleaved fused experts as one tensor per expert and projection (Hugging Face's
    per-expert names), biases included: gate_up_proj [E, H, 2I] -> gate rows 0::2, up rows 1::2 of
    its transpose; down_proj [E, I, H] -> its transpose."""
    for name in [n for n in tensors if ".mlp.experts." in n]:
        t = tensors.pop(name)
        prefix, what = name.rsplit(".", 1)
        if what == "gate_up_proj":
            parts = {"gate_proj.weight": t.transpose(0, 2, 1)[:, 0::2], "up_proj.weight": t.transpose(0, 2, 1)[:, 1::2]}
        elif what == "gate_up_proj_bias":
            parts = {"gate_proj.bias": t[:, 0::2], "up_proj.bias": t[:, 1::2]}
        elif what == "down_proj":
            parts = {"down_proj.weight": t.transpose(0, 2, 1)}
        elif what == "down_proj_bias":
            parts = {"down_proj.bias": t}
        else:
            sys.exit("write_gguf.py: unexpected gpt-oss tensor " + name)
        for suffix, stacked in parts.items():
            for e in range(stacked.shape[0]):
                tensors[f"{prefix}.{e}.{suffix}"] = np.ascontiguousarray(stacked[e])


def write_moe(w, cfg):
    """A mixture of experts' metadata (nothing for a dense model)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def moe_gguf_name(name):
    """(llama.cpp name, expert index or None, is the shared gate) of an MoE layer's tensor, else None."""
    m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)\.(weight|bias)$", name)
    if not m:
        return None
    layer, rest, param = m.groups()
    if rest in ("gate", "router"):
        return f"blk.{layer}.ffn_gate_inp.{param}", None, False
    if param == "bias":
        e = re.match(r"experts\.(\d+)\.(\w+)$", rest)
        if e and e.group(2) in EXPERT_PROJ:
            return f"blk.{layer}.{EXPERT_PROJ[e.group(2)]}.bias", int(e.group(1)), False
        return None
    if rest == "shared_expert_gate":
        return f"blk.{layer}.ffn_gate_inp_shexp.weight", None, True
    e = re.match(r"experts\.(\d+)\.(\w+)$", rest)
    if e and e.group(2) in EXPERT_PROJ:
        return f"blk.{layer}.{EXPERT_PROJ[e.group(2)]}.weight", int(e.group(1)), False
    s = re.match(r"shared_expert\.(\w+)$", rest)
    if s and s.group(1) in SHARED_PROJ:
        return f"blk.{layer}.{SHARED_PROJ[s.group(1)]}.weight", None, False
    return None


def reference_config(cfg):
    """The config of the --ref folder: the original's, LongRoPE factors rounded to f32 as the
    GGUF file holds them."""
    rc = json.loads(json.dumps(cfg))
    rc["torch_dtype"] = "float32"
    rc.pop("dtype", None)
    for key in ("rope_scaling", "rope_parameters"):
        p = rc.get(key)
        for f in ("long_factor", "short_factor"):
            if isinstance(p, dict) and p.get(f):
                p[f] = [float(np.float32(x)) for x in p[f]]
    return rc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="F32")
    p.add_argument("--ref")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=["spm", "spm-space", "bpe"], default="spm")
    # For tests of files tp refuses: a u32 `{arch}.KEY` set (or overridden), a GGUF tensor
    # left out, a 1-D F32 tensor of zeros added.
    p.add_argument("--meta", action="append", default=[], metavar="KEY=N")
    p.add_argument("--drop-tensor", action="append", default=[], metavar="NAME")
    p.add_argument("--extra-tensor", action="append", default=[], metavar="NAME")
    # tokenizer.ggml.padding_token_id (default: the config's pad_token_id, if any).
    p.add_argument("--pad", type=int)
    a = p.parse_args()

    cfg = json.load(open(os.path.join(a.hf_dir, "config.json")))
    arch = ARCH.get(cfg["architectures"][0])
    if arch is None:
        sys.exit("write_gguf.py: unsupported architecture " + cfg["architectures"][0])
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tensors = read_checkpoint(a.hf_dir)
    if arch == "gpt-oss":
        split_gpt_oss(tensors)
    rng = np.random.default_rng(a.seed)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg["num_hidden_layers"])

    w = gguf.GGUFWriter(a.out, arch)
    w.add_name("tp test model")
    extra_tensors = write_metadata(w, arch, cfg, heads, kv, head_dim)
    for kv_arg in a.meta:
        key, value = kv_arg.split("=", 1)
        w.add_uint32("%s.%s" % (arch, key), int(value))
    extra_tensors += [(n, np.zeros(8, dtype=np.float32)) for n in a.extra_tensor]

    tokens, scores, types, merges = synthetic_vocab(cfg["vocab_size"], a.tokenizer)
    w.add_tokenizer_model("gpt2" if a.tokenizer == "bpe" else "llama")
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
    pad = a.pad if a.pad is not None else cfg.get("pad_token_id")
    if pad is not None:
        w.add_pad_token_id(pad)
    if arch == "gemma3":
        w.add_add_space_prefix(False)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")

    ref = {}
    # An MoE layer's experts: each projection's E tensors stacked into one 3-D tensor.
    stacked = {}
    for name in list(tensors):
        moe = moe_gguf_name(name)
        if moe is None:
            continue
        gname, expert, row = moe
        t = tensors.pop(name)
        if expert is not None:
            stacked.setdefault(gname, {})[expert] = (name, t)
        elif row or gname.endswith("ffn_gate_inp.weight") or gname.endswith("ffn_gate_inp.bias"):
            # The router and its bias (F32, as the converter keeps them) and the shared expert's
            # gate (a vector).
            data = t.reshape(-1).astype(np.float32) if row else t.astype(np.float32)
            ref[name] = data.reshape(t.shape)
            if gname not in a.drop_tensor:
                w.add_tensor(gname, data)
        else:
            tensors[name + "@" + gname] = t
    for gname, parts in stacked.items():
        order = sorted(parts)
        full = np.stack([parts[e][1] for e in order]).astype(np.float32)
        qtype = T.F32 if gname.endswith(".bias") else type_for(a.type, gname)
        data, deq = encode(full, qtype, rng)
        for i, e in enumerate(order):
            ref[parts[e][0]] = deq[i]
        if gname not in a.drop_tensor:
            w.add_tensor(gname, data, raw_dtype=None if qtype == T.F32 else qtype)
    for name, t in tensors.items():
        if "@" in name:
            name, gname = name.split("@")
        elif name.endswith(".self_attn.sinks"):
            gname = "blk.%s.attn_sinks.weight" % name.split(".")[2]
        else:
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            sys.exit("write_gguf.py: unexpected tensor " + name)
        permuted = arch in PERMUTES_QK and (".q_proj." in name or ".k_proj." in name)
        if permuted:
            t = permute(t, heads if ".q_proj." in name else kv)
        plus_one = arch in NORM_PLUS_ONE and name.endswith("norm.weight")
        if plus_one:
            t = t.astype(np.float32) + np.float32(1)
        qtype = T.F32 if t.ndim == 1 else type_for(a.type, gname)
        data, deq = encode(t, qtype, rng)
        if permuted:
            deq = unpermute(deq, heads if ".q_proj." in name else kv)
        if plus_one:
            deq = deq - np.float32(1)
        ref[name] = deq
        if gname in a.drop_tensor:
            continue
        if qtype in (T.F32,):
            w.add_tensor(gname, data)
        elif qtype in (T.F16,):
            w.add_tensor(gname, data, raw_dtype=T.F16)
        else:
            w.add_tensor(gname, data, raw_dtype=qtype)
    for gname, data in extra_tensors:
        if gname not in a.drop_tensor:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    if a.ref:
        os.makedirs(a.ref, exist_ok=True)
        json.dump(reference_config(cfg), open(os.path.join(a.ref, "config.json"), "w"), indent=1)
        write_safetensors(os.path.join(a.ref, "model.safetensors"), ref)


if __name__ == "__main__":
    main()
