//! Hugging Face's rope kinds: the `rope_type` names and the parameter names transformers reads
//! for each (`factor`, `beta_fast`, `mscale_all_dim`, `low_freq_factor`, ...), with its
//! defaults, into tp-core's [`RopeScaling`] values.

use tp_core::RopeScaling;

/// A rope kind tp does not implement, or a parameter of one it does that is missing or out of
/// range (`param` names the parameter, so a config reader can name its field).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("rope scaling {kind:?} is not supported: {why}")]
pub struct RopeKindError {
    /// The `rope_type` as given.
    pub kind: String,
    /// The parameter at fault, if one is.
    pub param: Option<String>,
    /// What is wrong, in one line.
    pub why: String,
}

/// YaRN's `get_mscale`: `0.1 · mscale · ln(scale) + 1`, or 1 for `scale <= 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 }
}

/// The scaling a Hugging Face config names (`rope_scaling.rope_type`, or its older `type`),
/// its numeric parameters read through `param`, as transformers 5 reads them:
///
/// * `linear`: `factor`.
/// * `dynamic`: `factor`, `max_position_embeddings` (the config's top-level field).
/// * `yarn`: `factor` (absent: `max_position_embeddings / original_max_position_embeddings`,
///   transformers' reading of `factor: null`), `original_max_position_embeddings` (absent:
///   `max_position_embeddings`), optional `beta_fast` (absent or 0: 32), `beta_slow` (absent
///   or 0: 1), `truncate` (0 is false; absent: true), `attention_factor` (absent: from `factor`,
///   through `mscale` and `mscale_all_dim` when both are given and non-zero).
/// * `llama3`: `factor`, `low_freq_factor`, `high_freq_factor`,
///   `original_max_position_embeddings` (absent: `max_position_embeddings`).
///
/// Errors: [`RopeKindError`] naming any other kind (`longrope`, ...), or a
/// parameter that is missing, non-finite, or not positive (or equal llama3 band edges);
/// its `param` names the parameter.
pub fn rope_scaling_from_kind(kind: &str, param: impl Fn(&str) -> Option<f64>) -> Result<RopeScaling, RopeKindError> {
    let bad = |name: Option<&str>, why: String| RopeKindError {
        kind: kind.to_string(),
        param: name.map(str::to_string),
        why,
    };
    let check = |name: &str, v: f64| {
        if v.is_finite() && v > 0.0 { Ok(v) } else { Err(bad(Some(name), format!("{name} = {v} must be positive"))) }
    };
    let get = |name: &str| check(name, param(name).ok_or_else(|| bad(Some(name), format!("missing {name}")))?);
    let finite = |name: &str| match param(name) {
        Some(v) if !v.is_finite() => Err(bad(Some(name), format!("{name} = {v} must be finite"))),
        v => Ok(v),
    };
    // transformers' standardisation: original_max_position_embeddings defaults to the
    // config's max_position_embeddings.
    let original = || match param("original_max_position_embeddings") {
        Some(v) => check("original_max_position_embeddings", v),
        None => get("max_position_embeddings").map_err(|_| {
            bad(
                Some("original_max_position_embeddings"),
                "missing original_max_position_embeddings (and max_position_embeddings)".into(),
            )
        }),
    };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: get("factor")? }),
        "dynamic" => {
            let max_position_embeddings = get("max_position_embeddings")?;
            if max_position_embeddings.fract() != 0.0 {
                return Err(bad(
                    Some("max_position_embeddings"),
                    format!("max_position_embeddings = {max_position_embeddings} must be an integer"),
                ));
            }
            Ok(RopeScaling::Dynamic { factor: get("factor")?, max_position_embeddings })
        }
        "yarn" => {
            let original_max_position_embeddings = original()?;
            let factor = match param("factor") {
                Some(f) => check("factor", f)?,
                None => check(
                    "factor",
                    get("max_position_embeddings")
                        .map_err(|_| bad(Some("factor"), "missing factor (and max_position_embeddings)".into()))?
                        / original_max_position_embeddings,
                )?,
            };
            // Python's `x or default`: absent and 0 both take the default.
            let or = |v: Option<f64>, default: f64| v.filter(|&v| v != 0.0).unwrap_or(default);
            let beta_fast = or(finite("beta_fast")?, 32.0);
            let beta_slow = or(finite("beta_slow")?, 1.0);
            let truncate = finite("truncate")?.is_none_or(|t| t != 0.0);
            // Checked even where an explicit attention_factor makes them unused.
            let (mscale, mscale_all_dim) = (or(finite("mscale")?, 0.0), or(finite("mscale_all_dim")?, 0.0));
            let attention_factor = match param("attention_factor") {
                Some(a) => check("attention_factor", a)?,
                None if mscale != 0.0 && mscale_all_dim != 0.0 => {
                    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                }
                None => yarn_mscale(factor, 1.0),
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            })
        }
        "llama3" => {
            let s = RopeScaling::Llama3 {
                factor: get("factor")?,
                low_freq_factor: get("low_freq_factor")?,
                high_freq_factor: get("high_freq_factor")?,
                original_max_position_embeddings: original()?,
            };
            if let RopeScaling::Llama3 { low_freq_factor: lo, high_freq_factor: hi, .. } = s
                && lo == hi
            {
                return Err(bad(None, "low_freq_factor must differ from high_freq_factor".into()));
            }
            Ok(s)
        }
        other => Err(RopeKindError {
            kind: other.to_string(),
            param: None,
            why: "tp implements \"default\", \"linear\", \"dynamic\", \"yarn\" and \"llama3\"".into(),
        }),
    }
}
