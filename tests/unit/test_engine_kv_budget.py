"""The engine in-process with the real default model under a small KV cache: requests wait,
are preempted and recomputed, and none hangs or blocks the queue."""

from __future__ import annotations

import pytest

from tests.unit.engine_harness import Run, build


def test_kv_budget_exhaustion_queues_instead_of_failing():
    """Six 45-token sequences in 12 blocks of 16: some wait, some are preempted and
    recomputed (prompt and generated tokens prefilled again), and each still says what it
    says alone with room to spare (float32: recomputation changes only the last bits)."""
    eng = build(kvCacheBlocks=12, cacheBlockSize=16, enablePrefixCache=False)
    try:
        runs = [Run(eng, f"Request number {i} says", max_tokens=40, temperature=0, ignore_eos=True)
                for i in range(6)]
        for r in runs:
            r.wait(300)
        assert all(r.error is None and r.outputs[-1].completion_tokens == 40 for r in runs)
        # recomputing a preempted request's tokens adds no usage entries: one per token
        assert all(len(r.outputs[-1].batch_size) == len(r.outputs[-1].queue_wait_us) == 40 for r in runs)
        assert eng.blocks.num_free == 12
        assert eng.scheduler.num_preemptions > 0
        alone = [Run(eng, f"Request number {i} says", max_tokens=40, temperature=0, ignore_eos=True).wait().text()
                 for i in range(6)]  # one at a time: each fits
        assert [r.text() for r in runs] == alone
    finally:
        eng.stop()


@pytest.mark.parametrize("params", [
    dict(max_tokens=32, n=2, temperature=1.0, top_k=1, seed=5, ignore_eos=True),
    dict(max_tokens=32, n=2, use_beam_search=True, temperature=0, ignore_eos=True),
], ids=["n", "beam"])
def test_a_preempted_request_with_n_sequences_is_readmitted_and_finishes(params):
    """8 blocks of 16: a 64-token prompt with n=2 fits only with its prompt blocks shared
    (4 + 2 x 2 blocks). Preempted by an earlier request, it comes back with its prompt
    shared again (not 2 x 5 blocks, which would never fit and would block the queue)."""
    eng = build(kvCacheBlocks=8, cacheBlockSize=16, enablePrefixCache=False)
    try:
        first = Run(eng, list(range(300, 316)), max_tokens=40, temperature=0, ignore_eos=True)
        pair = Run(eng, list(range(100, 164)), **params)
        after = Run(eng, "Hi", max_tokens=3, temperature=0, ignore_eos=True)
        for r in (first, pair, after):
            assert r.wait(120).error is None
        assert eng.scheduler.num_preemptions > 0
        finals = pair.finals()
        assert sorted(finals) == [0, 1] and all(o.completion_tokens == 32 for o in finals.values())
        assert eng.blocks.num_free == 8
        alone = Run(eng, list(range(100, 164)), **params).wait()  # fits alone: no preemption
        assert [pair.text(i) for i in (0, 1)] == [alone.text(i) for i in (0, 1)]
    finally:
        eng.stop()


def test_requests_larger_than_the_kv_cache_neither_hang_nor_block_the_queue():
    """8 blocks of 16 tokens: a prompt that cannot fit is refused at once, and a long
    generation ends at the cache's size instead of preempting itself for ever."""
    from llm_engine.errors import EnqueueRejected

    eng = build(kvCacheBlocks=8, cacheBlockSize=16, enablePrefixCache=False)
    try:
        with pytest.raises(EnqueueRejected, match="cannot be greater than 127"):
            Run(eng, list(range(100, 300)), max_tokens=5)
        prompt = list(range(100, 200))
        long = Run(eng, prompt, max_tokens=500, temperature=0, ignore_eos=True)
        after = Run(eng, "Hi", max_tokens=3, temperature=0, ignore_eos=True)
        last = long.wait(120).outputs[-1]
        assert long.error is None and last.finish_reason == "length" and last.completion_tokens == 128 - 100
        assert after.wait(120).error is None and after.outputs[-1].completion_tokens == 3
        assert eng.blocks.num_free == 8
    finally:
        eng.stop()
