//! Block accounting of the paged KV cache: which block of positions belongs to whom.
//!
//! The cache is `num_blocks` blocks of `block_size` positions each (on every rank, for that
//! rank's KV heads; the ids are the same on every rank). A sequence holds a block table: position
//! `p` lives in block `table[p / block_size]`. [`BlockPool`] hands out free blocks, counts
//! references, and (with prefix caching on) remembers full blocks by a hash of their tokens and
//! their parent block, so a later sequence with the same prefix shares them instead of
//! recomputing. Cached blocks nobody references stay cached until a block is needed and none is
//! free; then the least recently released one is evicted.

mod pool;
mod prefix;

pub use pool::BlockPool;
pub use prefix::{BlockRef, ChainLink, adapter_root};

/// A block's index in the cache, `0..num_blocks`.
pub type BlockId = u32;
