"""Paged KV-cache bookkeeping: a block allocator with reference counts and a prefix cache.

Pure Python, no tensors: the runner owns the memory, this module decides which
block holds which tokens. A sequence's ``block_table`` lists its blocks in order;
token position ``p`` lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Full prompt blocks are content-addressed by a hash chained over all previous
tokens, so a later prompt with the same prefix reuses them (``cached_tokens``).
Blocks whose reference count drops to zero keep their hash and stay reusable until
the allocator needs them again (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    pass


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # Free blocks, least recently freed first; never-used blocks come first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    # -- queries ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------------
    def _take(self) -> int:
        if not self.free:
            raise OutOfBlocks()
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.block_hash[block] = None
        self.ref[block] = 1
        return block

    def _reuse(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def allocate_prompt(self, table: BlockTable, tokens: list[int]) -> int:
        """Give ``table`` blocks for ``tokens``; return how many leading tokens are cached.

        At least the last two tokens are always left to compute: the last so its logits
        exist, and two because attention over a single query row takes another kernel
        than the same row inside a longer chunk (other last bits, measured in bf16 on
        CPU), and a cache hit must not change a seeded request's numbers.
        """
        assert not table.blocks
        needed = self.blocks_needed(len(tokens))
        cached_blocks: list[int] = []
        if self.enable_prefix_cache:
            parent = b""
            full = max(0, len(tokens) - 2) // self.block_size  # never a block holding the last two
            for i in range(full):
                chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
                parent = chain_hash(parent, chunk)
                block = self.by_hash.get(parent)
                if block is None:
                    break
                cached_blocks.append(block)
        fresh = needed - len(cached_blocks)
        free_after_reuse = self.num_free - sum(1 for b in cached_blocks if self.ref[b] == 0)
        if fresh > free_after_reuse:
            raise OutOfBlocks()
        for b in cached_blocks:
            self._reuse(b)
        table.blocks = cached_blocks + [self._take() for _ in range(fresh)]
        return len(cached_blocks) * self.block_size

    def register_prompt_blocks(self, table: BlockTable, tokens: list[int], upto: int) -> None:
        """Publish the hashes of the full blocks among the first ``upto`` computed tokens."""
        if not self.enable_prefix_cache:
            return
        parent = b""
        for i in range(upto // self.block_size):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            parent = chain_hash(parent, chunk)
            block = table.blocks[i]
            if self.block_hash[block] is None and parent not in self.by_hash:
                self.block_hash[block] = parent
                self.by_hash[parent] = block

    def ensure_slots(self, table: BlockTable, num_tokens: int) -> list[tuple[int, int]]:
        """Make room for ``num_tokens`` positions; return (src, dst) block copies to do first.

        A shared last block is copied before it is written (copy on write).
        """
        copies: list[tuple[int, int]] = []
        needed = self.blocks_needed(num_tokens)
        if table.blocks and needed >= len(table.blocks):
            last = table.blocks[-1]
            # the block about to be written is the last one if it is not full yet
            if self.ref[last] > 1 and (num_tokens - 1) // self.block_size == len(table.blocks) - 1:
                new = self._take()
                self.ref[last] -= 1
                table.blocks[-1] = new
                copies.append((last, new))
        while len(table.blocks) < needed:
            table.blocks.append(self._take())
        return copies

    def fork(self, parent: BlockTable) -> BlockTable:
        return self.share_prefix(parent, len(parent.blocks))

    def share_prefix(self, parent: BlockTable, num_blocks: int) -> BlockTable:
        """A new table holding ``parent``'s first ``num_blocks`` blocks (shared, copy on write)."""
        for b in parent.blocks[:num_blocks]:
            self.ref[b] += 1
        return BlockTable(list(parent.blocks[:num_blocks]))

    def release(self, table: BlockTable) -> None:
        # Free in reverse so a sequence's later blocks are evicted before its prefix.
        for b in reversed(table.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        table.blocks = []
