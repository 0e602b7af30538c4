//! Pipeline stages: which part of the model each stage holds.
//!
//! A model of `L` decoder layers split over `S` stages (`S = P` pipeline ranks, or `P × V` with
//! `V` virtual stages per rank, interleaved) gives stage `s` a contiguous run of layers; the
//! first stage also holds the embedding, the last the final norm and the LM head. With tied
//! embeddings the last stage keeps its own copy of the table as the head's weight: the two
//! copies start equal and stay equal because their gradients are summed between the two stages
//! before each update (see `tp-train`).
//!
//! The default split is vLLM's (`get_pp_indices`): `L / S` layers each, and the `L mod S` extra
//! layers one each to the stages just before the last, going backwards (the last stage already
//! carries the LM head, the first only the embedding lookup). `--pp-layer-partition 10,12,10`
//! (vLLM's `VLLM_PP_LAYER_PARTITION`) gives the counts instead; they must be `S` numbers summing
//! to `L` (a stage may hold no layer).

use crate::error::{ModelError, Result};
use std::ops::Range;

/// What one pipeline stage (or one virtual stage of an interleaved schedule) holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePart {
    /// The decoder layers, by their index in the whole model.
    pub layers: Range<usize>,
    /// The embedding (the first stage).
    pub embedding: bool,
    /// The final norm and the LM head (the last stage).
    pub head: bool,
}

impl StagePart {
    /// The whole model of `num_layers` layers (no pipeline).
    pub fn whole(num_layers: usize) -> StagePart {
        StagePart { layers: 0..num_layers, embedding: true, head: true }
    }
    /// Whether this part is the whole model.
    pub fn is_whole(&self, num_layers: usize) -> bool {
        *self == StagePart::whole(num_layers)
    }
}

/// Parses `--pp-layer-partition` (`"10,12,10"`): layer counts per stage.
///
/// Errors: an empty list or an entry that is not a whole number, naming it.
pub fn parse_layer_partition(s: &str) -> Result<Vec<usize>> {
    let bad =
        |why: String| ModelError::Unsupported { field: "--pp-layer-partition".into(), value: format!("{s:?}"), why };
    if s.trim().is_empty() {
        return Err(bad("give one layer count per stage, comma-separated (10,12,10)".into()));
    }
    s.split(',')
        .map(|p| p.trim().parse::<usize>().map_err(|_| bad(format!("{:?} is not a number of layers", p.trim()))))
        .collect()
}

/// The layers of each of `stages` stages of a `num_layers`-layer model: `partition` when given
/// (one count per stage, summing to `num_layers`), else vLLM's even split.
///
/// Errors: no stage; more stages than layers without a partition; a partition of another
/// length or sum.
pub fn partition_layers(num_layers: usize, stages: usize, partition: Option<&[usize]>) -> Result<Vec<Range<usize>>> {
    let bad = |why: String| ModelError::Unsupported {
        field: "pipeline stages".into(),
        value: format!("{stages} stages of a {num_layers}-layer model"),
        why,
    };
    if stages == 0 {
        return Err(bad("there must be at least one stage".into()));
    }
    let counts = match partition {
        Some(p) => {
            if p.len() != stages {
                return Err(bad(format!("--pp-layer-partition lists {} counts ({p:?}) for {stages} stages", p.len())));
            }
            let sum: usize = p.iter().sum();
            if sum != num_layers {
                return Err(bad(format!(
                    "--pp-layer-partition {p:?} sums to {sum}, not to the model's {num_layers} layers"
                )));
            }
            p.to_vec()
        }
        None => {
            if stages > num_layers {
                return Err(bad(format!(
                    "the pipeline has more stages than the model has layers ({num_layers}); use at most {num_layers} \
                     stages (or give --pp-layer-partition with empty stages)"
                )));
            }
            let mut counts = vec![num_layers / stages; stages];
            for i in 2..num_layers % stages + 2 {
                counts[stages - i] += 1;
            }
            counts
        }
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|n| {
            start += n;
            start - n..start
        })
        .collect())
}

/// The parts of `stages` stages in stage order: [`partition_layers`], the embedding on the
/// first, the head on the last.
///
/// Errors: as [`partition_layers`].
pub fn stage_parts(num_layers: usize, stages: usize, partition: Option<&[usize]>) -> Result<Vec<StagePart>> {
    let ranges = partition_layers(num_layers, stages, partition)?;
    Ok(ranges
        .into_iter()
        .enumerate()
        .map(|(s, layers)| StagePart { layers, embedding: s == 0, head: s + 1 == stages })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(n: usize, s: usize) -> Vec<usize> {
        partition_layers(n, s, None).unwrap().iter().map(|r| r.len()).collect()
    }

    #[test]
    fn even_split_gives_extras_to_the_stages_before_the_last() {
        assert_eq!(counts(32, 4), vec![8, 8, 8, 8]);
        assert_eq!(counts(30, 4), vec![7, 8, 8, 7]);
        assert_eq!(counts(31, 4), vec![8, 8, 8, 7]);
        assert_eq!(counts(5, 5), vec![1; 5]);
        assert_eq!(counts(7, 1), vec![7]);
        assert_eq!(counts(3, 2), vec![2, 1]);
        // Contiguous and covering.
        let r = partition_layers(30, 4, None).unwrap();
        assert_eq!(r.first().unwrap().start, 0);
        assert_eq!(r.last().unwrap().end, 30);
        assert!(r.windows(2).all(|w| w[0].end == w[1].start));
    }

    #[test]
    fn explicit_partition_and_its_errors() {
        let p = parse_layer_partition("10, 12,10").unwrap();
        assert_eq!(partition_layers(32, 3, Some(&p)).unwrap(), vec![0..10, 10..22, 22..32]);
        assert_eq!(partition_layers(2, 3, Some(&[0, 2, 0])).unwrap(), vec![0..0, 0..2, 2..2]);
        let e = partition_layers(32, 3, Some(&[10, 12])).unwrap_err().to_string();
        assert!(e.contains("2 counts") && e.contains("3 stages"), "{e}");
        let e = partition_layers(32, 3, Some(&[10, 12, 11])).unwrap_err().to_string();
        assert!(e.contains("sums to 33"), "{e}");
        assert!(parse_layer_partition("10,x").unwrap_err().to_string().contains("\"x\""));
        assert!(parse_layer_partition("").is_err());
        assert!(parse_layer_partition("-1,3").is_err());
    }

    #[test]
    fn more_stages_than_layers_is_refused() {
        let e = partition_layers(2, 3, None).unwrap_err().to_string();
        assert!(e.contains("more stages than the model has layers (2)"), "{e}");
        assert!(partition_layers(2, 0, None).is_err());
    }

    #[test]
    fn parts_put_embedding_first_and_head_last() {
        let p = stage_parts(5, 3, None).unwrap();
        assert_eq!(p[0], StagePart { layers: 0..2, embedding: true, head: false });
        assert_eq!(p[1], StagePart { layers: 2..4, embedding: false, head: false });
        assert_eq!(p[2], StagePart { layers: 4..5, embedding: false, head: true });
        assert_eq!(stage_parts(5, 1, None).unwrap(), vec![StagePart::whole(5)]);
    }
}
