"""The engine in-process with the real default model (no Triton): batching, seeds, stops, n, KV budget."""

from __future__ import annotations

import threading

import pytest
from llm_engine.config import Settings
from llm_engine.errors import EngineError, RequestTimeout
from llm_engine.params import parse_sampling_parameters
from llm_engine.sequence import Request

from tests.unit.engine_harness import Run, build


@pytest.fixture(scope="module")
def engine():
    eng = build(kvCacheMemoryMiB=128)
    yield eng
    eng.stop()



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


def test_steps_held_back_for_a_stop_string_are_released_as_separate_events(engine):
    """Spec §2.7.1: a stream holds steps back while a stop string could be starting, then
    releases them as separate events. With a stop string whose start keeps appearing but
    which never matches, the events (one token, its text and logprob each) are those of the
    same request without it; with one that matches, they are those events cut at the match."""
    prompt = "The capital of France is"
    params = dict(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    plain = Run(engine, prompt, **params).wait().outputs
    text = "".join(o.text for o in plain)
    k = next(i for i in range(1, len(plain) - 1) if plain[i].text and len(plain[i + 1].text) > 1)
    never = plain[k].text[-1] + "\x00never"  # held at step k's end, ruled out by step k + 1
    held = Run(engine, prompt, stop=[never], **params).wait().outputs
    assert [(o.text, o.token_ids, o.logprobs[0]["token"]) for o in held] == [
        (o.text, o.token_ids, o.logprobs[0]["token"]) for o in plain]
    stop = plain[k].text[-1] + plain[k + 1].text[:2]  # held at step k, matched in step k + 1
    cut = Run(engine, prompt, stop=[stop], **params).wait().outputs
    assert all(len(o.token_ids) == 1 for o in cut)
    assert [o.token_ids for o in cut] == [o.token_ids for o in plain[:len(cut)]]
    assert "".join(o.text for o in cut) == text[:text.index(stop)] and cut[-1].finish_reason == "stop"


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


def test_a_prompt_of_ids_ending_inside_a_character_completes_it(engine):
    """The model finishes the character the prompt's ids broke off: the completion starts
    with that character (it started with U+FFFD before)."""
    tok = engine.tokenizer
    ids = tok("Chinese greeting: 你好").input_ids
    cut = next(c for c in range(len(ids) - 1, 0, -1) if tok.decode(ids[:c]).endswith("\ufffd"))
    text = Run(engine, ids[:cut], max_tokens=4, temperature=0).wait().text()
    assert "\ufffd" not in text
    assert text.startswith("好")


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
    assert set(r.outputs[-1].batch_size) == {1}  # requests in the step, not sequences (spec §2.10)


def test_logprobs_per_token(engine):
    r = Run(engine, "Hello", stream=False, max_tokens=4, temperature=0, logprobs=3, ignore_eos=True).wait()
    entries = r.outputs[-1].logprobs
    assert len(entries) == 4
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top"]) == 3
        assert e["top"][0][1] >= e["top"][-1][1]
        assert e["logprob"] == pytest.approx(e["top"][0][1], abs=1e-4)  # greedy picks the top one
    tokens = r.outputs[-1].token_ids
    assert [e["token"] for e in entries] == [engine.tokenizer.decode([t], skip_special_tokens=True) for t in tokens]
    assert entries[0]["top"][0][0] == entries[0]["token"]


def test_token_texts_are_decoded_once_and_keep_skip_special_tokens_apart(engine, monkeypatch):
    eos = engine.tokenizer.eos_token_id
    assert engine.token_text(eos, True) == ""
    assert engine.token_text(eos) == engine.tokenizer.decode([eos])
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: pytest.fail("decoded again"))
    assert engine.token_text(eos, True) == "" and engine.token_text(eos) != ""


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


def test_a_stream_with_a_long_stop_string_is_not_held_until_its_end(engine):
    """A stop string over 64 characters once held every step back until the request ended.
    This request is cancelled as soon as its first output arrives."""
    box: list[Run] = []
    r = Run(engine, "Count from one to one hundred:", max_tokens=200, temperature=0, ignore_eos=True,
            stop=["Z" * 65], cancel=lambda: bool(box and box[0].outputs))
    box.append(r)
    last = r.wait().outputs[-1]
    assert last.finish_reason == "cancelled" and last.completion_tokens < 200


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


def test_a_first_token_is_emitted_ahead_of_the_running_requests_tokens(engine, monkeypatch):
    """The sender thread sends in emit order, a round trip to tritonserver each; a newcomer
    among running decodes must not wait behind their sends for its first token."""
    order: list[tuple[str, int]] = []
    emit, postprocess = engine._emit, engine._postprocess

    def recording_emit(req):
        order.append((req.request_id, req.sequences[0].num_generated))
        emit(req)

    def recording_postprocess(*args):
        order.append(("step", 0))
        postprocess(*args)

    monkeypatch.setattr(engine, "_emit", recording_emit)
    monkeypatch.setattr(engine, "_postprocess", recording_postprocess)
    running = [Run(engine, f"Story {i}:", max_tokens=60, temperature=0, ignore_eos=True) for i in range(3)]
    while any(len(r.outputs) < 3 for r in running):
        running[0].done.wait(0.01)
    newcomer = Run(engine, "Hello there", max_tokens=3, temperature=0, ignore_eos=True).wait()
    for r in running:
        r.wait()
    steps, current = [], []
    for name, generated in order:
        if name == "step":
            steps.append(current)
            current = []
        else:
            current.append((name, generated))
    steps.append(current)
    with_first = next(s for s in steps if (newcomer.req.request_id, 1) in s)
    assert len(with_first) > 1  # it shared a step with running requests
    assert with_first[0] == (newcomer.req.request_id, 1)


def test_a_long_prompt_arriving_while_others_decode_is_prefilled_in_chunks(engine, monkeypatch):
    """prefillChunkTokens' auto value on CPU bounds the prompt tokens of a step that also
    decodes, and the chunked prompt gives the tokens it gives in one piece."""
    from llm_engine.factory import CPU_PREFILL_CHUNK_TOKENS

    chunk = engine.scheduler.prefill_chunk_tokens
    assert chunk == CPU_PREFILL_CHUNK_TOKENS
    monkeypatch.setattr(engine.blocks, "enable_prefix_cache", False)  # both runs compute the prompt
    prompt = "Here is a list: " + ", ".join(f"item {i}" for i in range(200)) + ". The last item was"
    assert len(engine.tokenizer(prompt).input_ids) > 2 * chunk
    whole = Run(engine, prompt, max_tokens=4, temperature=0, ignore_eos=True).wait()
    steps = []
    real_forward = engine.runner.forward

    def forward(step):
        steps.append(step.input_ids.shape[0])
        return real_forward(step)

    monkeypatch.setattr(engine.runner, "forward", forward)
    stop = threading.Event()
    busy = Run(engine, "Count slowly:", max_tokens=400, temperature=0, ignore_eos=True, cancel=stop.is_set)
    while not busy.outputs:
        busy.done.wait(0.01)
    chunked = Run(engine, prompt, max_tokens=4, temperature=0, ignore_eos=True).wait()
    stop.set()
    busy.wait()
    assert max(steps) <= chunk + 1  # the prompt's chunk and the busy request's decode token
    assert sum(1 for n in steps if n > 2) >= 3
    assert [t for o in chunked.outputs for t in o.token_ids] == [t for o in whole.outputs for t in o.token_ids]
    # usage: one batch_size/queue_wait_time entry per generated token (seed A), none for the
    # chunks that only prefilled; the first wait runs from arrival to the first chunk
    last = chunked.outputs[-1]
    assert len(last.batch_size) == len(last.queue_wait_us) == last.completion_tokens == 4
    assert last.batch_size[0] == 2  # the prompt's last chunk ran beside the busy request
