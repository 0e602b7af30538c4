#!/usr/bin/env python3
"""Writes the golden fixtures of tests/gguf_tokenizer.rs: GGUF tokenizer metadata and what
transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` makes of it.

    make_fixtures.py                       # the committed fixtures, into this folder
    make_fixtures.py --gguf F.gguf [--set KEY=VALUE ...] [--texts FILE] --out OUT.json
                                           # one fixture from any GGUF file (local checks)

Each fixture (`NAME.json`) holds the vocabulary as `tp_models::gguf_tokenizer::GgufVocab`
fields (read back from the GGUF file by transformers' own GGUF reader) and, for every text of
TEXTS, transformers' `encode(text)` (add_special_tokens=True), `encode(text,
add_special_tokens=False)`, `decode(ids)` and `decode(ids, skip_special_tokens=True)`.

The committed vocabularies, all written as GGUF files first:
* `spm_synthetic`, `bpe_synthetic`: `crates/tp-testing/gguf/write_gguf.py --tokenizer spm|bpe`
  on a tiny Llama / Qwen2 folder made here (its synthetic SentencePiece and byte-level BPE
  vocabularies).
* `spm_trained`: a SentencePiece-style vocabulary (`<unk> <s> </s>`, 256 `<0x..>` byte tokens,
  pieces with `\u2581`, scores falling with the merge rank, no merges) from a BPE trained here
  with the `tokenizers` package on CORPUS, plus control and user-defined tokens.
* `spm_phi3`, `spm_gemma3`: the same as architecture `phi3` (with `add_eos_token` and
  `add_space_prefix` false, which transformers ignores) and `gemma3` (with tokens of spaces,
  which Gemma files store as spaces, and no scores to rank by), the two transformers builds its
  own way.
* `bpe_gpt2`, `bpe_llama3`, `bpe_qwen2`: a byte-level BPE trained on CORPUS with merges, as
  `tokenizer.ggml.pre` "gpt-2" (architecture gpt2), "llama-bpe" (llama, BOS added) and "qwen2"
  (qwen2), each with that family's special tokens, user-defined and mislabelled tokens.

Needs transformers (5.x), tokenizers, gguf and numpy; no network.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import gguf
import tokenizers
import transformers
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer
from transformers.integrations.gguf.reader import read_gguf_metadata

HERE = os.path.dirname(os.path.abspath(__file__))
WRITE_GGUF = os.path.join(HERE, "../../../../tp-testing/gguf/write_gguf.py")

TEXTS = [
    "",
    "Hello world",
    " Hello",
    "  two leading spaces",
    "trailing spaces   ",
    "   ",
    "\n",
    "Hello, world! How's it going? I'm fine; they'll see, we've done it, he'd say.",
    "'s 'S 'T 'Re 'LL don't WON'T",
    "1234567890 3.14159 1,000,000 -42 0x1F 2024-01-01",
    "line one\nline two\n\nline four\r\nend\n\n\n",
    "\ttab\tseparated\t\tvalues",
    "na\u00efve caf\u00e9 r\u00e9sum\u00e9 \u2014 \u201cquotes\u201d \u2018single\u2019 \u00a9 \u00bd",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u6807\u70b9\u3002",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "emoji \U0001F600\U0001F389\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467",
    "\U0001F4A9\U0001F4A9",
    "mixed123abc456DEF",
    "a\u00a0b non-breaking, zero\u200bwidth, e\u0301 combining",
    "\u01c4 \u01c5 \u01c6 \ufb01 ligature \u00c0\u00c9\u00ce\u00d5\u00dc",
    "def f(x):\n    return x**2  # square\n",
    "https://example.com/path?q=1&r=two#frag",
    "<s>inside</s> <unk>",
    "<|endoftext|>after<|endoftext|>",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<think>reasoning</think> answer",
    "\u2581already\u2581metaspace",
    "x\x00y\x01z",
]

CORPUS = """The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter.
Tokenizers split text into pieces; a byte-pair encoding merges the most frequent pairs first.
Hello world! Hello there, world. How are you doing today? I'm doing well, thank you.
We've seen that they'll come, and you'd know it. Don't worry: it won't break.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 1,000,000.
def tokenize(text):
    return [piece for piece in text.split()]
for i in range(10):
    print(i, i * i)
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, fa\u00e7ade, \u00fcber, Stra\u00dfe, ni\u00f1o.
\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440. \u65e5\u672c\u8a9e. \u4e2d\u6587\u3002
The model reads tokens, predicts the next token, and writes text back out again.
Large language models are trained on text; the tokenizer decides what a token is.
""" * 3

ARCH_KEYS = [
    ("context_length", 128),
    ("embedding_length", 8),
    ("block_count", 1),
    ("feed_forward_length", 16),
    ("attention.head_count", 2),
    ("attention.head_count_kv", 2),
]


def write_vocab_gguf(path, arch, v):
    """A vocabulary-only GGUF file (no tensors) of architecture `arch` with the fields of `v`."""
    w = gguf.GGUFWriter(path, arch)
    for key, val in ARCH_KEYS:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32(f"{arch}.vocab_size", len(v["tokens"]))
    w.add_tokenizer_model(v["model"])
    if v.get("pre") is not None:
        w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    if v.get("scores") is not None:
        w.add_token_scores(v["scores"])
    if v.get("token_types") is not None:
        w.add_token_types(v["token_types"])
    if v.get("merges") is not None:
        w.add_token_merges(v["merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        if v.get(key) is not None:
            add(v[key])
    for key, add in (("add_bos", w.add_add_bos_token), ("add_eos", w.add_add_eos_token),
                     ("add_space_prefix", w.add_add_space_prefix)):
        if v.get(key) is not None:
            add(v[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_vocab(path):
    """The GgufVocab fields of a GGUF file, read by transformers' reader (not tp's)."""
    m, _ = read_gguf_metadata(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                     "tokenizer.ggml.scores", "tokenizer.ggml.token_type"))
    g = lambda k: m.get("tokenizer.ggml." + k)
    scores = g("scores")
    return {
        "architecture": m.get("general.architecture"),
        "model": g("model"),
        "pre": g("pre"),
        "tokens": list(g("tokens")),
        # float32 values, exactly as stored (Python's repr of the widened double round-trips).
        "scores": None if scores is None else [float(np.float32(s)) for s in scores],
        "token_types": None if g("token_type") is None else [int(t) for t in g("token_type")],
        "merges": None if g("merges") is None else list(g("merges")),
        "bos": g("bos_token_id"), "eos": g("eos_token_id"),
        "unk": g("unknown_token_id"), "pad": g("padding_token_id"),
        "add_bos": g("add_bos_token"), "add_eos": g("add_eos_token"),
        "add_space_prefix": g("add_space_prefix"),
    }


def fixture(path, name, how, texts=TEXTS):
    """Loads `path` with transformers and records its answers on `texts`."""
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=True)
        cases.append({
            "text": text,
            "ids": ids,
            "ids_plain": tok.encode(text, add_special_tokens=False),
            "decoded": tok.decode(ids),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return {
        "name": name,
        "generated_by": (f"tests/data/gguf_tokenizer/make_fixtures.py ({how}) with transformers "
                         f"{transformers.__version__}, tokenizers {tokenizers.__version__}, "
                         f"gguf {getattr(gguf, '__version__', '?')}: AutoTokenizer.from_pretrained"
                         f"(dir, gguf_file=...) encode/decode; do not edit by hand"),
        "transformers_class": type(tok).__name__,
        "vocab": read_vocab(path),
        "cases": cases,
    }


def tiny_hf_folder(d, arch, vocab_size):
    """A tiny Hugging Face checkpoint folder write_gguf.py can read (random weights)."""
    sys.path.insert(0, os.path.dirname(WRITE_GGUF))
    from write_gguf import write_safetensors  # noqa: E402

    h, f = 8, 16
    cfg = {"architectures": [arch], "vocab_size": vocab_size, "hidden_size": h,
           "intermediate_size": f, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "tie_word_embeddings": False}
    os.makedirs(d, exist_ok=True)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.02
    t = {"model.embed_tokens.weight": r(vocab_size, h), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": r(vocab_size, h)}
    p = "model.layers.0."
    t.update({p + "input_layernorm.weight": np.ones(h, np.float32),
              p + "post_attention_layernorm.weight": np.ones(h, np.float32),
              p + "self_attn.q_proj.weight": r(h, h), p + "self_attn.k_proj.weight": r(h, h),
              p + "self_attn.v_proj.weight": r(h, h), p + "self_attn.o_proj.weight": r(h, h),
              p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
              p + "mlp.down_proj.weight": r(h, f)})
    if arch == "Qwen2ForCausalLM":
        for n in ("q", "k", "v"):
            t[p + f"self_attn.{n}_proj.bias"] = np.zeros(h, np.float32)
    write_safetensors(os.path.join(d, "model.safetensors"), t)


def synthetic(tmp, kind):
    arch = "LlamaForCausalLM" if kind == "spm" else "Qwen2ForCausalLM"
    hf = os.path.join(tmp, "hf_" + kind)
    tiny_hf_folder(hf, arch, 400 if kind == "spm" else 300)
    out = os.path.join(tmp, kind + "_synthetic", "model.gguf")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    subprocess.run([sys.executable, WRITE_GGUF, hf, out, "--tokenizer", kind], check=True)
    return out


def train(byte_level, size, specials):
    tok = tokenizers.Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return json.loads(tok.to_str())["model"]


def spm_trained():
    """A llama-style vocabulary: specials, byte tokens, merged pieces by rank, single chars last."""
    m = train(False, 420, [])
    merged = [" ".join(p) if isinstance(p, list) else p for p in m["merges"]]
    pieces = ["".join(p.split(" ")) for p in merged]
    chars = [t for t, _ in sorted(m["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    for i, p in enumerate(pieces):
        if p not in seen:
            seen.add(p)
            tokens.append(p), types.append(1), scores.append(-float(i))
    for j, c in enumerate(chars):
        if c not in seen:
            seen.add(c)
            tokens.append(c), types.append(1), scores.append(-float(len(pieces) + j))
    # Control tokens are matched whole and special; user-defined ones whole, not special;
    # an unused one (type 5) is an ordinary vocabulary entry.
    extra = [("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4), ("<unused0>", 5)]
    for t, ty in extra:
        tokens.append(t), types.append(ty), scores.append(0.0)
    return {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "token_types": types,
            "bos": 1, "eos": 2, "unk": 0, "add_bos": True, "add_eos": False}


def spm_gemma():
    """spm_trained as Gemma files write it: tokens of spaces as spaces, scores not in merge order."""
    v = spm_trained()
    v["tokens"] += ["  ", "   ", " \n", "\n\n"]
    v["scores"] = [0.0] * len(v["tokens"])
    v["token_types"] += [1, 1, 1, 1]
    return v


def bpe_trained(pre):
    """A byte-level vocabulary with merges and the special tokens of the family `pre` names."""
    specials = {
        "gpt-2": ["<|endoftext|>"],
        "llama-bpe": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                      "<|end_header_id|>", "<|eot_id|>"],
        "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    }[pre]
    m = train(True, 700, [])
    tokens = [t for t, _ in sorted(m["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(p) if isinstance(p, list) else p for p in m["merges"]]
    types = [1] * len(tokens)
    for s in specials:
        tokens.append(s), types.append(3)
    # <think> is user-defined (whole, not special); a user-defined token outside the byte
    # alphabet and a control one are respelled, so transformers does not add them whole.
    for t, ty in (("<think>", 4), ("</think>", 4), ("\u4f60\u597d", 4), ("<\uff5cfim\u2581hole\uff5c>", 3)):
        tokens.append(t), types.append(ty)
    v = {"model": "gpt2", "pre": pre, "tokens": tokens, "token_types": types, "merges": merges}
    first = len(tokens) - len(specials) - 4
    if pre == "gpt-2":
        v.update(bos=first, eos=first)
    elif pre == "llama-bpe":
        v.update(bos=first, eos=first + 4, add_bos=True, add_eos=False)
    else:
        v.update(eos=first, pad=first, add_bos=False)
    return v


def committed(outdir):
    with tempfile.TemporaryDirectory() as tmp:
        made = [("spm_synthetic", synthetic(tmp, "spm"), "write_gguf.py --tokenizer spm, tiny Llama"),
                ("bpe_synthetic", synthetic(tmp, "bpe"), "write_gguf.py --tokenizer bpe, tiny Qwen2")]
        for name, arch, v, how in (
            ("spm_trained", "llama", spm_trained(), "trained SentencePiece-style vocabulary"),
            ("spm_phi3", "phi3", dict(spm_trained(), add_eos=True, add_space_prefix=False),
             "trained SentencePiece-style vocabulary, architecture phi3, EOS added"),
            ("spm_gemma3", "gemma3", spm_gemma(), "trained SentencePiece-style vocabulary, architecture gemma3"),
            ("bpe_gpt2", "gpt2", bpe_trained("gpt-2"), "trained byte-level BPE, pre gpt-2"),
            ("bpe_llama3", "llama", bpe_trained("llama-bpe"), "trained byte-level BPE, pre llama-bpe"),
            ("bpe_qwen2", "qwen2", bpe_trained("qwen2"), "trained byte-level BPE, pre qwen2"),
        ):
            path = os.path.join(tmp, name, "model.gguf")
            os.makedirs(os.path.dirname(path))
            write_vocab_gguf(path, arch, v)
            made.append((name, path, how))
        for name, path, how in made:
            fx = fixture(path, name, how)
            with open(os.path.join(outdir, name + ".json"), "w", encoding="utf-8") as f:
                json.dump(fx, f, ensure_ascii=False, separators=(",", ":"))
                f.write("\n")
            print(name, fx["transformers_class"], len(fx["vocab"]["tokens"]), "tokens")


def from_gguf(path, sets, out, texts):
    """A fixture of any GGUF file, with tokenizer fields (and the architecture) overridden."""
    v = read_vocab(path)
    arch = v.pop("architecture")
    for s in sets:
        key, val = s.split("=", 1)
        if key == "architecture":
            arch = val
        else:
            v[key] = json.loads(val) if val[:1] in "0123456789tfn[" else val
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "model.gguf")
        write_vocab_gguf(p, arch, v)
        name = os.path.splitext(os.path.basename(out))[0]
        fx = fixture(p, name, f"from {os.path.basename(path)} {' '.join(sets)}", texts)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fx, f, ensure_ascii=False)
    print(out, fx["transformers_class"], len(v["tokens"]), "tokens")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gguf")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out")
    p.add_argument("--texts", help="more texts: a file of texts separated by lines __ggml_vocab_test__")
    a = p.parse_args()
    if a.gguf:
        texts = list(TEXTS)
        if a.texts:
            texts += open(a.texts, encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
        from_gguf(a.gguf, a.set, a.out, texts)
    else:
        committed(HERE)


if __name__ == "__main__":
    main()
