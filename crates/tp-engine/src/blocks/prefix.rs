//! Keys of the prefix cache: a full block is known by a hash chained over its parent's key and
//! its own tokens, and identified exactly by its parent block and its tokens.

use super::BlockId;
use std::hash::{DefaultHasher, Hash, Hasher};

/// One lifetime of a block: its id and how many times it had been allocated then. A block
/// evicted and reused gets a new generation, so a stale reference to it never matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRef {
    /// The block.
    pub id: BlockId,
    /// Its allocation count when this content was written.
    pub generation: u64,
}

/// Where a chain of full blocks stands after one block: the key the next block's hash builds on
/// and the block holding this content in the prefix cache (the parent the next block must name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLink {
    /// Hash of all the tokens up to and including this block.
    pub key: u64,
    /// The cached block with these tokens after this parent.
    pub block: BlockRef,
}

/// The key of a full block holding `tokens` after the chain `parent` (none for the first block).
/// `DefaultHasher::new()` is seeded with fixed keys, so keys are the same in every process.
pub fn block_key(parent: Option<&ChainLink>, tokens: &[i64]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.map(|p| p.key).hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The chain a sequence of LoRA adapter `adapter` starts from (`None` for the base model): a
/// root no real block has (block id `BlockId::MAX`, the adapter as its generation), so that
/// blocks computed with different adapters, whose keys and values differ, are never shared.
/// Adapter slots are never reused by another adapter, so a stale block cannot match.
pub fn adapter_root(adapter: u32) -> Option<ChainLink> {
    (adapter != 0).then(|| {
        let mut h = DefaultHasher::new();
        ("lora adapter", adapter).hash(&mut h);
        ChainLink { key: h.finish(), block: BlockRef { id: BlockId::MAX, generation: u64::from(adapter) } }
    })
}

/// What the cache stores with a full block, compared on every hit (a hash collision never
/// shares a block whose tokens or prefix differ).
#[derive(Debug, Clone)]
pub struct CachedBlock {
    /// [`block_key`] of this block.
    pub key: u64,
    /// The block before it in the chain (none for a sequence's first block).
    pub parent: Option<BlockRef>,
    /// Its `block_size` tokens.
    pub tokens: Box<[i64]>,
}

impl CachedBlock {
    /// Whether this block holds `tokens` right after `parent`.
    pub fn matches(&self, parent: Option<&ChainLink>, tokens: &[i64]) -> bool {
        self.parent == parent.map(|p| p.block) && *self.tokens == *tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_the_parent_and_every_token() {
        let a = block_key(None, &[1, 2, 3]);
        assert_eq!(a, block_key(None, &[1, 2, 3]));
        assert_ne!(a, block_key(None, &[1, 2, 4]));
        assert_ne!(a, block_key(None, &[3, 2, 1]));
        let link = ChainLink { key: a, block: BlockRef { id: 0, generation: 1 } };
        assert_ne!(block_key(Some(&link), &[1, 2, 3]), a);
    }

    #[test]
    fn a_cached_block_matches_only_its_parent_and_tokens() {
        let parent = ChainLink { key: 7, block: BlockRef { id: 3, generation: 2 } };
        let c = CachedBlock { key: 1, parent: Some(parent.block), tokens: vec![5, 6].into() };
        assert!(c.matches(Some(&parent), &[5, 6]));
        assert!(!c.matches(Some(&parent), &[5, 7]));
        assert!(!c.matches(None, &[5, 6]));
        let reused = ChainLink { key: 7, block: BlockRef { id: 3, generation: 3 } };
        assert!(!c.matches(Some(&reused), &[5, 6]));
    }

    #[test]
    fn each_adapter_roots_its_own_chains() {
        assert_eq!(adapter_root(0), None);
        let (a, b) = (adapter_root(1).unwrap(), adapter_root(2).unwrap());
        assert_ne!(a.key, b.key);
        assert_ne!(block_key(Some(&a), &[1, 2]), block_key(None, &[1, 2]));
        let c = CachedBlock { key: 1, parent: Some(a.block), tokens: vec![1, 2].into() };
        assert!(c.matches(Some(&a), &[1, 2]) && !c.matches(Some(&b), &[1, 2]) && !c.matches(None, &[1, 2]));
    }
}
