"""Batched sampling: greedy, seeds, top-k/top-p, penalties, logprobs; each test on both ways
of getting a row's argmax and logsumexp (torch's log_softmax, and the fused CPU kernel)."""

import functools
import math

import pytest
import torch
from llm_engine import cpu_ops
from llm_engine.sampler import RowSpec, greedy_tokens
from llm_engine.sampler import sample as sample_with


@pytest.fixture(params=["log_softmax", "fused kernel"])
def sample(request):
    """``sample(logits, rows)`` through one way or the other."""
    if request.param == "log_softmax":
        return functools.partial(sample_with, row_stats=None)
    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    return functools.partial(sample_with, row_stats=ops.argmax_logsumexp)


def row(gen=None, **kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, generator=gen, logprobs=None, prompt_ids=[], output_ids=[])
    base.update(kw)
    return RowSpec(**base)


def g(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def test_greedy_rows_take_argmax(sample):
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample(logits, [row(), row()]).tokens == [1, 0]


def test_seeded_row_is_independent_of_batch(sample):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    alone = sample(logits[:1].clone(), [row(g(7))]).tokens[0]
    batched = sample(logits.clone(), [row(g(7)), row(g(1)), row(), row(g(3))]).tokens[0]
    assert alone == batched


def test_top_k_one_is_greedy(sample):
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    for seed in range(5):
        assert sample(logits.clone(), [row(g(seed), top_k=1)]).tokens[0] == int(logits.argmax())


def test_top_p_keeps_only_the_nucleus(sample):
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.05, 0.05]]))
    picks = {sample(logits.clone(), [row(g(s), top_p=0.5)]).tokens[0] for s in range(20)}
    assert picks == {0}


def test_repetition_penalty_discourages_seen_tokens(sample):
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits.clone(), [row(repetition_penalty=2.0, output_ids=[0])]).tokens == [1]


def test_presence_and_frequency_penalties(sample):
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    assert sample(logits.clone(), [row(presence_penalty=1.0, output_ids=[0])]).tokens == [1]
    assert sample(logits.clone(), [row(frequency_penalty=0.3, output_ids=[0, 0])]).tokens == [1]


def test_logprobs_and_top_alternatives(sample):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    res = sample(logits.clone(), [row(logprobs=2)])
    assert res.tokens == [0]
    assert abs(res.logprobs[0] - torch.log(torch.tensor(0.5)).item()) < 1e-5
    assert [t for t, _ in res.top[0]] == [0, 1]
    assert res.top[0][0][1] == res.logprobs[0]  # the chosen token's logprob, the same bits in both places


def _tied_scores(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """9 rows of integer scores (many ties), with maxima in the tail, tied between the first
    block and the tail, tied across blocks, and a row all equal."""
    scores = torch.randint(-40, 40, (9, vocab), generator=gen).float()
    scores[1, -1] = 1000.0
    scores[2, 0] = scores[2, -1] = 1000.0
    scores[3, 5] = scores[3, vocab // 2] = 1000.0
    scores[4] = -5.0
    return scores


@pytest.mark.parametrize("vocab", [7, 1024, 2048, 49152, 50257, 151936])
def test_greedy_tokens_equal_argmax_with_ties_and_any_vocab(vocab):
    scores = _tied_scores(vocab, torch.Generator().manual_seed(vocab))
    assert torch.equal(greedy_tokens(scores), torch.argmax(scores, dim=-1))
    assert torch.equal(greedy_tokens(scores[:1]), torch.argmax(scores[:1], dim=-1))


@pytest.mark.parametrize("vocab", [7, 1024, 2048, 49152, 50257])
def test_the_fused_row_stats_give_the_first_argmax_and_the_logsumexp(vocab):
    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    gen = torch.Generator().manual_seed(vocab)
    logits = _tied_scores(vocab, gen)
    logits[5:] = torch.randn(4, vocab, generator=gen) * 4
    tokens, lse = ops.argmax_logsumexp(logits)
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), dim=-1).float(), rtol=1e-6, atol=1e-5)
    for threads in (1, 2, 3):  # each row alone, and on any number of threads: the same bits
        ops.set_threads(threads)
        try:
            for i in (0, 3, 8):
                one_tok, one_lse = ops.argmax_logsumexp(logits[i : i + 1])
                assert one_tok[0] == tokens[i] and torch.equal(one_lse[0], lse[i])
        finally:
            ops.set_threads(1)


@pytest.mark.parametrize("penalty", [1e-40, 1e-30, 1e39, 1e300])
def test_extreme_repetition_penalties_give_finite_logprobs(sample, penalty):
    """Any repetition_penalty > 0 is valid on /infer; divided into float32 logits, 1e-40 made
    them inf and the logprobs NaN (which is not even JSON)."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -3.0]])
    result = sample(logits.clone(), [row(repetition_penalty=penalty, prompt_ids=[0, 1, 3], logprobs=2)])
    assert all(map(math.isfinite, result.logprobs)) and result.tokens[0] in (0, 1, 2, 3)
    assert all(math.isfinite(lp) for _, lp in result.top[0])


def test_an_enormous_temperature_samples_near_uniformly_without_nan(sample):
    """A temperature beyond float32 became inf, and a token masked by a grammar (-inf) then
    became NaN: every draw returned the last token."""
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]])
    picks = [sample(logits.clone(), [row(g(s), temperature=1e39)]).tokens[0] for s in range(60)]
    assert set(picks) == {0, 1, 2}
