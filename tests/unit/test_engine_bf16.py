"""The engine in bf16: which results are bit-identical whatever shares a step (on CPU, with
the fused kernels and with the torch path's matmul attention), and what holds on CUDA."""

from __future__ import annotations

import pytest
import torch
from llm_engine import cpu_ops
from llm_engine.linear import PackedQ4Linear

from tests.unit.engine_harness import Run, build


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


# On CPUs with AMX (seen on a Sapphire Rapids Xeon, 2026-12-06), oneDNN's bf16 kernels pick
# their blocking by the number of rows: the torch path's matmuls and SDPA's causal and masked
# paths then give a row other bits in another batch, as CUDA's SDPA does. The fused path's
# matmuls run on the AMX tile kernel there, which is batch-invariant by construction, and
# its paged attention kernel computes each query row alone; only long prompts' SDPA differs.
AMX = _cpu_has_amx()


@pytest.fixture(scope="module", params=["fused", "torch", "gguf"])
def bf16_engine(request):
    """The engine with the fused CPU kernels (where they build) on dense weights, with the torch
    path, and with the fused kernels on the GGUF's Q4_1 blocks (``cpuLinearWeights`` ``gguf``,
    what ``auto`` picks on AVX512-BF16 CPUs without AMX; dense where the CPU has no AVX512-BF16)."""
    eng = build(dtype="bfloat16", cpu_kernels="off" if request.param == "torch" else "auto", kvCacheMemoryMiB=64,
                linear_weights="gguf" if request.param == "gguf" else "dense")
    assert (eng.runner.ops is None) == (request.param == "torch" or eng.runner.device.type != "cpu"
                                        or cpu_ops.load(torch.bfloat16) is None)
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

    That holds on CPU (the fused kernels and the matmul attention; on AMX CPUs, see AMX above). CUDA's flash / memory-efficient SDPA sums a
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
        if exact and not (AMX and (prompt is long or eng.runner.ops is None)):
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
    exact = bf16_engine.runner.matmul_attention and not (AMX and bf16_engine.runner.ops is None)
    monkeypatch.setattr(bf16_engine.blocks, "enable_prefix_cache", False)
    small = build(dtype="bfloat16", cpu_kernels="auto" if bf16_engine.runner.ops else "off", kvCacheMemoryMiB=64,
                  linear_weights="gguf" if isinstance(bf16_engine.runner.qkv[0], PackedQ4Linear) else "dense",
                  maxPrefillTokens=17, enablePrefixCache=False)
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
