"""KV cache: the page pool's storage, the allocator, the page table and the
prefix caches (radix, naive). Used by the scheduler and the attention backends."""
