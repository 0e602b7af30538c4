//! Block accounting of the paged KV cache (filled in by the block-manager work).
