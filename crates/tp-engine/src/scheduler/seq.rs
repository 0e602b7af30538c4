//! One request's state inside the scheduler: its tokens, what of them is in its blocks, and its
//! block table.

use crate::api::RequestId;
use crate::blocks::{BlockId, BlockPool, ChainLink};

/// A request the scheduler holds, waiting or running.
#[derive(Debug, Clone)]
pub(super) struct Seq {
    pub id: RequestId,
    /// The prompt, then every generated token.
    pub tokens: Vec<i64>,
    pub prompt_len: usize,
    /// Positions whose keys and values are in `blocks` (always fewer than `tokens.len()` while
    /// running: the last token still has to be fed to sample the next).
    pub computed: usize,
    /// Block table: position `p` in `blocks[p / block_size]`. Empty while waiting.
    pub blocks: Vec<BlockId>,
    /// Leading blocks known full (prefix hits, and blocks filled and offered to the cache).
    pub full: usize,
    /// The prefix-cache chain after block `full - 1` (none when caching is off or the chain broke).
    pub link: Option<ChainLink>,
    /// Positions served from the prefix cache at this admission, reported once.
    pub cached_pending: usize,
    /// Whether admission may reuse cached prefix blocks (not when the prompt's logits are needed).
    pub reuse_prefix: bool,
    /// How many tokens the sequence knew when its cache was last computed (LongRoPE regimes).
    pub computed_at_len: usize,
    /// Its LoRA adapter's slot (0: the base model).
    pub adapter: u32,
}

impl Seq {
    /// A waiting request with prompt `prompt`.
    pub fn new(id: RequestId, prompt: Vec<i64>) -> Seq {
        Seq {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: Vec::new(),
            full: 0,
            link: None,
            cached_pending: 0,
            reuse_prefix: true,
            computed_at_len: 0,
            adapter: 0,
        }
    }

    /// Tokens known but not yet in the cache.
    pub fn remaining(&self) -> usize {
        self.tokens.len().saturating_sub(self.computed)
    }

    /// Whether only the last token is left to feed (a decode step).
    pub fn is_decode(&self) -> bool {
        self.remaining() == 1
    }

    /// Blocks to add so the table covers `computed + n` positions.
    pub fn blocks_needed(&self, n: usize, block_size: usize) -> usize {
        (self.computed + n).div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Drops its blocks and computed positions (it will be recomputed from its tokens).
    pub fn reset(&mut self, pool: &mut BlockPool) {
        pool.release(&self.blocks);
        self.blocks.clear();
        self.computed = 0;
        self.full = 0;
        self.link = None;
        self.cached_pending = 0;
    }

    /// Offers every block that `computed` has filled since the last call to the prefix cache,
    /// chaining each on the one before. A block after a broken chain is not offered (it would be
    /// found at the wrong prefix).
    pub fn register_full_blocks(&mut self, pool: &mut BlockPool) {
        let bs = pool.block_size();
        while (self.full + 1) * bs <= self.computed && self.full < self.blocks.len() {
            let tokens = &self.tokens[self.full * bs..(self.full + 1) * bs];
            self.link = if self.full == 0 || self.link.is_some() {
                // The first block follows its adapter's root (none for the base model).
                let parent = if self.full == 0 { crate::blocks::adapter_root(self.adapter) } else { self.link };
                pool.register_full(self.blocks[self.full], parent.as_ref(), tokens)
            } else {
                None
            };
            self.full += 1;
        }
    }
}
