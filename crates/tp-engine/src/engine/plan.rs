//! What rank 0 tells the other ranks before each step, as a flat list of `i64` words that one
//! broadcast carries (after a two-word header broadcast with its kind and length).
//!
//! A step message announces new requests (their prompt, sampling parameters and seed: every rank
//! samples every request, so every rank needs them), forgets ended ones, and lists the sequences
//! the step runs ([`ScheduledSeq`]: the ids fed, the context already cached, the block table,
//! whether to sample). Decoding checks every count and range, so a corrupt message is an error,
//! never a panic or an absurd allocation.

use crate::api::RequestId;
use crate::sampling::SamplingParams;
use crate::scheduler::ScheduledSeq;

/// What a step message asks of the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepKind {
    /// Run the listed sequences (possibly none: only announcements).
    Run,
    /// Nothing to do; proves rank 0 is alive within the collectives' deadline.
    Idle,
    /// Stop: every rank leaves its loop.
    Stop,
}

impl StepKind {
    pub(crate) fn code(self) -> i64 {
        match self {
            StepKind::Run => 1,
            StepKind::Idle => 2,
            StepKind::Stop => 3,
        }
    }
    pub(crate) fn from_code(c: i64) -> Option<StepKind> {
        match c {
            1 => Some(StepKind::Run),
            2 => Some(StepKind::Idle),
            3 => Some(StepKind::Stop),
            _ => None,
        }
    }
}

/// A request the ranks have not seen yet.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NewSeq {
    pub id: RequestId,
    pub seed: u64,
    pub params: SamplingParams,
    pub prompt: Vec<i64>,
    /// Ids the request may not draw before `params.min_tokens` tokens (its end-of-sequence and
    /// stop ids; empty without `min_tokens`).
    pub min_stop: Vec<i64>,
    /// Its LoRA adapter's slot (0: the base model).
    pub adapter: u32,
}

/// One step's message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepMsg {
    pub kind: StepKind,
    pub new: Vec<NewSeq>,
    pub drop: Vec<RequestId>,
    pub seqs: Vec<ScheduledSeq>,
    /// The sampled sequences with a structured-output constraint, in `seqs` order: after the
    /// forward pass rank 0 broadcasts one mask per entry (`ceil(vocab / 64)` words each).
    pub masked: Vec<RequestId>,
    /// LoRA slots to fill from an adapter folder (`Some(path)`) or empty (`None`), before the
    /// step runs.
    pub adapters: Vec<(u32, Option<String>)>,
    /// Each sequence's whole known length (prompt and output so far), in `seqs` order, when
    /// the steps are pipelined: the ranks before the last stage do not see the sampled tokens,
    /// so they take the lengths the rotary frequencies follow from here (empty otherwise).
    pub rope_lens: Vec<usize>,
}

impl StepMsg {
    /// A message of `kind` with nothing in it.
    pub(crate) fn empty(kind: StepKind) -> StepMsg {
        StepMsg {
            kind,
            new: Vec::new(),
            drop: Vec::new(),
            seqs: Vec::new(),
            masked: Vec::new(),
            adapters: Vec::new(),
            rope_lens: Vec::new(),
        }
    }

    /// Whether it runs nothing and announces nothing (an idle heartbeat could carry it).
    pub(crate) fn is_empty(&self) -> bool {
        self.seqs.is_empty() && self.new.is_empty() && self.drop.is_empty() && self.adapters.is_empty()
    }

    /// The payload words (the kind travels in the header).
    pub(crate) fn encode(&self) -> Vec<i64> {
        let mut w = Vec::new();
        w.push(self.new.len() as i64);
        for n in &self.new {
            w.push(n.id as i64);
            w.push(n.seed as i64);
            encode_params(&n.params, &mut w);
            w.push(n.prompt.len() as i64);
            w.extend_from_slice(&n.prompt);
            w.push(n.min_stop.len() as i64);
            w.extend_from_slice(&n.min_stop);
            w.push(i64::from(n.adapter));
        }
        w.push(self.drop.len() as i64);
        w.extend(self.drop.iter().map(|&d| d as i64));
        w.push(self.seqs.len() as i64);
        for s in &self.seqs {
            w.push(s.id as i64);
            w.push(s.context as i64);
            w.push(i64::from(s.sample));
            w.push(s.cached_tokens as i64);
            w.push(s.draft as i64);
            w.push(s.tokens.len() as i64);
            w.extend_from_slice(&s.tokens);
            w.push(s.blocks.len() as i64);
            w.extend(s.blocks.iter().map(|&b| i64::from(b)));
        }
        w.push(self.masked.len() as i64);
        w.extend(self.masked.iter().map(|&d| d as i64));
        w.push(self.adapters.len() as i64);
        for (slot, path) in &self.adapters {
            w.push(i64::from(*slot));
            w.push(i64::from(path.is_some()));
            if let Some(p) = path {
                w.push(p.len() as i64);
                w.extend(p.bytes().map(i64::from));
            }
        }
        w.push(self.rope_lens.len() as i64);
        w.extend(self.rope_lens.iter().map(|&n| n as i64));
        w
    }

    /// Reads a message of `kind` back from its payload words.
    pub(crate) fn decode(kind: StepKind, words: &[i64]) -> Result<StepMsg, String> {
        let mut r = Reader { words, at: 0 };
        let mut msg = StepMsg::empty(kind);
        for _ in 0..r.count()? {
            let id = r.word()? as u64;
            let seed = r.word()? as u64;
            let params = decode_params(&mut r)?;
            let n = r.count()?;
            let prompt = r.take(n)?.to_vec();
            let n = r.count()?;
            let min_stop = r.take(n)?.to_vec();
            let adapter = r.word()?;
            let adapter = u32::try_from(adapter).map_err(|_| format!("adapter slot {adapter} out of range"))?;
            msg.new.push(NewSeq { id, seed, params, prompt, min_stop, adapter });
        }
        for _ in 0..r.count()? {
            msg.drop.push(r.word()? as u64);
        }
        for _ in 0..r.count()? {
            let id = r.word()? as u64;
            let context = r.size()?;
            let sample = r.word()? != 0;
            let cached_tokens = r.size()?;
            let draft = r.size()?;
            let n = r.count()?;
            let tokens = r.take(n)?.to_vec();
            if draft >= n.max(1) || (draft > 0 && !sample) {
                return Err(format!("a draft of {draft} in a part of {n} tokens"));
            }
            let n = r.count()?;
            let blocks = r
                .take(n)?
                .iter()
                .map(|&b| u32::try_from(b).map_err(|_| format!("block id {b} out of range")))
                .collect::<Result<Vec<_>, _>>()?;
            msg.seqs.push(ScheduledSeq { id, tokens, context, blocks, sample, cached_tokens, draft });
        }
        for _ in 0..r.count()? {
            msg.masked.push(r.word()? as u64);
        }
        for _ in 0..r.count()? {
            let slot = r.word()?;
            let slot = u32::try_from(slot).map_err(|_| format!("adapter slot {slot} out of range"))?;
            let path = match r.word()? {
                0 => None,
                1 => {
                    let n = r.count()?;
                    let bytes: Vec<u8> = r
                        .take(n)?
                        .iter()
                        .map(|&b| u8::try_from(b).map_err(|_| format!("path byte {b} out of range")))
                        .collect::<Result<_, _>>()?;
                    Some(String::from_utf8(bytes).map_err(|_| "an adapter path is not UTF-8".to_string())?)
                }
                w => return Err(format!("adapter change flag {w} is neither 0 nor 1")),
            };
            msg.adapters.push((slot, path));
        }
        for _ in 0..r.count()? {
            msg.rope_lens.push(r.size()?);
        }
        if !msg.rope_lens.is_empty() && msg.rope_lens.len() != msg.seqs.len() {
            return Err(format!("{} rotary lengths for {} sequences", msg.rope_lens.len(), msg.seqs.len()));
        }
        if r.at != words.len() {
            return Err(format!("{} words left over after the message", words.len() - r.at));
        }
        Ok(msg)
    }
}

fn f32_word(v: f32) -> i64 {
    i64::from(v.to_bits())
}

fn encode_params(p: &SamplingParams, w: &mut Vec<i64>) {
    w.push(f32_word(p.temperature));
    w.push(p.top_k.map_or(-1, |k| k as i64));
    w.push(f32_word(p.top_p));
    w.push(f32_word(p.min_p));
    w.push(f32_word(p.repetition_penalty));
    w.push(f32_word(p.presence_penalty));
    w.push(f32_word(p.frequency_penalty));
    w.push(p.seed.map_or(-1, |s| (s & (i64::MAX as u64)) as i64));
    w.push(p.seed.map_or(0, |s| (s >> 63) as i64));
    w.push(p.logprobs.map_or(-1, |n| n as i64));
    w.push(p.min_tokens as i64);
    w.push(p.prompt_logprobs.map_or(-1, |n| n as i64));
    w.push(p.logit_bias.len() as i64);
    for &(id, bias) in &p.logit_bias {
        w.push(id);
        w.push(f32_word(bias));
    }
}

fn decode_params(r: &mut Reader<'_>) -> Result<SamplingParams, String> {
    let f = |r: &mut Reader<'_>| -> Result<f32, String> {
        let v = r.word()?;
        u32::try_from(v).map(f32::from_bits).map_err(|_| format!("bad float word {v}"))
    };
    let temperature = f(r)?;
    let top_k = r.optional()?;
    let (top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty) = (f(r)?, f(r)?, f(r)?, f(r)?, f(r)?);
    let low = r.word()?;
    let high = r.word()?;
    let seed = (low >= 0).then_some(low as u64 | ((high as u64) << 63));
    let logprobs = r.optional()?;
    let min_tokens = r.size()?;
    let prompt_logprobs = r.optional()?;
    let n = r.count()?;
    let logit_bias = (0..n).map(|_| Ok((r.word()?, f(r)?))).collect::<Result<Vec<_>, String>>()?;
    let p = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed,
        logprobs,
        min_tokens,
        logit_bias,
        prompt_logprobs,
    };
    p.validate().map_err(|(_, m)| m)?;
    Ok(p)
}

/// Reads words with bounds checks.
struct Reader<'a> {
    words: &'a [i64],
    at: usize,
}

impl Reader<'_> {
    fn word(&mut self) -> Result<i64, String> {
        let w = *self.words.get(self.at).ok_or("the message ends early")?;
        self.at += 1;
        Ok(w)
    }
    /// A count or length: non-negative and no more than the words left (every counted item
    /// takes at least one word).
    fn count(&mut self) -> Result<usize, String> {
        let w = self.word()?;
        usize::try_from(w).ok().filter(|&n| n <= self.words.len()).ok_or_else(|| format!("count {w} out of range"))
    }
    /// A position or length that counts no following words: non-negative.
    fn size(&mut self) -> Result<usize, String> {
        let w = self.word()?;
        usize::try_from(w).map_err(|_| format!("size {w} out of range"))
    }
    /// `-1` for none, else a count.
    fn optional(&mut self) -> Result<Option<usize>, String> {
        let w = self.word()?;
        if w == -1 {
            return Ok(None);
        }
        usize::try_from(w).map(Some).map_err(|_| format!("value {w} out of range"))
    }
    fn take(&mut self, n: usize) -> Result<&[i64], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.words.len()).ok_or("the message ends early")?;
        let s = &self.words[self.at..end];
        self.at = end;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_survives_the_round_trip_and_corruption_is_an_error() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: Some(5),
            seed: Some(u64::MAX - 3),
            logprobs: Some(2),
            min_tokens: 3,
            logit_bias: vec![(4, -1.5), (9, 100.0)],
            prompt_logprobs: Some(4),
            ..Default::default()
        };
        let msg = StepMsg {
            kind: StepKind::Run,
            new: vec![NewSeq {
                id: 7,
                seed: u64::MAX,
                params,
                prompt: vec![1, 2, 3],
                min_stop: vec![2, 0],
                adapter: 3,
            }],
            drop: vec![3, 4],
            seqs: vec![ScheduledSeq {
                id: 7,
                tokens: vec![2, 3],
                context: 1,
                blocks: vec![9, 0],
                sample: true,
                cached_tokens: 1,
                draft: 1,
            }],
            masked: vec![7],
            adapters: vec![(2, Some("/tmp/adapter é".into())), (1, None)],
            rope_lens: vec![4],
        };
        let w = msg.encode();
        assert_eq!(StepMsg::decode(StepKind::Run, &w).unwrap(), msg);
        for cut in 0..w.len() {
            assert!(StepMsg::decode(StepKind::Run, &w[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = w.clone();
        bad[0] = i64::MAX;
        assert!(StepMsg::decode(StepKind::Run, &bad).is_err());
        let mut extra = w;
        extra.push(0);
        assert!(StepMsg::decode(StepKind::Run, &extra).is_err());
    }
}
