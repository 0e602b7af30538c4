//! [`BlockPool`]: the free list, reference counts, the prefix cache and its LRU eviction.

use super::BlockId;
use super::prefix::{BlockRef, CachedBlock, ChainLink, block_key};
use std::collections::{BTreeSet, HashMap};

/// One block's bookkeeping.
#[derive(Debug, Clone, Default)]
struct BlockMeta {
    /// Sequences whose tables hold it.
    refs: u32,
    /// Times it has been allocated (see [`BlockRef`]).
    generation: u64,
    /// Its key, parent and tokens while it is in the prefix cache.
    cached: Option<CachedBlock>,
    /// When it was last released (its place in the eviction order while unreferenced).
    released_at: u64,
}

/// The blocks of the KV cache and who holds them.
///
/// A block is in exactly one state: free (unreferenced, not cached), held (referenced by one
/// sequence or, when cached and full, by several), or evictable (cached, unreferenced: still
/// found by prefix lookups, taken for reuse least recently released first when no block is free).
#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    caching: bool,
    blocks: Vec<BlockMeta>,
    /// Unreferenced, uncached blocks.
    free: Vec<BlockId>,
    /// Unreferenced cached blocks by (release time, id): the first is evicted first.
    evictable: BTreeSet<(u64, BlockId)>,
    /// Cached blocks by key (several only on a hash collision).
    index: HashMap<u64, Vec<BlockId>>,
    /// Blocks with at least one reference.
    referenced: usize,
    /// Release clock for the LRU order.
    clock: u64,
}

impl BlockPool {
    /// `num_blocks` free blocks of `block_size` positions; `prefix_caching` turns the prefix cache
    /// on. Errors when a count is zero or the ids would not fit in a [`BlockId`].
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Result<BlockPool, String> {
        if num_blocks == 0 {
            return Err("the KV cache needs at least one block".into());
        }
        if block_size == 0 {
            return Err("the block size must be at least one position".into());
        }
        if u32::try_from(num_blocks).is_err() {
            return Err(format!("{num_blocks} blocks is more than block ids address ({})", u32::MAX));
        }
        // Popped from the end: block 0 is handed out first.
        let free = (0..num_blocks).rev().map(|b| b as BlockId).collect();
        Ok(BlockPool {
            block_size,
            caching: prefix_caching,
            blocks: vec![BlockMeta::default(); num_blocks],
            free,
            evictable: BTreeSet::new(),
            index: HashMap::new(),
            referenced: 0,
            clock: 0,
        })
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Whether full blocks are cached for reuse.
    pub fn prefix_caching(&self) -> bool {
        self.caching
    }

    /// Blocks that can be allocated now: free ones plus evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_referenced(&self) -> usize {
        self.referenced
    }

    /// Blocks in the prefix cache, referenced or not.
    pub fn num_cached(&self) -> usize {
        self.blocks.iter().filter(|b| b.cached.is_some()).count()
    }

    /// Referenced blocks over all blocks, `0..=1`.
    pub fn usage(&self) -> f64 {
        self.referenced as f64 / self.blocks.len() as f64
    }

    /// References held on `id` (0 for an id outside the pool).
    pub fn refs(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.refs)
    }

    /// Whether `id` is in the prefix cache.
    pub fn is_cached(&self, id: BlockId) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.cached.is_some())
    }

    /// The current lifetime of `id`.
    pub fn block_ref(&self, id: BlockId) -> BlockRef {
        BlockRef { id, generation: self.blocks.get(id as usize).map_or(0, |b| b.generation) }
    }

    /// Takes a block with one reference: a free one, else the least recently released cached
    /// one (dropping it from the cache). `None` when every block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                self.uncache(id);
                id
            }
        };
        let meta = &mut self.blocks[id as usize];
        meta.refs = 1;
        meta.generation += 1;
        self.referenced += 1;
        Some(id)
    }

    /// Drops `id` from the prefix index (its content stays, but no lookup finds it again).
    fn uncache(&mut self, id: BlockId) {
        if let Some(c) = self.blocks[id as usize].cached.take()
            && let Some(ids) = self.index.get_mut(&c.key)
        {
            ids.retain(|&b| b != id);
            if ids.is_empty() {
                self.index.remove(&c.key);
            }
        }
    }

    /// Adds a reference to `id`, a block found by [`lookup`](Self::lookup) (taking it out of the
    /// eviction order if it was unreferenced).
    pub fn acquire(&mut self, id: BlockId) {
        let meta = &mut self.blocks[id as usize];
        if meta.refs == 0 {
            self.evictable.remove(&(meta.released_at, id));
            self.referenced += 1;
        }
        meta.refs += 1;
    }

    /// Drops one reference from each of `table`'s blocks, last block first, so that a released
    /// chain's tail is evicted before its head. Unreferenced cached blocks become evictable,
    /// the others free.
    pub fn release(&mut self, table: &[BlockId]) {
        for &id in table.iter().rev() {
            let meta = &mut self.blocks[id as usize];
            debug_assert!(meta.refs > 0, "block {id} released more often than held");
            if meta.refs == 0 {
                continue; // not held: nothing to drop (the accounting stays consistent)
            }
            meta.refs -= 1;
            if meta.refs > 0 {
                continue;
            }
            self.referenced -= 1;
            if meta.cached.is_some() {
                meta.released_at = self.clock;
                self.clock += 1;
                self.evictable.insert((meta.released_at, id));
            } else {
                self.free.push(id);
            }
        }
    }

    /// The longest chain of cached full blocks holding `tokens` from its start, at most
    /// `max_blocks` of them. Compares every block's tokens and parent, so a hash collision never
    /// matches. Changes nothing; [`acquire`](Self::acquire) each block to hold it.
    pub fn lookup(&self, tokens: &[i64], max_blocks: usize) -> Vec<ChainLink> {
        self.lookup_from(None, tokens, max_blocks)
    }

    /// [`lookup`](Self::lookup) of a chain whose first block follows `root` (a LoRA adapter's,
    /// [`adapter_root`](super::prefix::adapter_root); `None` for the base model's).
    pub fn lookup_from(&self, root: Option<ChainLink>, tokens: &[i64], max_blocks: usize) -> Vec<ChainLink> {
        let mut chain: Vec<ChainLink> = Vec::new();
        if !self.caching {
            return chain;
        }
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let parent = chain.last().or(root.as_ref());
            let key = block_key(parent, chunk);
            let hit = self.index.get(&key).and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&b| self.blocks[b as usize].cached.as_ref().is_some_and(|c| c.matches(parent, chunk)))
            });
            match hit {
                Some(id) => chain.push(ChainLink { key, block: self.block_ref(id) }),
                None => break,
            }
        }
        chain
    }

    /// Of `chain`'s blocks, those nobody references (they count as available until acquired).
    pub fn unreferenced_among(&self, chain: &[ChainLink]) -> usize {
        chain.iter().filter(|l| self.refs(l.block.id) == 0).count()
    }

    /// Records that held block `id` is full with `tokens` (`block_size` of them) after the chain
    /// `parent`, caching it for later sequences. Returns the link the next block of the same
    /// sequence chains on: this block's, or that of an equal block cached before (then `id`
    /// itself stays uncached and is freed when released). `None` with prefix caching off or
    /// when `tokens` is not one block long.
    pub fn register_full(&mut self, id: BlockId, parent: Option<&ChainLink>, tokens: &[i64]) -> Option<ChainLink> {
        if !self.caching || tokens.len() != self.block_size || self.refs(id) == 0 {
            return None;
        }
        let key = block_key(parent, tokens);
        let existing = self.index.get(&key).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|&b| self.blocks[b as usize].cached.as_ref().is_some_and(|c| c.matches(parent, tokens)))
        });
        if let Some(b) = existing {
            return Some(ChainLink { key, block: self.block_ref(b) });
        }
        let meta = &mut self.blocks[id as usize];
        if meta.cached.is_some() {
            // Already cached under another chain (a shared block): leave it where it is.
            return None;
        }
        meta.cached = Some(CachedBlock { key, parent: parent.map(|p| p.block), tokens: tokens.into() });
        self.index.entry(key).or_default().push(id);
        Some(ChainLink { key, block: self.block_ref(id) })
    }

    /// Checks the pool's own accounting: every block in exactly one state, the counts, the index.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.blocks.len()];
        for &id in &self.free {
            let m = &self.blocks[id as usize];
            if m.refs != 0 || m.cached.is_some() {
                return Err(format!("free block {id} is referenced or cached"));
            }
            seen[id as usize] += 1;
        }
        for &(t, id) in &self.evictable {
            let m = &self.blocks[id as usize];
            if m.refs != 0 || m.cached.is_none() || m.released_at != t {
                return Err(format!("evictable block {id} is referenced, uncached or misplaced"));
            }
            seen[id as usize] += 1;
        }
        let mut referenced = 0;
        for (id, m) in self.blocks.iter().enumerate() {
            if m.refs > 0 {
                referenced += 1;
                seen[id] += 1;
            }
            if seen[id] != 1 {
                return Err(format!("block {id} is in {} states", seen[id]));
            }
            if let Some(c) = &m.cached
                && !self.index.get(&c.key).is_some_and(|ids| ids.contains(&(id as BlockId)))
            {
                return Err(format!("cached block {id} is missing from the index"));
            }
        }
        if referenced != self.referenced {
            return Err(format!("{referenced} blocks referenced, counted {}", self.referenced));
        }
        let indexed: usize = self.index.values().map(Vec::len).sum();
        if indexed != self.num_cached() {
            return Err(format!("{indexed} blocks indexed, {} cached", self.num_cached()));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
