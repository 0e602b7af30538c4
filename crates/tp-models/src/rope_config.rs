//! Rotary parameters of a Hugging Face config, in both forms real checkpoints use.

use crate::error::{ModelError, Result};
use crate::fields::{Fields, shown, shown_value};
use crate::rope_kinds::{RopeKindError, rope_scaling_from_kind};
use serde_json::Value;
use std::cell::RefCell;
use tp_core::RopeScaling;

/// What a family's config class changes in how its rope parameters read.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RopeFamily {
    /// The class's own `original_max_position_embeddings`, which wins over the parameters' for
    /// longrope (Phi-3: 4096).
    pub original_max_position_embeddings: Option<usize>,
    /// Kinds the class reads as `longrope` besides `longrope` itself (Phi-3: `su` and `yarn`).
    pub longrope_aliases: &'static [&'static str],
}

/// `(rope_theta, scaling)` from `rope_parameters` (transformers 5) or `rope_theta` +
/// `rope_scaling` (transformers 4), read as transformers 5 reads either: the kind is `rope_type`
/// (else `type`, else `default`); `linear` and `dynamic` need `factor` (dynamic also the
/// config's `max_position_embeddings`); `yarn` needs the `factor` key (`null`:
/// `max_position_embeddings / original_max_position_embeddings`) and takes the optional
/// `attention_factor`, `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim` and `truncate`; for
/// `yarn` and `llama3`, a top-level `original_max_position_embeddings` wins over the one in the
/// parameters, and both absent mean `max_position_embeddings` (transformers'
/// `standardize_rope_params`).
pub(crate) fn rope(
    f: &Fields<'_>,
    default_theta: f64,
    max_position_embeddings: usize,
    family: RopeFamily,
) -> Result<(f64, RopeScaling)> {
    let (params, theta) = match f.get("rope_parameters") {
        Some(Value::Object(p)) => {
            let pf = Fields { map: p, prefix: "rope_parameters.".into() };
            (Some(pf), None)
        }
        Some(v) => return Err(f.bad("rope_parameters", format!("must be an object, got {}", shown_value(v)))),
        None => match f.get("rope_scaling") {
            Some(Value::Object(p)) => (
                Some(Fields { map: p, prefix: "rope_scaling.".into() }),
                Some(f.positive("rope_theta", Some(default_theta))?),
            ),
            Some(v) => return Err(f.bad("rope_scaling", format!("must be an object or null, got {}", shown_value(v)))),
            None => (None, Some(f.positive("rope_theta", Some(default_theta))?)),
        },
    };
    let Some(p) = params else {
        return Ok((theta.unwrap_or(default_theta), RopeScaling::Default));
    };
    rope_params(f, &p, theta, default_theta, max_position_embeddings, family)
}

/// `(rope_theta, scaling)` from one parameters object `p` (a transformers 5 `rope_parameters`,
/// or a transformers 4 `rope_scaling` with the top-level `theta`).
pub(crate) fn rope_params(
    f: &Fields<'_>,
    p: &Fields<'_>,
    // The base when the caller read it (checked positive), else read from `p`.
    theta: Option<f64>,
    default_theta: f64,
    max_position_embeddings: usize,
    family: RopeFamily,
) -> Result<(f64, RopeScaling)> {
    let theta = match theta {
        Some(t) => t,
        None => p.positive("rope_theta", Some(f.number("rope_theta", Some(default_theta))?))?,
    };
    let kind = match (p.string("rope_type")?, p.string("type")?) {
        (Some(k), _) | (None, Some(k)) => k.to_string(),
        (None, None) => "default".to_string(),
    };
    if kind == "longrope" || family.longrope_aliases.contains(&kind.as_str()) {
        return Ok((theta, longrope(f, p, &kind, max_position_embeddings, family.original_max_position_embeddings)?));
    }
    // What only JSON can say: a yarn factor that is absent (an error) rather than null (the
    // ratio of lengths), truncate as a boolean, and a top-level original length.
    if kind == "yarn" && !p.map.contains_key("factor") {
        return Err(p.bad("factor", "is missing (null: max_position_embeddings / original_max_position_embeddings)"));
    }
    let truncate = if kind == "yarn" { p.flag("truncate", true)? } else { true };
    let top_original = match kind.as_str() {
        "yarn" | "llama3" if f.get("original_max_position_embeddings").is_some() => {
            Some(f.positive("original_max_position_embeddings", None)?)
        }
        _ => None,
    };
    // Which parameters a kind reads, and their bounds, are `rope_scaling_from_kind`'s; a field it
    // asks for that is not a number is noted here and reported first, by its own field name.
    let not_a_number: RefCell<Option<String>> = RefCell::new(None);
    let param = |name: &str| match name {
        "max_position_embeddings" => Some(max_position_embeddings as f64),
        "original_max_position_embeddings" if top_original.is_some() => top_original,
        "truncate" => Some(if truncate { 1.0 } else { 0.0 }),
        _ => {
            let v = p.get(name)?;
            if v.as_f64().is_none() {
                not_a_number.borrow_mut().get_or_insert_with(|| name.to_string());
            }
            v.as_f64()
        }
    };
    let scaling = rope_scaling_from_kind(&kind, param);
    if let Some(name) = not_a_number.into_inner() {
        p.number(&name, None)?; // the error naming the field
    }
    let scaling = scaling.map_err(|e| match e {
        RopeKindError { param: Some(name), why, .. } => {
            let fields = if name == "max_position_embeddings" { f } else { p };
            fields.bad(&name, why)
        }
        e => ModelError::Unsupported {
            field: p.name("rope_type"),
            value: shown(&format!("{kind:?}")),
            why: e.to_string(),
        },
    })?;
    Ok((theta, scaling))
}

/// LongRoPE (`longrope`, or Phi-3's older `su`), read as transformers 5 reads it: `short_factor`
/// and `long_factor` (lists of numbers), `original_max_position_embeddings` (the top-level field
/// wins, as Phi-3's config always has one, default 4096; else the parameters'; else
/// `max_position_embeddings`), `factor` (absent: `max_position_embeddings / original`) and
/// `attention_factor` (absent: `sqrt(1 + ln(factor) / ln(original))`, 1 for `factor <= 1`).
fn longrope(
    f: &Fields<'_>,
    p: &Fields<'_>,
    kind: &str,
    max_position_embeddings: usize,
    family_original: Option<usize>,
) -> Result<RopeScaling> {
    let list = |key: &str| -> Result<Vec<f64>> {
        let v = p.get(key).ok_or_else(|| {
            p.bad(key, format!("is missing ({} needs short_factor and long_factor)", shown(&format!("{kind:?}"))))
        })?;
        let items = v.as_array().ok_or_else(|| p.bad(key, "must be a list of numbers"))?;
        items
            .iter()
            .map(|x| {
                x.as_f64().filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| p.bad(key, "must hold positive numbers"))
            })
            .collect()
    };
    let (short_factor, long_factor) = (list("short_factor")?, list("long_factor")?);
    let original = if f.get("original_max_position_embeddings").is_some() {
        f.count("original_max_position_embeddings", None)? as f64
    } else if let Some(o) = family_original {
        o as f64
    } else {
        p.count("original_max_position_embeddings", Some(max_position_embeddings))? as f64
    };
    let factor = p.number("factor", Some(max_position_embeddings as f64 / original))?;
    let attention_factor = match p.get("attention_factor") {
        Some(_) => p.positive("attention_factor", None)?,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / original.ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings: original,
        attention_factor,
    })
}
