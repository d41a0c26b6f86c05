"""KVCacheManager: the one owner of block accounting for all requests.

It hands out block tables, reserves blocks for scheduled tokens (evicting cached
prefix blocks only under pressure), serves prefix hits, registers newly filled
blocks in the prefix cache, and frees a request's blocks when it leaves. After any
mix of finished, aborted, preempted and failed requests, every block is either free
or held only by the prefix cache (``check_no_leaks``).
"""

from __future__ import annotations

from ember.engine.request import Request
from ember.kv.blocks import BlockAllocator, BlockTable
from ember.kv.prefix import PrefixCache, chain_key, root_key


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix = PrefixCache(self.allocator, block_size) if enable_prefix_caching else None
        # per request: chain keys of its leading full blocks already registered
        self._keys: dict[str, list[bytes]] = {}

    # ------------------------------------------------------------ capacity
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_available(self) -> int:
        """Free blocks plus cached blocks that could be evicted."""
        return self.allocator.num_free + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def num_used(self) -> int:
        """Blocks held by requests (not counting those held only by the prefix cache)."""
        return self.num_blocks - self.num_available

    def new_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.block_size)

    def can_reserve(self, req: Request, n_tokens: int) -> bool:
        return req.block_table.blocks_needed(n_tokens) <= self.num_available

    def reserve(self, req: Request, n_tokens: int) -> None:
        need = req.block_table.blocks_needed(n_tokens) - self.allocator.num_free
        if need > 0 and self.prefix:
            self.prefix.evict(need)
        req.block_table.reserve(n_tokens)

    # ------------------------------------------------------------ prefix reuse
    def match_prefix(self, req: Request) -> None:
        """Attach cached blocks covering a prefix of the history (never its last token)."""
        if not self.prefix or req.kv_len:
            return
        tokens = req.token_ids[:-1]  # the last token is always recomputed for its logits
        blocks, keys = self.prefix.lookup(req.salt, tokens)
        for block in blocks:
            req.block_table.append_block(block)
        req.block_table.kv_len = len(blocks) * self.block_size
        self._keys[req.request_id] = keys
        if req.num_output == 0:
            req.cached_tokens = req.block_table.kv_len

    def register_computed(self, req: Request) -> None:
        """Insert the request's newly completed full blocks into the prefix cache."""
        if not self.prefix:
            return
        keys = self._keys.setdefault(req.request_id, [])
        bs = self.block_size
        full = req.kv_len // bs
        parent = keys[-1] if keys else root_key(req.salt)
        for i in range(len(keys), full):
            chunk = req.token_ids[i * bs : (i + 1) * bs]
            parent = chain_key(parent, chunk)
            keys.append(parent)
            self.prefix.insert(req.block_table.blocks[i], parent, chunk)

    # ------------------------------------------------------------ release
    def free(self, req: Request) -> None:
        """Release every block the request holds; cached ones stay findable."""
        blocks = list(req.block_table.blocks)
        req.block_table.release()
        self._keys.pop(req.request_id, None)
        if self.prefix:
            for block in blocks:
                self.prefix.on_released(block)

    def truncate(self, req: Request, keep_len: int) -> None:
        """Rewind a request's cache; forget chain keys past the kept full blocks."""
        dropped = list(req.block_table.blocks[-(-keep_len // self.block_size):])
        req.block_table.truncate(keep_len)
        keys = self._keys.get(req.request_id)
        if keys:
            del keys[keep_len // self.block_size :]
        if self.prefix:
            for block in dropped:
                self.prefix.on_released(block)

    def check_no_leaks(self) -> None:
        """Every block is free or held only by the prefix cache (no requests alive)."""
        for block, rc in enumerate(self.allocator.refcount):
            cached = bool(self.prefix and self.prefix.is_cached(block))
            if rc != (1 if cached else 0):
                raise AssertionError(f"KV block {block} leaked: refcount {rc}, cached={cached}")
