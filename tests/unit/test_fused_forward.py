"""The runner's forward on the fused CPU kernels: against its torch path, the decoder
layers in one C call against the Python loop, and the torch path when no compiler is found."""

from __future__ import annotations

import types

import pytest
import torch
from llm_engine import cpu_cores, cpu_ops
from llm_engine.batch import build_step_input
from llm_engine.runner import ModelRunner
from llm_engine.scheduler import Plan, Scheduled


def _tiny_runner(dtype, fused):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return ModelRunner(model, torch.device("cpu"), dtype, num_blocks=128, block_size=8, max_positions=512,
                       fused_kernels=fused)


def _sequence(ids, computed, prompt_len, blocks):
    return types.SimpleNamespace(token_ids=ids, num_computed=computed, prompt_len=prompt_len,
                                 table=types.SimpleNamespace(blocks=list(blocks)))


def _decodes_and_a_short_prompt(a, b, c, tables):
    """Decodes at positions len(a) - 1 and len(b) - 1, and a short prompt c, in one step."""
    return [_sequence(a, len(a) - 1, len(a) - 1, tables["a"]), _sequence(b, len(b) - 1, len(b) - 1, tables["b"]),
            _sequence(c, 0, len(c), tables["c"])]


def _run(runner, seqs):
    plan = Plan([Scheduled(s, len(s.token_ids) - s.num_computed) for s in seqs], [])
    step, _ = build_step_input(plan, 8, torch.device("cpu"), runner.dummy_slot)
    return step, runner.forward(step)


def test_the_fused_forward_matches_the_torch_path_on_a_mixed_step():
    """One step with two decodes, a short prompt, a long prompt (SDPA) and a later chunk
    of a long prompt: logits and the KV cache agree with the torch path (float32)."""
    if cpu_ops.load(torch.float32) is None:
        pytest.skip("no C compiler on this machine")
    runners = [_tiny_runner(torch.float32, fused) for fused in (True, False)]
    assert runners[0].ops is not None and runners[1].ops is None
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    a, b, e = ids(40), ids(150), ids(200)  # already in the cache: two decodes and a chunked prompt
    tables = dict(a=range(0, 6), b=range(6, 26), c=range(26, 28), d=range(28, 46), e=range(46, 75))
    for runner in runners:  # the same cache to start from, filled by the torch path
        ops, runner.ops = runner.ops, None
        _run(runner, [_sequence(a, 0, 40, tables["a"]), _sequence(b, 0, 150, tables["b"]),
                      _sequence(e, 0, 230, tables["e"])])
        runner.ops = ops
    new_a, new_b, c, d, more_e = ids(1), ids(1), ids(12), ids(140), ids(30)
    results = []
    for runner in runners:
        step, logits = _run(runner, [
            *_decodes_and_a_short_prompt(a + new_a, b + new_b, c, tables),  # decodes at 40 and 150
            _sequence(d, 0, 140, tables["d"]),  # a long prompt in one chunk
            _sequence(e + more_e, 200, 230, tables["e"]),  # the last chunk of a long prompt
        ])
        assert step.decode_rows.numel() == 2 and step.short_prefills is not None and len(step.prefills) == 2
        results.append((logits, runner.kv.clone()))
    (fused, kv_fused), (plain, kv_plain) = results
    assert fused.shape == (5, 300)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fused, kv_plain, rtol=1e-5, atol=1e-5)


def test_no_compiler_means_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(cpu_cores.shutil, "which", lambda name: None)
    monkeypatch.setenv("MINDIE_TRITON_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_ops, "_library", None)
    assert cpu_ops.load(torch.float32) is None
    assert _tiny_runner(torch.float32, fused=True).ops is None
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").iterdir())


def _on_q4_blocks(runner) -> None:
    """Every projection of ``runner`` on random GGUF Q4_1 blocks (the same for every runner)."""
    from llm_engine.fused_layers import FusedLayers
    from llm_engine.linear import PackedQ4Linear

    from tests.unit.test_linear_q4 import _blocks

    for i in range(len(runner.layers)):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(runner, name)[i]
            n, k = lin.packed.shape
            blocks = torch.from_numpy(_blocks(n, k, seed=100 * i + len(name)))
            getattr(runner, name)[i] = PackedQ4Linear(blocks, n, k, None, runner.ops)
    runner.fused_layers = FusedLayers.for_runner(runner)


@pytest.mark.parametrize("weights", ["bf16", "q4"])
def test_the_decoder_layers_in_one_call_give_the_bits_of_the_python_loop(weights):
    """bfloat16 on the fused Linear: steps of decodes and short prompts run every layer in one
    C call (fused_layers.py), with the same kernels in the same order as the runner's loop."""
    ops = cpu_ops.load(torch.bfloat16)
    if ops is None or ops.bf16_kernel is None:
        pytest.skip("no bfloat16 Linear kernel on this CPU (AMX or AVX512-BF16)")
    if weights == "q4" and not ops.has_linear_q4:
        pytest.skip("no Q4_1 Linear kernel on this CPU (AVX512-BF16)")
    runners = [_tiny_runner(torch.bfloat16, True) for _ in range(2)]
    if weights == "q4":
        for runner in runners:
            _on_q4_blocks(runner)
    assert runners[0].fused_layers is not None
    assert runners[0].fused_layers.model.linear == (ops.linear_q4_address if weights == "q4"
                                                    else ops.linear_bf16_address)
    runners[1].fused_layers = None  # the Python loop
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(0, 300, (n,), generator=g).tolist()  # noqa: E731
    a, b = ids(40), ids(150)
    tables = dict(a=range(0, 6), b=range(6, 26), c=range(26, 28))
    for runner in runners:  # fill the cache: long prompts, so the Python loop in both
        step, _ = _run(runner, [_sequence(a, 0, 40, tables["a"]), _sequence(b, 0, 150, tables["b"])])
        assert step.prefills
    new_a, new_b, c, next_a = ids(1), ids(1), ids(12), ids(1)
    results = []
    for runner in runners:
        step, mixed = _run(runner, _decodes_and_a_short_prompt(a + new_a, b + new_b, c, tables))
        assert step.decode_rows.numel() == 2 and step.short_prefills is not None and not step.prefills
        _, decodes = _run(runner, [_sequence(a + new_a + next_a, 41, 40, tables["a"])])
        results.append((mixed, decodes, runner.kv.clone()))
    assert all(torch.equal(x, y) for x, y in zip(*results))
