"""The engine in-process with the real default model (no Triton): batching, seeds, stops, n, KV budget."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from llm_engine.config import Settings
from llm_engine.errors import EngineError, RequestTimeout
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request


def build(dtype="float32", **schedule):
    from llm_engine.factory import build_engine

    s = Settings()
    s.model.dtype = dtype
    for k, v in schedule.items():
        setattr(s.schedule, k, v)
    eng = build_engine(s)
    eng.start()
    return eng


@pytest.fixture(scope="module")
def engine():
    eng = build(kvCacheMemoryMiB=128)
    yield eng
    eng.stop()


class Run:
    """Submit a request and collect its outputs."""

    def __init__(self, eng, prompt, stream=True, cancel=None, **params):
        self.outputs, self.error, self.done = [], None, threading.Event()
        ids = eng.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        self.req = Request(f"t{id(self)}", ids, parse_sampling_parameters(params), self._emit, stream=stream,
                           is_cancelled=cancel or (lambda: False))
        eng.prepare(self.req)
        eng.submit(self.req)

    def _emit(self, out):
        if isinstance(out, EngineError):
            self.error = out
            self.done.set()
            return
        self.outputs.append(out)
        if out.final:
            self.done.set()

    def wait(self, timeout=120):
        assert self.done.wait(timeout), "request did not finish"
        return self

    def text(self, index=0):
        return "".join(o.text for o in self.outputs if o.index == index)

    def finals(self):
        return {o.index: o for o in self.outputs if o.finish_reason}


def test_greedy_matches_transformers_generate(engine, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompt = "The capital of France is"
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=8, do_sample=False)
    want = engine.tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert Run(engine, prompt, max_tokens=8, temperature=0).wait().text() == want


def test_exactly_one_final_and_counts(engine):
    r = Run(engine, "Hello", max_tokens=5, temperature=0, ignore_eos=True).wait()
    assert [o.final for o in r.outputs].count(True) == 1 and r.outputs[-1].final
    last = r.outputs[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 5
    assert len(last.batch_size) == 5 and len(last.queue_wait_us) == 5


def test_seed_reproducible_under_concurrency(engine):
    params = dict(max_tokens=12, temperature=1.0, seed=1234, top_k=50, ignore_eos=True)
    alone = Run(engine, "A story about a dragon", **params).wait().text()
    noise = [Run(engine, f"Noise {i} unseeded", max_tokens=12, temperature=1.0, ignore_eos=True) for i in range(3)]
    batched = Run(engine, "A story about a dragon", **params)
    for r in noise + [batched]:
        r.wait()
    assert max(max(o.batch_size) for o in batched.outputs) > 1
    assert batched.text() == alone


def test_unseeded_requests_report_a_seed(engine):
    r = Run(engine, "Hi", max_tokens=2, temperature=1.0).wait()
    assert r.outputs[-1].seed > 0


def test_stop_string_spanning_tokens(engine):
    full = Run(engine, "The capital of France is", max_tokens=16, temperature=0).wait().text()
    # a stop string that starts inside one token and ends inside the next
    cut = len(full) // 2
    stop = full[cut - 2: cut + 3]
    r = Run(engine, "The capital of France is", max_tokens=16, temperature=0, stop=[stop]).wait()
    assert r.text() == full[: full.index(stop)] and r.finals()[0].finish_reason == "stop"
    incl = Run(engine, "The capital of France is", max_tokens=16, temperature=0, stop=[stop],
               include_stop_str_in_output=True).wait()
    assert incl.text() == full[: full.index(stop) + len(stop)]
    # a streamed prefix never shows a partial stop string
    for o in r.outputs:
        assert stop not in o.text


def test_text_held_back_for_a_stop_string_is_kept_when_a_stop_token_ends(engine):
    """The last characters may be the start of a stop string, so they are held back; when a
    stop token (or EOS) then ends the sequence, they are part of the output after all."""
    prompt = "The capital of France is"
    ids = [t for o in Run(engine, prompt, max_tokens=12, temperature=0, ignore_eos=True).wait().outputs
           for t in o.token_ids]
    k = next(i for i in range(4, 12) if ids[i] not in ids[:i])
    before = Run(engine, prompt, max_tokens=k, temperature=0, ignore_eos=True).wait().text()
    stop = before[-2:] + "\x00never"  # its start matches the text's end, the rest never comes
    for stream in (True, False):
        r = Run(engine, prompt, stream=stream, max_tokens=12, temperature=0, ignore_eos=True,
                stop=[stop], stop_token_ids=[ids[k]]).wait()
        assert r.text() == before and r.finals()[0].finish_reason == "stop"
        assert r.finals()[0].completion_tokens == k + 1


def test_stop_token_ids(engine):
    full = Run(engine, "Count: one, two,", max_tokens=10, temperature=0, ignore_eos=True).wait()
    tokens = [t for o in full.outputs for t in o.token_ids]
    r = Run(engine, "Count: one, two,", max_tokens=10, temperature=0, ignore_eos=True,
            stop_token_ids=[tokens[3]]).wait()
    assert r.outputs[-1].completion_tokens == tokens.index(tokens[3]) + 1
    assert r.finals()[0].finish_reason == "stop"


def test_n_and_best_of(engine):
    r = Run(engine, "Write a word:", stream=False, max_tokens=6, temperature=1.0, n=2, best_of=3, seed=9,
            ignore_eos=True).wait()
    finals = r.finals()
    assert sorted(finals) == [0, 1, 2]
    assert all(o.completion_tokens == 6 for o in finals.values())
    assert len({r.text(i) for i in finals}) > 1
    assert all(o.cumulative_logprob < 0 for o in finals.values())


def test_logprobs_per_token(engine):
    r = Run(engine, "Hello", stream=False, max_tokens=4, temperature=0, logprobs=3, ignore_eos=True).wait()
    entries = r.outputs[-1].logprobs
    assert len(entries) == 4
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top"]) == 3
        assert e["top"][0][1] >= e["top"][-1][1]
        assert e["logprob"] == pytest.approx(e["top"][0][1], abs=1e-4)  # greedy picks the top one


def test_cancellation_frees_the_slot(engine):
    flag = threading.Event()
    free_before = engine.blocks.num_free
    r = Run(engine, "A long story:", max_tokens=200, temperature=0, ignore_eos=True, cancel=flag.is_set)
    while not r.outputs:
        r.done.wait(0.01)
    steps_at_cancel = engine.steps
    flag.set()
    r.wait()
    assert r.outputs[-1].finish_reason == "cancelled" and r.outputs[-1].final
    assert engine.steps - steps_at_cancel <= 3
    assert r.outputs[-1].completion_tokens < 200
    assert engine.blocks.num_free >= free_before - 1  # prefix-cached prompt blocks may stay parked


def test_timeout_ends_with_an_error(engine):
    r = Run(engine, "Tell me everything:", max_tokens=400, temperature=0, ignore_eos=True, timeout=0.3).wait()
    assert isinstance(r.error, RequestTimeout)


def test_prefix_cache_reports_cached_tokens_and_keeps_results(engine):
    prompt = "You are a helpful assistant. Answer briefly and clearly. Question: what is two plus two?"
    a = Run(engine, prompt, max_tokens=6, temperature=0).wait()
    b = Run(engine, prompt, max_tokens=6, temperature=0).wait()
    assert a.outputs[-1].cached_tokens == 0 or a.outputs[-1].cached_tokens < b.outputs[-1].cached_tokens
    assert b.outputs[-1].cached_tokens > 0
    assert a.text() == b.text()


def test_prompt_too_long_is_rejected_before_queueing(engine):
    req = Request("long", [1] * 3000, parse_sampling_parameters("{}"), emit=lambda o: None)
    with pytest.raises(EngineError) as exc:
        engine.prepare(req)
    assert exc.value.status == 424 and "2048" in str(exc.value)


def test_kv_budget_exhaustion_queues_instead_of_failing(engine):
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
        assert eng.blocks.num_free == 12
        assert eng.scheduler.num_preemptions > 0
        alone = [Run(engine, f"Request number {i} says", max_tokens=40, temperature=0, ignore_eos=True).wait().text()
                 for i in range(6)]
        assert [r.text() for r in runs] == alone
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


def test_beam_search_returns_n_ranked_beams(engine):
    r = Run(engine, "The best way to learn is", stream=False, max_tokens=6, use_beam_search=True, n=3,
            temperature=0, logprobs=0).wait()
    finals = sorted(r.finals().values(), key=lambda o: o.index)
    assert [o.index for o in finals] == [0, 1, 2] and finals[-1].final
    texts = [o.text for o in finals]
    assert len(set(texts)) == 3
    scores = [o.cumulative_logprob / max(1, o.completion_tokens) for o in finals]
    assert scores == sorted(scores, reverse=True)
    for o in finals:
        assert len(o.logprobs) == o.completion_tokens
        assert sum(e["logprob"] for e in o.logprobs) == pytest.approx(o.cumulative_logprob, abs=1e-3)
    # the best beam scores at least as well as greedy decoding
    greedy = Run(engine, "The best way to learn is", stream=False, max_tokens=6, temperature=0,
                 logprobs=0).wait().outputs[-1]
    assert finals[0].cumulative_logprob >= greedy.cumulative_logprob - 1e-3 or finals[0].completion_tokens < 6
    assert engine.blocks.num_free > 0


def test_prefix_cache_does_not_change_greedy_output(engine):
    prompt = "In a quiet village by the sea, an old fisherman told stories every evening. One night he said"
    no_cache = build(kvCacheMemoryMiB=64, enablePrefixCache=False)
    try:
        want = Run(no_cache, prompt, max_tokens=10, temperature=0).wait().text()
    finally:
        no_cache.stop()
    Run(engine, prompt, max_tokens=10, temperature=0).wait()
    again = Run(engine, prompt, max_tokens=10, temperature=0).wait()
    assert again.outputs[-1].cached_tokens > 0
    assert again.text() == want


def test_a_request_cancelled_while_queued_never_runs():
    eng = build(kvCacheBlocks=4, cacheBlockSize=16, enablePrefixCache=False)
    try:
        hog = Run(eng, "Fill the cache with a long answer", max_tokens=40, temperature=0, ignore_eos=True)
        flag = threading.Event()
        waiting = Run(eng, "I will wait " * 10, max_tokens=5, temperature=0, cancel=flag.is_set)
        flag.set()
        waiting.wait()
        hog.wait()
        assert waiting.outputs[-1].finish_reason == "cancelled"
        assert waiting.outputs[-1].completion_tokens == 0
        assert eng.blocks.num_free == 4
    finally:
        eng.stop()


def test_a_local_hf_checkpoint_directory_loads(model_dir):
    from llm_engine.factory import build_engine

    s = Settings()
    s.model.modelWeightPath = str(model_dir)
    s.model.dtype = "float32"
    s.schedule.kvCacheMemoryMiB = 32
    eng = build_engine(s)
    eng.start()
    try:
        r = Run(eng, "Hello", max_tokens=3, temperature=0, ignore_eos=True).wait()
        assert r.outputs[-1].completion_tokens == 3
    finally:
        eng.stop()


def test_a_failing_request_does_not_take_others_down(engine, monkeypatch):
    poison = engine.tokenizer(" zebra").input_ids[-1]
    real_forward = engine.runner.forward

    def forward(step):
        if poison in step.input_ids.tolist():
            raise RuntimeError("injected model bug")
        return real_forward(step)

    monkeypatch.setattr(engine.runner, "forward", forward)
    healthy = Run(engine, "A healthy request", max_tokens=30, temperature=0, ignore_eos=True)
    while not healthy.outputs:
        healthy.done.wait(0.01)
    bad = Run(engine, "A poisoned zebra", max_tokens=5, temperature=0).wait()
    healthy.wait()
    assert isinstance(bad.error, EngineError) and "injected" in str(bad.error)
    assert healthy.error is None and healthy.outputs[-1].completion_tokens == 30
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    assert Run(engine, "Still serving", max_tokens=2, temperature=0).wait().error is None


def test_prompts_prefilled_together_match_each_alone(engine):
    prompts = ["Hi", "The history of the Roman empire begins with", "List: apples, pears,"]
    alone = [Run(engine, p, max_tokens=6, temperature=0, ignore_eos=True).wait().text() for p in prompts]
    together = [Run(engine, p, max_tokens=6, temperature=0, ignore_eos=True) for p in prompts]
    assert [r.wait().text() for r in together] == alone
    assert max(together[-1].outputs[0].batch_size) > 1




@pytest.fixture(scope="module")
def bf16_engine():
    eng = build(dtype="bfloat16", kvCacheMemoryMiB=64)
    yield eng
    eng.stop()


def test_bf16_batched_decode_matches_each_alone(bf16_engine):
    """bf16 runs prepacked linears and matmul attention on CPU, SDPA elsewhere: same greedy
    text in a batch on either."""
    eng = bf16_engine
    assert eng.runner.dtype == torch.bfloat16
    assert eng.runner.matmul_attention == (eng.runner.device.type == "cpu")
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Monday, Tuesday,", "A, B, C, D,"]
    alone = [Run(eng, p, max_tokens=6, temperature=0, ignore_eos=True).wait().text() for p in prompts]
    together = [Run(eng, p, max_tokens=6, temperature=0, ignore_eos=True) for p in prompts]
    assert [r.wait().text() for r in together] == alone
    assert max(together[-1].outputs[-1].batch_size) == len(prompts)


def test_bf16_seeded_sampling_is_bit_identical_whatever_shares_the_batch(bf16_engine):
    """Hot sampling amplifies any one-ulp difference between batch sizes into other tokens;
    batch-invariant kernels keep every logprob identical, not just the text."""
    eng = bf16_engine
    req = dict(max_tokens=16, temperature=0.9, seed=4242, ignore_eos=True, logprobs=1)
    alone = Run(eng, "Once upon a time", **req).wait()
    runs = [Run(eng, "Once upon a time", **req)] + [
        Run(eng, f"Noise {i}", max_tokens=16, temperature=1.0, ignore_eos=True) for i in range(5)]
    batched = runs[0].wait()
    for r in runs[1:]:
        r.wait()
    assert max(batched.outputs[-1].batch_size) > 1
    assert batched.text() == alone.text()
    lp = lambda run: [e["logprob"] for o in run.outputs for e in o.logprobs]  # noqa: E731
    assert lp(batched) == lp(alone)


def test_bf16_prefix_cache_hit_gives_the_same_bits_as_a_miss(bf16_engine):
    """A seeded request repeated after its prompt was cached must not change: every prompt
    position takes the same attention path whether the positions before it come from the
    cache or are computed in the same step (short, long, and one-token-past-a-block prompts).

    That holds for the CPU's matmul attention. CUDA's flash / memory-efficient SDPA sums a
    hit's fewer query rows differently: on an H200 (2026-12-04) the long prompt's text was
    the same and its logprobs differed at bf16 rounding (first token -0.0643 against -0.0602)."""
    eng = bf16_engine
    exact = eng.runner.matmul_attention
    chosen = lambda run: [e["logprob"] for o in run.outputs for e in o.logprobs]  # noqa: E731
    bs = eng.blocks.block_size
    tok = eng.tokenizer
    short = "Cache test. " + " ".join(f"Line {i}: waves." for i in range(8))  # a few blocks, < 128 tokens
    long = "Cache test. " + " ".join(f"Chapter {i}: the tide came in and went out again." for i in range(20))
    one_past_blocks = tok.decode(tok(long.replace("Cache", "Tail")).input_ids[: 6 * bs + 1])
    req = dict(max_tokens=8, temperature=0.9, seed=99, ignore_eos=True, logprobs=2)
    lp = lambda run: [(e["logprob"], e["top"]) for o in run.outputs for e in o.logprobs]  # noqa: E731
    for prompt in (short, long, one_past_blocks):
        miss = Run(eng, prompt, **req).wait()
        hit = Run(eng, prompt, **req).wait()
        assert miss.outputs[-1].cached_tokens == 0 and hit.outputs[-1].cached_tokens > 0, prompt[:30]
        assert hit.text() == miss.text()
        if exact:
            assert lp(hit) == lp(miss), prompt[:30]
        else:
            assert chosen(hit) == pytest.approx(chosen(miss), abs=0.1), prompt[:30]
    # one token past a block boundary: a lone last token would be attended as a single
    # query row (another kernel), so the cache leaves the last full block to compute too
    assert hit.outputs[-1].prompt_tokens == 6 * bs + 1
    assert hit.outputs[-1].cached_tokens == 5 * bs


def test_bf16_short_prompt_split_by_the_token_budget_gives_the_same_bits(bf16_engine, monkeypatch):
    """A prompt of up to 128 tokens prefilled in budget-sized pieces (here 17 tokens, which
    leaves a lone last token) gives the same numbers as one prefilled whole: all its pieces
    take the padded attention path, whose rows do not depend on the padding. (Longer
    prompts split this way differ in the last bits: each piece attends over a different
    number of keys, and SDPA's sums depend on that.)"""
    # On CUDA (H200, 2026-12-04) the pieces take SDPA, whose sums depend on the number of keys:
    # the same text, logprobs 1e-4 apart. Bit-exact is the CPU's matmul attention.
    exact = bf16_engine.runner.matmul_attention
    monkeypatch.setattr(bf16_engine.blocks, "enable_prefix_cache", False)
    small = build(dtype="bfloat16", kvCacheMemoryMiB=64, maxPrefillTokens=17, enablePrefixCache=False)
    try:
        tok = bf16_engine.tokenizer
        req = dict(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)
        lp = lambda run: [(e["logprob"], e["top"]) for o in run.outputs for e in o.logprobs]  # noqa: E731
        text = " ".join(f"Chapter {i}: the tide came in and went out again." for i in range(20))
        prompt = tok.decode(tok(text).input_ids[:120])
        whole = Run(bf16_engine, prompt, **req).wait()
        split = Run(small, prompt, **req).wait()
        assert whole.outputs[-1].prompt_tokens == 120
        assert split.text() == whole.text()
        if exact:
            assert lp(split) == lp(whole)
        else:
            flat = lambda run: [e["logprob"] for o in run.outputs for e in o.logprobs]  # noqa: E731
            assert flat(split) == pytest.approx(flat(whole), abs=1e-2)
    finally:
        small.stop()


def test_the_engine_thread_makes_its_device_current(monkeypatch):
    """On CUDA/NPU the loop's thread must not run on device 0 when its instance has another."""
    import llm_engine.engine as engine_module
    from llm_engine.device import use_in_this_thread

    seen = []
    monkeypatch.setattr(engine_module, "use_in_this_thread",
                        lambda device: seen.append((device, threading.current_thread().name)))
    eng = build(kvCacheMemoryMiB=16)
    try:
        assert Run(eng, "Hi", max_tokens=1, temperature=0).wait().error is None
    finally:
        eng.stop()
    assert seen == [(eng.runner.device, "llm-engine")]

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_in_this_thread(torch.device("cuda", 3))
    use_in_this_thread(torch.device("cpu"))
    assert calls == [torch.device("cuda", 3)]


def test_health_reports_a_hung_step_and_recovers_when_it_ends(monkeypatch):
    eng = build(kvCacheMemoryMiB=16)
    eng.step_timeout = 0.3
    real = eng.runner.forward
    calls = []

    def slow_once(step):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.2)
        return real(step)

    monkeypatch.setattr(eng.runner, "forward", slow_once)
    try:
        assert eng.health() == ""
        r = Run(eng, "Hi", max_tokens=2, temperature=0)
        assert wait_until(lambda: "has run for more than 0.3 s" in eng.health(), 5)
        assert r.wait().error is None and eng.health() == ""
    finally:
        eng.stop()


def test_health_reports_steps_failing_in_a_row_and_a_dead_thread(monkeypatch):
    eng = build(kvCacheMemoryMiB=16)
    eng.max_failed_steps = 3
    real = eng.runner.forward

    def broken(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "forward", broken)
    try:
        for i in range(3):
            assert isinstance(Run(eng, f"Try {i}", max_tokens=2, temperature=0).wait().error, EngineError)
        assert eng.health() == "3 engine steps failed in a row"
        monkeypatch.setattr(eng.runner, "forward", real)
        assert Run(eng, "Works again", max_tokens=2, temperature=0).wait().error is None
        assert eng.health() == ""
        with eng._wake:  # the thread ends without stop(): an unexpected death
            eng._stop = True
            eng._wake.notify()
        eng._thread.join(5)
        eng._stop = False
        assert eng.health() == "the engine thread has ended"
    finally:
        eng.stop()


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_full_engine_queue_refuses_at_once_and_serves_again_when_it_drains(monkeypatch):
    """maxWaitingRequests bounds the queue: beyond it submit() raises Overloaded (503 with
    Retry-After at the API) instead of queueing without bound."""
    from llm_engine.errors import Overloaded

    eng = build(kvCacheMemoryMiB=16, maxBatchSize=1, maxPrefillBatchSize=1, maxWaitingRequests=2)
    release = threading.Event()
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda step: (release.wait(30), real(step))[1])
    try:
        running = Run(eng, "First", max_tokens=2, temperature=0)
        assert wait_until(lambda: len(eng.scheduler.running) == 1, 10)
        queued = [Run(eng, f"Queued {i}", max_tokens=2, temperature=0) for i in range(2)]
        with pytest.raises(Overloaded, match="queue is full"):
            Run(eng, "One too many", max_tokens=2, temperature=0)
        release.set()
        for r in [running, *queued]:
            assert r.wait().error is None
        assert Run(eng, "After", max_tokens=2, temperature=0).wait().error is None
    finally:
        release.set()
        eng.stop()


def test_stop_during_a_long_step_leaves_the_scheduler_to_the_engine_thread(monkeypatch):
    """stop() that times out while a step runs must not end requests from another thread;
    the engine thread ends them, with one error each, when the step is over."""
    eng = build(kvCacheMemoryMiB=16)
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda step: (time.sleep(1.0), real(step))[1])
    r = Run(eng, "Hi", max_tokens=50, temperature=0, ignore_eos=True)
    assert wait_until(lambda: eng._step_started > 0, 10)
    eng.stop(timeout=0.1)
    assert eng._thread.is_alive() and not r.done.is_set()  # the step is still running
    assert r.wait(10).error is not None and "shutting down" in str(r.error)
    eng._thread.join(5)
    assert not eng._thread.is_alive() and not eng.scheduler.requests()
    assert [o.final for o in r.outputs].count(True) == 0
