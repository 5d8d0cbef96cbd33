"""Iteration-level scheduling without a model: budgets, chunked prefill, priority, preemption."""

from llm_engine.kv_cache import BlockManager
from llm_engine.params import SamplingParams
from llm_engine.scheduler import Scheduler
from llm_engine.sequence import Request, Sequence


def make(req_id, n_prompt, priority=5, arrival=0.0):
    req = Request(req_id, list(range(1, n_prompt + 1)), SamplingParams(priority=priority), emit=lambda o: None,
                  arrival=arrival)
    req.sequences = [Sequence(req, 0, list(req.prompt_ids), detok=None, stopper=None, generator=None)]
    return req


def sched(blocks=64, bs=4, batch=8, prefill_batch=4, prefill_tokens=16, chunk=0):
    return Scheduler(BlockManager(blocks, bs, enable_prefix_cache=False), batch, prefill_batch, prefill_tokens, 100,
                     prefill_chunk_tokens=chunk)


def run_step(s):
    plan = s.schedule()
    for it in plan.items:
        it.seq.num_computed += it.num_tokens
        if it.seq.num_computed == len(it.seq.token_ids):
            it.seq.token_ids.append(0)  # pretend a token was sampled
    return plan


def test_long_prompt_is_chunked_and_decodes_keep_running():
    s = sched(prefill_tokens=16)
    short = make("short", 3, arrival=0)
    s.add(short)
    run_step(s)  # short prefilled
    s.add(make("long", 40, arrival=1))
    plan = run_step(s)
    sizes = {it.seq.request.request_id: it.num_tokens for it in plan.items}
    assert sizes["short"] == 1  # decode not stalled
    assert sizes["long"] == 15  # the rest of the budget
    plan = run_step(s)
    sizes = {it.seq.request.request_id: it.num_tokens for it in plan.items}
    assert sizes == {"short": 1, "long": 15}


def test_while_others_decode_a_step_carries_at_most_a_chunk_of_prompt_tokens():
    s = sched(blocks=256, prefill_tokens=64, chunk=8)
    s.add(make("long", 40, arrival=0))
    plan = run_step(s)  # nothing decodes yet: the whole budget
    assert [(it.seq.request.request_id, it.num_tokens) for it in plan.items] == [("long", 40)]
    s.add(make("a", 5, arrival=1))
    s.add(make("b", 6, arrival=2))
    plan = run_step(s)  # "long" decodes now: 8 prompt tokens in all, a newcomer may be cut mid-prompt
    assert {it.seq.request.request_id: it.num_tokens for it in plan.items} == {"long": 1, "a": 5, "b": 3}
    plan = run_step(s)
    assert {it.seq.request.request_id: it.num_tokens for it in plan.items} == {"long": 1, "a": 1, "b": 3}
    plan = run_step(s)
    assert {it.seq.request.request_id: it.num_tokens for it in plan.items} == {"long": 1, "a": 1, "b": 1}


def test_a_burst_with_nothing_decoding_is_not_chunked():
    s = sched(blocks=256, prefill_tokens=64, chunk=8)
    for i in range(3):
        s.add(make(f"r{i}", 10, arrival=i))
    plan = run_step(s)
    assert [it.num_tokens for it in plan.items] == [10, 10, 10]


def test_priority_orders_admission():
    s = sched(prefill_batch=1)
    s.add(make("low", 3, priority=5, arrival=0))
    s.add(make("high", 3, priority=1, arrival=1))
    plan = run_step(s)
    assert [it.seq.request.request_id for it in plan.items] == ["high"]


def test_batch_size_cap():
    s = sched(batch=2, prefill_batch=8, prefill_tokens=100)
    for i in range(4):
        s.add(make(f"r{i}", 2, arrival=i))
    plan = run_step(s)
    assert plan.num_sequences == 2 and s.num_waiting == 2


def test_waits_when_kv_budget_is_exhausted():
    s = sched(blocks=3, bs=4, prefill_tokens=100)
    s.add(make("a", 8, arrival=0))  # 2 blocks
    s.add(make("b", 8, arrival=1))  # would need 2 more
    plan = run_step(s)
    assert [it.seq.request.request_id for it in plan.items] == ["a"]
    assert s.num_waiting == 1


def test_preemption_frees_the_least_urgent():
    s = sched(blocks=4, bs=4, prefill_tokens=100)
    a, b = make("a", 8, arrival=0), make("b", 8, arrival=1)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 full blocks each, token 9 sampled
    plan = run_step(s)  # both need position 8 -> a third block each; only b is preempted
    ids = [it.seq.request.request_id for it in plan.items]
    assert ids == ["a"] and s.num_preemptions == 1 and s.num_waiting == 1
    assert b.sequences[0].num_computed == 0


def preempted_with_two_sequences(req_id, n_prompt, n_generated, arrival=0.0):
    """A request whose n=2 sequences had generated ``n_generated`` tokens each when it was preempted."""
    req = make(req_id, n_prompt, arrival=arrival)
    req.sequences[0].token_ids += [7] * n_generated
    req.sequences.append(Sequence(req, 1, list(req.prompt_ids) + [8] * n_generated, detok=None, stopper=None,
                                  generator=None))
    return req


def test_a_readmitted_request_shares_its_prompt_blocks_between_its_sequences():
    """16-token prompt (4 blocks of 4), two sequences of 19 tokens: 6 blocks with the prompt
    shared, 10 without, more than the cache's 8. The request is readmitted, its first
    sequence computes the shared blocks, then both compute the rest in the same step (their
    logits come together), and the request behind it runs too."""
    s = sched(blocks=8, bs=4, prefill_tokens=100)
    a = preempted_with_two_sequences("a", 16, 3, arrival=0)
    b = make("b", 3, arrival=1)
    s.add(a)
    s.add(b)
    lead, other = a.sequences
    plan = run_step(s)
    assert [(it.seq.request.request_id, it.seq.index, it.num_tokens) for it in plan.items] == [("a", 0, 16), ("b", 0, 3)]
    assert other.table.blocks[:4] == lead.table.blocks[:4] and len(other.table.blocks) == 5
    assert s.blocks.num_free == 8 - 6 - 1
    plan = run_step(s)  # the shared blocks are computed: the second sequence recomputes the rest
    assert [(it.seq.request.request_id, it.seq.index, it.num_tokens) for it in plan.items] == [
        ("a", 0, 3), ("a", 1, 3), ("b", 0, 1)]
    s.remove(a)
    s.remove(b)
    assert s.blocks.num_free == 8


def test_readmission_with_the_prefix_cache_counts_the_shared_prompt_once():
    s = Scheduler(BlockManager(12, 4, enable_prefix_cache=True), 8, 4, 100, 100)
    a = make("a", 16)
    for i in range(1, 8):  # n=8, two generated tokens each: 4 shared blocks + 8 own ones
        a.sequences.append(Sequence(a, i, list(a.prompt_ids), detok=None, stopper=None, generator=None))
    for seq in a.sequences:
        seq.token_ids += [9, 9]
    s.add(a)
    run_step(s)
    assert a in s.running and s.blocks.num_free == 0
