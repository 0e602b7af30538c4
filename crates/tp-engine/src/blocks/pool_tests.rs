//! Unit tests of [`BlockPool`]: allocation, references, the prefix cache and eviction order.

use super::*;

fn pool(n: usize, bs: usize) -> BlockPool {
    BlockPool::new(n, bs, true).unwrap()
}

#[test]
fn refuses_empty_or_oversized_pools() {
    assert!(BlockPool::new(0, 16, true).unwrap_err().contains("at least one block"));
    assert!(BlockPool::new(4, 0, true).unwrap_err().contains("block size"));
    assert!(BlockPool::new(u32::MAX as usize + 1, 1, true).is_err());
}

#[test]
fn allocates_every_block_once_then_none() {
    let mut p = pool(3, 2);
    let got: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
    assert_eq!(got, vec![0, 1, 2]);
    assert_eq!(p.allocate(), None);
    assert_eq!((p.num_available(), p.num_referenced(), p.usage()), (0, 3, 1.0));
    p.release(&got);
    assert_eq!((p.num_available(), p.num_referenced(), p.usage()), (3, 0, 0.0));
    p.check().unwrap();
}

#[test]
fn cached_blocks_are_found_by_exact_prefix_and_shared() {
    let mut p = pool(4, 2);
    let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
    let la = p.register_full(a, None, &[1, 2]).unwrap();
    let lb = p.register_full(b, Some(&la), &[3, 4]).unwrap();
    assert_eq!((la.block.id, lb.block.id), (a, b));
    // The same prefix finds both; a different first block finds nothing, even with the same
    // second block; a different second block stops after the first.
    assert_eq!(p.lookup(&[1, 2, 3, 4, 5], 9), vec![la, lb]);
    assert_eq!(p.lookup(&[1, 2, 3, 4], 1), vec![la]);
    assert!(p.lookup(&[9, 2, 3, 4], 9).is_empty());
    assert_eq!(p.lookup(&[1, 2, 3, 9], 9), vec![la]);
    // A second holder shares them; both releases leave them cached and evictable.
    p.acquire(a);
    p.acquire(b);
    assert_eq!((p.refs(a), p.refs(b), p.num_referenced()), (2, 2, 2));
    p.release(&[a, b]);
    p.release(&[a, b]);
    assert_eq!((p.num_available(), p.num_referenced(), p.num_cached()), (4, 0, 2));
    assert_eq!(p.unreferenced_among(&[la, lb]), 2);
    p.check().unwrap();
}

#[test]
fn eviction_takes_free_blocks_first_then_the_least_recently_released_tail_first() {
    let mut p = pool(3, 1);
    let a = p.allocate().unwrap();
    let b = p.allocate().unwrap();
    let la = p.register_full(a, None, &[7]).unwrap();
    p.register_full(b, Some(&la), &[8]).unwrap();
    p.release(&[a, b]);
    // The free block goes first; then the chain's tail (b), then its head (a).
    assert_eq!(p.allocate(), Some(2));
    assert_eq!(p.allocate(), Some(b));
    assert_eq!(p.lookup(&[7, 8], 2), vec![la]);
    assert_eq!(p.allocate(), Some(a));
    assert!(p.lookup(&[7, 8], 2).is_empty());
    assert_eq!(p.num_cached(), 0);
    p.check().unwrap();
}

#[test]
fn a_reused_parent_never_revives_its_old_children() {
    let mut p = pool(2, 1);
    let a = p.allocate().unwrap();
    let b = p.allocate().unwrap();
    let la = p.register_full(a, None, &[1]).unwrap();
    p.register_full(b, Some(&la), &[2]).unwrap();
    // Release the head first, so it is evicted first while its child stays cached.
    p.release(&[a]);
    p.release(&[b]);
    let y = p.allocate().unwrap();
    assert_eq!(y, a);
    assert!(p.is_cached(b));
    // The same id cached again with the same tokens is a new lifetime: the old child names the
    // old one, so the chain stops after the head.
    let ly = p.register_full(y, None, &[1]).unwrap();
    assert_ne!(ly.block, la.block);
    assert_eq!(p.lookup(&[1, 2], 2), vec![ly]);
    p.release(&[y]);
    p.check().unwrap();
}

#[test]
fn a_duplicate_full_block_links_to_the_cached_one_and_stays_uncached() {
    let mut p = pool(3, 2);
    let a = p.allocate().unwrap();
    let b = p.allocate().unwrap();
    let la = p.register_full(a, None, &[1, 2]).unwrap();
    let lb = p.register_full(b, None, &[1, 2]).unwrap();
    assert_eq!(la, lb);
    assert!(!p.is_cached(b));
    p.release(&[b]);
    assert_eq!(p.num_cached(), 1);
    p.check().unwrap();
}

#[test]
fn caching_off_finds_nothing() {
    let mut p = BlockPool::new(2, 1, false).unwrap();
    let a = p.allocate().unwrap();
    assert_eq!(p.register_full(a, None, &[1]), None);
    assert!(p.lookup(&[1, 2], 2).is_empty());
    p.release(&[a]);
    assert_eq!(p.num_available(), 2);
    assert_eq!(p.num_cached(), 0);
}

#[test]
fn hash_collisions_never_share_a_block() {
    // Force two different token blocks into one index bucket: the lookup compares tokens.
    let mut p = pool(2, 1);
    let a = p.allocate().unwrap();
    let la = p.register_full(a, None, &[1]).unwrap();
    let fake = block_key(None, &[2]);
    let ids = p.index.remove(&la.key).unwrap();
    p.index.insert(fake, ids);
    p.blocks[a as usize].cached.as_mut().unwrap().key = fake;
    assert!(p.lookup(&[2], 1).is_empty());
    assert!(p.lookup(&[1], 1).is_empty()); // its true key no longer indexes it
    p.check().unwrap();
}
