//! [`SamplingParams`]: how one request picks its tokens (OpenAI's and vLLM's meanings).

/// Most top logprobs a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most `logit_bias` entries a request may carry (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// How a request picks each token from the logits `l` (one row, all `V` columns).
///
/// Applied in this order, as vLLM does:
/// 1. Penalties: `repetition_penalty` `r` on every id seen in the prompt or the output
///    (`l > 0 → l / r`, else `l · r`, as transformers); then, over the output's ids only,
///    `l -= frequency_penalty · count + presence_penalty · [count > 0]` (OpenAI).
/// 2. `temperature == 0`: the argmax (the lowest id on ties). Otherwise `l / temperature`.
/// 3. `min_p`: drop ids whose probability is below `min_p` times the largest.
/// 4. `top_k`: keep the `k` largest (ties at the boundary: the lower ids).
/// 5. `top_p`: keep the smallest set of the largest probabilities (renormalised after top-k)
///    whose sum reaches `top_p`.
/// 6. Draw from the softmax of what is left, with noise keyed by `(seed, output index, id)`, so
///    a seeded request draws the same tokens at any TP degree and in any batch.
///
/// Before step 1, as vLLM's logits processors do: a structured-output mask (ids it forbids
/// become `-inf`), `min_tokens` (the end-of-sequence and stop ids are `-inf` until that many
/// tokens were generated), then `logit_bias` added to its ids.
///
/// Logprobs are those of the model's raw logits (`log_softmax(l)` before any of this), as vLLM
/// returns by default.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// `0` for greedy; otherwise `> 0`. Default 1.
    pub temperature: f32,
    /// Keep the `k` most likely ids (`None`: all).
    pub top_k: Option<usize>,
    /// Nucleus mass, in `(0, 1]`; 1 keeps everything. Default 1.
    pub top_p: f32,
    /// In `[0, 1]`; 0 keeps everything. Default 0.
    pub min_p: f32,
    /// `> 0`; 1 is none. Default 1.
    pub repetition_penalty: f32,
    /// In `[-2, 2]`. Default 0.
    pub presence_penalty: f32,
    /// In `[-2, 2]`. Default 0.
    pub frequency_penalty: f32,
    /// The request's own seed (`None`: the engine draws one from its own seed).
    pub seed: Option<u64>,
    /// Return the chosen token's logprob and this many top alternatives (`<=`
    /// [`MAX_TOP_LOGPROBS`]); `None`: no logprobs.
    pub logprobs: Option<usize>,
    /// Generate at least this many tokens before an end-of-sequence or stop id may be drawn.
    /// Default 0.
    pub min_tokens: usize,
    /// `(id, bias)` added to those ids' logits, each bias in `[-100, 100]`, ids distinct and
    /// ascending (OpenAI's `logit_bias`). Default empty.
    pub logit_bias: Vec<(i64, f32)>,
    /// Return the logprob of every prompt token after the first (under the model's raw logits)
    /// with this many top alternatives (`<=` [`MAX_TOP_LOGPROBS`]); `None`: none. The prompt
    /// is then computed whole, not taken from the prefix cache.
    pub prompt_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            prompt_logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding, nothing else.
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..SamplingParams::default() }
    }

    /// Whether the choice is the plain argmax of the penalised logits.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }

    /// Checks every field's range; the error names the field (`(field, message)`).
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let finite = |name: &'static str, v: f32| {
            if v.is_finite() { Ok(()) } else { Err((name, format!("{name} must be a finite number, got {v}"))) }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err(("temperature", format!("temperature must be at least 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(("top_p", format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(("min_p", format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        if self.top_k == Some(0) {
            return Err(("top_k", "top_k must be at least 1 (or -1 for all)".into()));
        }
        if self.repetition_penalty <= 0.0 {
            return Err((
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {}", self.repetition_penalty),
            ));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err((name, format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(("logprobs", format!("at most {MAX_TOP_LOGPROBS} top logprobs, got {n}")));
        }
        if let Some(n) = self.prompt_logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return Err(("prompt_logprobs", format!("at most {MAX_TOP_LOGPROBS} prompt logprobs, got {n}")));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err((
                "logit_bias",
                format!("at most {MAX_LOGIT_BIAS} logit_bias entries, got {}", self.logit_bias.len()),
            ));
        }
        for (i, &(id, bias)) in self.logit_bias.iter().enumerate() {
            if id < 0 {
                return Err(("logit_bias", format!("logit_bias token {id} is not a token id")));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(("logit_bias", format!("logit_bias of token {id} must be in [-100, 100], got {bias}")));
            }
            if i > 0 && self.logit_bias[i - 1].0 >= id {
                return Err(("logit_bias", "logit_bias ids must be distinct and ascending".into()));
            }
        }
        Ok(())
    }
}
