//! The fixed-size header every collective and point-to-point message starts with: 16 `u64`s.
//!
//! | word | field |
//! |---|---|
//! | 0 | magic `"tp-mpi\0\x01"` |
//! | 1 | operation ([`Op`]) |
//! | 2 | the group's collective sequence number (0 for point-to-point) |
//! | 3 | sender's rank in the group |
//! | 4 | dtype (0 none, 1 f32, 2 f16, 3 bf16, 4 i32, 5 i64) |
//! | 5 | number of dims (at most [`MAX_DIMS`]) |
//! | 6 | argument: the dim of a gather or scatter, the root of a broadcast, the reduce op |
//! | 7 | payload bytes that follow |
//! | 8..16 | dims |

use crate::{CommError, ReduceOp, Result};
use tp_core::DType;

/// Most dims a tensor that crosses the MPI backend may have.
pub(crate) const MAX_DIMS: usize = 8;
const MAGIC: u64 = u64::from_le_bytes(*b"tp-mpi\0\x01");

/// Which call a header belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllGather = 1,
    AllReduce = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Barrier = 5,
    Send = 6,
    AllToAll = 7,
}

impl Op {
    fn name(code: u64) -> &'static str {
        match code {
            1 => "all_gather",
            2 => "all_reduce",
            3 => "reduce_scatter",
            4 => "broadcast",
            5 => "barrier",
            6 => "send",
            7 => "all_to_all",
            _ => "an unknown call",
        }
    }
}

/// A header as words on the wire.
pub(crate) type Words = [u64; 16];

/// A decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub op: u64,
    pub seq: u64,
    pub from: usize,
    pub dtype: Option<DType>,
    pub dims: Vec<usize>,
    pub arg: u64,
    pub bytes: u64,
}

fn dtype_code(d: Option<DType>) -> u64 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::F16) => 2,
        Some(DType::BF16) => 3,
        Some(DType::I32) => 4,
        Some(DType::I64) => 5,
    }
}

fn dtype_of(code: u64) -> Option<DType> {
    match code {
        1 => Some(DType::F32),
        2 => Some(DType::F16),
        3 => Some(DType::BF16),
        4 => Some(DType::I32),
        5 => Some(DType::I64),
        _ => None,
    }
}

/// The argument word of a reduction.
pub(crate) fn reduce_arg(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
        ReduceOp::Avg => 3,
    }
}

impl Header {
    /// A header for `op` carrying a tensor of `dtype` and `dims` (`bytes` of payload).
    pub(crate) fn new(
        name: &'static str,
        op: Op,
        seq: u64,
        from: usize,
        tensor: Option<(DType, &[usize])>,
        arg: u64,
    ) -> Result<Header> {
        let (dtype, dims) = match tensor {
            Some((d, dims)) => (Some(d), dims.to_vec()),
            None => (None, Vec::new()),
        };
        if dims.len() > MAX_DIMS {
            return Err(CommError::Limit {
                op: name,
                why: format!("a tensor of {} dims crosses the MPI backend (at most {MAX_DIMS})", dims.len()),
            });
        }
        let numel: usize = dims.iter().product();
        let bytes = dtype.map_or(0, |d| numel * d.size_in_bytes()) as u64;
        Ok(Header { op: op as u64, seq, from, dtype, dims, arg, bytes })
    }

    pub(crate) fn encode(&self) -> Words {
        let mut w = [0u64; 16];
        w[0] = MAGIC;
        w[1] = self.op;
        w[2] = self.seq;
        w[3] = self.from as u64;
        w[4] = dtype_code(self.dtype);
        w[5] = self.dims.len() as u64;
        w[6] = self.arg;
        w[7] = self.bytes;
        for (i, d) in self.dims.iter().enumerate() {
            w[8 + i] = *d as u64;
        }
        w
    }

    /// Decodes words received from `peer`, refusing what no tp rank sends.
    pub(crate) fn decode(name: &str, peer: usize, w: &Words) -> Result<Header> {
        let bad = |why: &str| CommError::Mismatch { op: name.into(), why: format!("rank {peer} sent {why}") };
        if w[0] != MAGIC {
            return Err(bad("a message that is not a tp header (another program on this communicator?)"));
        }
        let ndim = usize::try_from(w[5]).unwrap_or(usize::MAX);
        if ndim > MAX_DIMS {
            return Err(bad("a header with too many dims"));
        }
        let dims: Vec<usize> = w[8..8 + ndim].iter().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect();
        let dtype = dtype_of(w[4]);
        let numel = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = numel.and_then(|n| n.checked_mul(dtype.map_or(0, DType::size_in_bytes)));
        if bytes.map(|b| b as u64) != Some(w[7]) || usize::try_from(w[3]).ok() != Some(peer) {
            return Err(bad("an inconsistent header"));
        }
        Ok(Header { op: w[1], seq: w[2], from: peer, dtype, dims, arg: w[6], bytes: w[7] })
    }

    /// `"all_reduce #3 of [4, 8] bf16 (arg 0)"`, for mismatch messages.
    pub(crate) fn describe(&self) -> String {
        let t = match self.dtype {
            Some(d) => format!(" of {:?} {d}", self.dims),
            None => String::new(),
        };
        format!("{} #{}{t} (arg {})", Op::name(self.op), self.seq, self.arg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_refuse_garbage() {
        let h = Header::new("t", Op::AllGather, 7, 2, Some((DType::BF16, &[3, 5])), 1).unwrap();
        assert_eq!(h.bytes, 30);
        assert_eq!(Header::decode("t", 2, &h.encode()).unwrap(), h);
        // From another rank than it claims, or with a payload that does not match its dims.
        assert!(Header::decode("t", 1, &h.encode()).is_err());
        let mut w = h.encode();
        w[7] = 31;
        assert!(Header::decode("t", 2, &w).is_err());
        w = h.encode();
        w[0] = 0;
        assert!(Header::decode("t", 2, &w).is_err());
        assert!(Header::new("t", Op::Send, 0, 0, Some((DType::F32, &[1; 9])), 0).is_err());
    }
}
