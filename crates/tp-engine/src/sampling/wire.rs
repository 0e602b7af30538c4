//! The sharded sampler's messages: each round every rank writes a list of `i64` words (floats by
//! their bits), all of the same length on every rank, and one all-gather hands everyone all lists.

use super::SampleError;
use super::math::Cand;
use tp_comm::DeviceGroup;
use tp_core::{Device, Tensor};

/// A message being written.
#[derive(Default)]
pub(crate) struct Writer(Vec<i64>);

impl Writer {
    /// An empty message.
    pub(crate) fn new() -> Writer {
        Writer(Vec::new())
    }
    /// Whether nothing was written.
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// A count or id (saturating at `i64::MAX`, which no real count reaches).
    pub(crate) fn size(&mut self, v: usize) {
        self.0.push(i64::try_from(v).unwrap_or(i64::MAX));
    }
    /// An f32 by its bits.
    pub(crate) fn f32(&mut self, v: f32) {
        self.0.push(i64::from(v.to_bits()));
    }
    /// An f64 by its bits.
    pub(crate) fn f64(&mut self, v: f64) {
        self.0.push(v.to_bits() as i64);
    }
    /// A u128 as two words (high, low).
    pub(crate) fn u128(&mut self, v: u128) {
        self.0.push((v >> 64) as u64 as i64);
        self.0.push(v as u64 as i64);
    }
    /// A candidate, or an empty slot.
    pub(crate) fn cand(&mut self, c: Option<&Cand>) {
        match c {
            Some(c) => {
                self.f32(c.pen);
                self.f32(c.raw);
                self.size(c.id);
            }
            None => self.0.extend([0, 0, -1]),
        }
    }
    /// Exactly `slots` candidates: the first `slots` of `cands`, then empty slots.
    pub(crate) fn cands(&mut self, cands: &[Cand], slots: usize) {
        for i in 0..slots {
            self.cand(cands.get(i));
        }
    }
}

/// One rank's message being read, in the order it was written.
pub(crate) struct Reader {
    words: Vec<i64>,
    pos: usize,
    rank: usize,
}

impl Reader {
    fn next(&mut self) -> Result<i64, SampleError> {
        let w = self.words.get(self.pos).copied().ok_or_else(|| {
            SampleError::Disagree(format!("rank {}'s message ends after {} words", self.rank, self.words.len()))
        })?;
        self.pos += 1;
        Ok(w)
    }
    /// A count or id written by [`Writer::size`].
    pub(crate) fn size(&mut self) -> Result<usize, SampleError> {
        let v = self.next()?;
        usize::try_from(v).map_err(|_| SampleError::Disagree(format!("rank {} sent a count of {v}", self.rank)))
    }
    /// An f32.
    pub(crate) fn f32(&mut self) -> Result<f32, SampleError> {
        let v = self.next()?;
        u32::try_from(v)
            .map(f32::from_bits)
            .map_err(|_| SampleError::Disagree(format!("rank {} sent {v} for an f32", self.rank)))
    }
    /// An f64.
    pub(crate) fn f64(&mut self) -> Result<f64, SampleError> {
        Ok(f64::from_bits(self.next()? as u64))
    }
    /// A u128.
    pub(crate) fn u128(&mut self) -> Result<u128, SampleError> {
        let hi = self.next()? as u64;
        let lo = self.next()? as u64;
        Ok((u128::from(hi) << 64) | u128::from(lo))
    }
    /// A candidate or an empty slot; an id outside the vocabulary is an error.
    pub(crate) fn cand(&mut self, vocab: usize) -> Result<Option<Cand>, SampleError> {
        let pen = self.f32()?;
        let raw = self.f32()?;
        let id = self.next()?;
        if id == -1 {
            return Ok(None);
        }
        match usize::try_from(id) {
            Ok(id) if id < vocab => Ok(Some(Cand { pen, raw, id })),
            _ => Err(SampleError::Disagree(format!("rank {} sent id {id} outside 0..{vocab}", self.rank))),
        }
    }
    /// `slots` candidate slots, the filled ones in order.
    pub(crate) fn cands(&mut self, slots: usize, vocab: usize) -> Result<Vec<Cand>, SampleError> {
        let mut out = Vec::with_capacity(slots);
        for _ in 0..slots {
            if let Some(c) = self.cand(vocab)? {
                out.push(c);
            }
        }
        Ok(out)
    }
    /// Checks that the whole message was read.
    pub(crate) fn finish(&self) -> Result<(), SampleError> {
        if self.pos == self.words.len() {
            Ok(())
        } else {
            Err(SampleError::Disagree(format!(
                "rank {} sent {} words where {} were expected",
                self.rank,
                self.words.len(),
                self.pos
            )))
        }
    }
}

/// Every rank's message, in rank order (one all-gather; none at world size 1 or for empty
/// messages). Every rank must pass a message of the same length.
pub(crate) fn exchange(group: &DeviceGroup, msg: Writer) -> Result<Vec<Reader>, SampleError> {
    let world = group.world_size();
    let len = msg.0.len();
    if world == 1 || len == 0 {
        let mut readers: Vec<Reader> = (0..world).map(|rank| Reader { words: Vec::new(), pos: 0, rank }).collect();
        if let Some(mine) = readers.get_mut(group.rank()) {
            mine.words = msg.0;
        }
        return Ok(readers);
    }
    let t = group.to_local(&Tensor::from_vec(msg.0, &[1, len], &Device::Cpu)?)?;
    let all = group.all_gather_sized(&t, 0, &vec![1; world])?.to_i64_vec()?;
    if all.len() != world * len {
        return Err(SampleError::Disagree(format!("gathered {} words from {world} ranks of {len}", all.len())));
    }
    Ok(all.chunks_exact(len).enumerate().map(|(rank, w)| Reader { words: w.to_vec(), pos: 0, rank }).collect())
}
