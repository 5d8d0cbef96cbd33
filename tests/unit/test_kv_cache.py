"""Block allocator and prefix cache bookkeeping (no tensors)."""

import pytest
from llm_engine.kv_cache import BlockManager, BlockTable, OutOfBlocks


def test_allocate_and_release_returns_every_block():
    bm = BlockManager(8, 4)
    t = BlockTable()
    assert bm.allocate_prompt(t, list(range(10))) == 0
    assert len(t.blocks) == 3 and bm.num_free == 5
    bm.release(t)
    assert bm.num_free == 8 and t.blocks == []


def test_memory_grows_with_tokens_not_padding():
    bm = BlockManager(16, 4)
    short, long_ = BlockTable(), BlockTable()
    bm.allocate_prompt(short, [1, 2])
    bm.allocate_prompt(long_, list(range(100, 113)))
    assert len(short.blocks) == 1 and len(long_.blocks) == 4


def test_ensure_slots_appends_block_at_boundary():
    bm = BlockManager(4, 4)
    t = BlockTable()
    bm.allocate_prompt(t, [1, 2, 3, 4])
    assert bm.ensure_slots(t, 5) == [] and len(t.blocks) == 2


def test_out_of_blocks():
    bm = BlockManager(2, 4)
    t = BlockTable()
    with pytest.raises(OutOfBlocks):
        bm.allocate_prompt(t, list(range(9)))
    assert bm.num_free == 2 and t.blocks == []


def test_prefix_cache_hit_and_honest_count():
    bm = BlockManager(16, 4)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks + 2
    a = BlockTable()
    assert bm.allocate_prompt(a, prompt) == 0
    bm.register_prompt_blocks(a, prompt, len(prompt))
    b = BlockTable()
    assert bm.allocate_prompt(b, prompt) == 8
    assert b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    other = BlockTable()
    assert bm.allocate_prompt(other, [99] + prompt[1:]) == 0  # first block differs: no reuse


def test_prefix_cache_keeps_last_token_to_compute():
    bm = BlockManager(16, 4)
    prompt = list(range(8))  # exactly two blocks
    a = BlockTable()
    bm.allocate_prompt(a, prompt)
    bm.register_prompt_blocks(a, prompt, 8)
    b = BlockTable()
    assert bm.allocate_prompt(b, prompt) == 4  # the block holding the last token is recomputed


def _computed_and_released(bm: BlockManager, prompt: list[int]) -> None:
    table = BlockTable()
    bm.allocate_prompt(table, prompt)
    bm.register_prompt_blocks(table, prompt, len(prompt))
    bm.release(table)


def test_cached_blocks_survive_release_until_reused():
    bm = BlockManager(4, 4)
    prompt = list(range(10))
    _computed_and_released(bm, prompt)
    assert bm.allocate_prompt(BlockTable(), prompt) == 8


def test_a_hit_leaves_at_least_the_last_two_tokens_to_compute():
    """A lone last token would be attended as a single query row, another kernel than on a
    miss; so a prompt one token past a block boundary gets its last full block recomputed."""
    bm = BlockManager(8, 4)
    prompt = list(range(9))
    _computed_and_released(bm, prompt)
    assert bm.allocate_prompt(BlockTable(), prompt) == 4
    assert bm.allocate_prompt(BlockTable(), prompt + [99]) == 8


def test_prefix_cache_disabled():
    bm = BlockManager(16, 4, enable_prefix_cache=False)
    prompt = list(range(10))
    a = BlockTable()
    bm.allocate_prompt(a, prompt)
    bm.register_prompt_blocks(a, prompt, 10)
    assert bm.allocate_prompt(BlockTable(), prompt) == 0


def test_fork_shares_then_copies_on_write():
    bm = BlockManager(8, 4)
    parent = BlockTable()
    bm.allocate_prompt(parent, [1, 2, 3, 4, 5, 6])  # 2 blocks, last one half full
    child = bm.fork(parent)
    assert child.blocks == parent.blocks and bm.ref[parent.blocks[1]] == 2
    copies = bm.ensure_slots(child, 7)  # child writes position 6 into the shared last block
    assert copies == [(parent.blocks[1], child.blocks[1])]
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    bm.release(child)
    bm.release(parent)
    assert bm.num_free == 8
