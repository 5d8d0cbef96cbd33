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
