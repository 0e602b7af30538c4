//! A Hugging Face [`tokenizers::Tokenizer`] from the tokenizer metadata of a GGUF file
//! (`tokenizer.ggml.*`), built as transformers builds it for
//! `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (transformers 5,
//! `integrations/gguf/gguf_tokenizer_mapping.py`), so that both give the same ids for the same
//! text and the same text for the same ids.
//!
//! * `llama` (SentencePiece-style) vocabularies: a byte-fallback BPE over the tokens as written
//!   (`▁` for a space, `<0x41>` byte tokens), with the file's merges or, where it has none (as
//!   llama.cpp's SentencePiece files), merges derived from the scores; a `▁` prepended to the
//!   text's first
//!   word and spaces written as `▁`. Phi-3 (`phi3`) and Gemma (`gemma`, `gemma2`, `gemma3`)
//!   architectures get transformers' variants of it.
//! * `gpt2` (byte-level BPE) vocabularies: the file's merges over GPT-2's byte alphabet, with
//!   the split regex `tokenizer.ggml.pre` names (Llama 3's for `llama-bpe`, Qwen2's for
//!   `qwen2`, ...; GPT-2's for `default`, `gpt-2` and names transformers does not know).
//!
//! Control tokens (type 3) are matched whole in the text and are special (skipped by
//! `decode(.., true)`); user-defined ones (type 4) are matched whole but are not special. BOS
//! is put before the text when `add_bos` says so (default: yes for `llama`, no for `gpt2`),
//! EOS after it when `add_eos` does.
//!
//! Where transformers departs from llama.cpp, this follows transformers: it ignores
//! `tokenizer.ggml.add_space_prefix`, and a special token it adds (BOS, EOS, UNK, PAD, and its
//! tokenizer class's own: `<|endoftext|>` for byte-level vocabularies, `<s>`, `</s>`, `<unk>`
//! for SentencePiece ones) that the vocabulary lacks as written gets the next id after the
//! vocabulary (Llama 3's gets `<|endoftext|>`; DeepSeek's BOS, spelled outside the byte
//! alphabet, is not found and gets one too).

mod merges;
mod splits;

use crate::error::{ModelError, Result};
use std::borrow::Cow;
use std::collections::HashSet;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"llama"` (SentencePiece-style) or `"gpt2"` (byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre` (`"default"`, `"llama-bpe"`, `"qwen2"`, `"gpt-2"`, ...): names the
    /// pre-tokenizer regex.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`, one per token.
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`, one per token: 1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, each `"left right"`, best first.
    pub merges: Option<Vec<String>>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (read, but ignored as transformers ignores it).
    pub add_space_prefix: Option<bool>,
    /// `general.architecture` (`"llama"`, `"phi3"`, `"gemma3"`, ...): transformers builds
    /// Phi-3's and Gemma's SentencePiece vocabularies its own way. `None`: as Llama's.
    pub architecture: Option<String>,
}

/// Token type of a control token (`<s>`, `<|im_start|>`): matched whole, special.
const CONTROL: i32 = 3;
/// Token type of a user-defined token (`<think>`): matched whole, not special.
const USER_DEFINED: i32 = 4;
/// SentencePiece's space.
const SPACE: &str = "\u{2581}";

/// The transformers tokenizer class a vocabulary is built with: its pipeline and the special
/// tokens its constructor adds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Builder {
    /// `LlamaTokenizer`: Metaspace, byte fallback.
    Llama,
    /// Phi-3: Llama's, but the `▁` prefix and spaces come from a normalizer.
    Phi3,
    /// `GemmaTokenizer`: spaces as `▁` by a normalizer, split after each, no prefix.
    Gemma,
    /// `GPT2Tokenizer`: byte-level BPE.
    ByteLevel,
}

impl Builder {
    fn of(v: &GgufVocab) -> Result<Self> {
        let arch = v.architecture.as_deref().unwrap_or("");
        match v.model.as_str() {
            "llama" if arch == "phi3" => Ok(Self::Phi3),
            "llama" if matches!(arch, "gemma" | "gemma2" | "gemma3") => Ok(Self::Gemma),
            "llama" => Ok(Self::Llama),
            "gpt2" => Ok(Self::ByteLevel),
            other => Err(bad(format!(
                "tokenizer.ggml.model = {:?} is not supported (tp builds \"llama\" and \"gpt2\" vocabularies)",
                cut(other)
            ))),
        }
    }

    /// The special tokens the class's constructor adds (bos, eos, unk, pad, mask order).
    fn defaults(self) -> &'static [&'static str] {
        match self {
            Self::Llama | Self::Phi3 => &["<s>", "</s>", "<unk>"],
            Self::Gemma => &["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"],
            Self::ByteLevel => &["<|endoftext|>"],
        }
    }
}

/// Builds the tokenizer transformers builds from `v`.
///
/// Fails (never panics) on a model other than `llama`/`gpt2`, no tokens, scores or token
/// types not one per token, a NaN score, a special token id out of range, a malformed merge or
/// one naming a token not in the vocabulary, and a vocabulary that gives neither merges nor
/// scores to derive them from.
pub fn tokenizer_from_gguf(v: &GgufVocab) -> Result<Tokenizer> {
    validate(v)?;
    let builder = Builder::of(v)?;
    let byte_chars = splits::byte_chars();
    let alphabet: HashSet<char> = byte_chars.iter().copied().collect();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    let mut tok = Tokenizer::new(bpe_model(v, builder, &byte_chars, &in_alphabet)?);
    pipeline(&mut tok, builder)?;

    // Added tokens, in transformers' order (an absent one gets the next id after the
    // vocabulary): the class's own specials, the file's control tokens, its user-defined ones.
    let special = |t: &str| AddedToken::from(t, true).normalized(false);
    let defaults: Vec<AddedToken> = builder.defaults().iter().map(|t| special(t)).collect();
    tok.add_tokens(&defaults);
    let types = v.token_types.as_deref().unwrap_or(&[]);
    // Typed and named tokens keep the file's spelling (Gemma's respelling is the model's only).
    let of_type = |ty: i32| v.tokens.iter().zip(types).filter(move |&(_, &t)| t == ty).map(|(t, _)| t.as_str());
    let control: Vec<AddedToken> =
        of_type(CONTROL).filter(|t| builder != Builder::ByteLevel || in_alphabet(t)).map(special).collect();
    tok.add_tokens(&control);
    let known = tok.get_vocab(true);
    let user: Vec<AddedToken> = of_type(USER_DEFINED)
        .filter(|t| known.contains_key(*t))
        .map(|t| AddedToken::from(t, false).normalized(false))
        .collect();
    tok.add_tokens(&user);

    if let Some(re) = v.pre.as_deref().and_then(splits::split_regex) {
        let split = Split::new(SplitPattern::Regex(re.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| bad(format!("tokenizer.ggml.pre regex: {e}")))?;
        let seq = vec![PreTokenizerWrapper::from(split), ByteLevel::new(false, true, false).into()];
        tok.with_pre_tokenizer(Some(PreTokenizerSequence::new(seq)));
    }

    // Then the named special tokens the final tokenizer is given, when not added yet.
    let name = |id: Option<u32>| id.and_then(|i| v.tokens.get(i as usize)).map(String::as_str);
    let (bos, eos) = (name(v.bos), name(v.eos));
    let mut named: Vec<&str> = [bos, eos, name(v.unk), name(v.pad)].into_iter().flatten().collect();
    if builder == Builder::Gemma {
        named.push("<mask>");
    }
    let added: HashSet<String> = tok.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
    let mut late: Vec<AddedToken> = Vec::new();
    for t in named {
        if !added.contains(t) && !late.iter().any(|a| a.content == t) {
            late.push(special(t));
        }
    }
    tok.add_tokens(&late);

    let add_bos = v.add_bos.unwrap_or(builder != Builder::ByteLevel) && bos.is_some();
    let add_eos = v.add_eos.unwrap_or(false) && eos.is_some();
    let post = post_processor(&tok, bos.filter(|_| add_bos), eos.filter(|_| add_eos))?;
    tok.with_post_processor(Some(post));
    Ok(tok)
}

/// The BPE model: the vocabulary (a repeated token keeps its last id; a byte-level token not
/// written in the byte alphabet is respelled byte by byte; Gemma's tokens of spaces as `▁`s)
/// and the file's or the derived merges.
fn bpe_model(
    v: &GgufVocab,
    builder: Builder,
    byte_chars: &[char; 256],
    in_alphabet: &dyn Fn(&str) -> bool,
) -> Result<BPE> {
    let tokens: Cow<[String]> = if builder == Builder::Gemma {
        Cow::Owned(v.tokens.iter().map(|t| gemma_spelling(t)).collect())
    } else {
        Cow::Borrowed(&v.tokens)
    };
    let mut vocab = Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        let key = if builder == Builder::ByteLevel && !in_alphabet(t) {
            t.bytes().map(|b| byte_chars[usize::from(b)]).collect()
        } else {
            t.clone()
        };
        // validate() bounds the number of tokens by u32::MAX.
        vocab.insert(key, id as u32);
    }
    let merges = merges(v, &tokens, builder)?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges);
    let bpe = match builder {
        Builder::ByteLevel => bpe.continuing_subword_prefix(String::new()).end_of_word_suffix(String::new()),
        Builder::Gemma => bpe.fuse_unk(true).byte_fallback(true).unk_token("<unk>".into()),
        Builder::Llama | Builder::Phi3 => bpe.fuse_unk(true).byte_fallback(true),
    };
    bpe.build().map_err(|e| bad(format!("tokenizer.ggml.merges: {e}")))
}

/// Checks the lengths, ids and scores `tokenizer_from_gguf` relies on.
fn validate(v: &GgufVocab) -> Result<()> {
    let n = v.tokens.len();
    if n == 0 {
        return Err(bad("tokenizer.ggml.tokens is empty".into()));
    }
    if u32::try_from(n).is_err() {
        return Err(bad(format!("tokenizer.ggml.tokens has {n} tokens, more than ids can number")));
    }
    if let Some(s) = &v.scores {
        if s.len() != n {
            return Err(bad(format!("tokenizer.ggml.scores has {} values for {n} tokens", s.len())));
        }
        if let Some(i) = s.iter().position(|x| x.is_nan()) {
            return Err(bad(format!("tokenizer.ggml.scores[{i}] is NaN")));
        }
    }
    if let Some(t) = &v.token_types {
        if t.len() != n {
            return Err(bad(format!("tokenizer.ggml.token_type has {} values for {n} tokens", t.len())));
        }
    }
    for (key, id) in [("bos", v.bos), ("eos", v.eos), ("unknown", v.unk), ("padding", v.pad)] {
        if let Some(id) = id.filter(|&i| i as usize >= n) {
            return Err(bad(format!("tokenizer.ggml.{key}_token_id = {id} is not below the {n} tokens")));
        }
    }
    Ok(())
}

/// The file's merges, or the ones its scores imply (Gemma: its token order).
fn merges(v: &GgufVocab, tokens: &[String], builder: Builder) -> Result<Vec<(String, String)>> {
    if let Some(m) = &v.merges {
        return m
            .iter()
            .enumerate()
            .map(|(i, m)| match m.split(' ').collect::<Vec<_>>().as_slice() {
                [l, r] => Ok((l.to_string(), r.to_string())),
                _ => Err(bad(format!("tokenizer.ggml.merges[{i}] = {:?} is not two tokens", cut(m)))),
            })
            .collect();
    }
    let scores: Vec<f64> = if builder == Builder::Gemma {
        (0..tokens.len()).map(|i| -(i as f64)).collect()
    } else {
        let s = v.scores.as_ref().ok_or_else(|| {
            bad(format!(
                "a {:?} vocabulary needs tokenizer.ggml.merges or tokenizer.ggml.scores to derive them from",
                cut(&v.model)
            ))
        })?;
        s.iter().map(|&x| f64::from(x)).collect()
    };
    Ok(merges::from_scores(tokens, &scores))
}

/// The normalizer, pre-tokenizer and decoder of `builder`'s class.
fn pipeline(tok: &mut Tokenizer, builder: Builder) -> Result<()> {
    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(|e| bad(format!("replace: {e}")));
    let spm_decoder = |strip: bool| -> Result<DecoderSequence> {
        let mut d: Vec<DecoderWrapper> =
            vec![replace(SPACE, " ")?.into(), ByteFallback::new().into(), Fuse::new().into()];
        if strip {
            d.push(Strip::new(' ', 1, 0).into());
        }
        Ok(DecoderSequence::new(d))
    };
    match builder {
        Builder::Llama => {
            tok.with_pre_tokenizer(Some(Metaspace::new('\u{2581}', PrependScheme::First, false)));
            tok.with_decoder(Some(spm_decoder(true)?));
        }
        Builder::Phi3 => {
            let n: Vec<NormalizerWrapper> = vec![Prepend::new(SPACE.into()).into(), replace(" ", SPACE)?.into()];
            tok.with_normalizer(Some(NormalizerSequence::new(n)));
            tok.with_decoder(Some(spm_decoder(true)?));
        }
        Builder::Gemma => {
            tok.with_normalizer(Some(replace(" ", SPACE)?));
            let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
                .map_err(|e| bad(format!("split: {e}")))?;
            tok.with_pre_tokenizer(Some(split));
            tok.with_decoder(Some(spm_decoder(false)?));
        }
        Builder::ByteLevel => {
            tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            tok.with_decoder(Some(ByteLevel::default()));
        }
    }
    Ok(())
}

/// transformers' `update_post_processor`: `[BOS] $A [EOS]` (`[BOS] $A [EOS] [BOS] $B [EOS]`
/// for pairs), each special token present when it is to be added.
fn post_processor(tok: &Tokenizer, bos: Option<&str>, eos: Option<&str>) -> Result<TemplateProcessing> {
    let mut specials: Vec<(String, u32)> = Vec::new();
    for t in [bos, eos].into_iter().flatten() {
        let id = tok.token_to_id(t).ok_or_else(|| bad(format!("special token {:?} has no id", cut(t))))?;
        specials.push((t.to_string(), id));
    }
    let mut single: Vec<String> = Vec::new();
    let mut pair: Vec<String> = Vec::new();
    for (ty, seq, out) in [(0, "$A", &mut single), (1, "$B", &mut pair)] {
        out.extend(bos.map(|t| format!("{t}:{ty}")));
        out.push(format!("{seq}:{ty}"));
        out.extend(eos.map(|t| format!("{t}:{ty}")));
    }
    let pair: Vec<String> = single.iter().cloned().chain(pair).collect();
    let template = |e: String| bad(format!("special tokens template: {e}"));
    TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(template)?
        .special_tokens(specials)
        .build()
        .map_err(|e| template(e.to_string()))
}

/// Gemma's spelling of a token: one of spaces only (Python's `str.isspace`) and holding a space
/// becomes as many `▁`.
fn gemma_spelling(t: &str) -> String {
    let py_space = |c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c);
    if t.contains(' ') && t.chars().all(py_space) { SPACE.repeat(t.chars().count()) } else { t.to_string() }
}

/// A metadata error.
fn bad(why: String) -> ModelError {
    ModelError::Vocabulary(why)
}

/// `s` cut to 64 characters for an error message.
fn cut(s: &str) -> String {
    s.chars().take(64).collect()
}
