"""The GGUF Q4_1 Linear (``csrc/linear_q4.c``, ``ModelConfig.cpuLinearWeights`` ``gguf``):
right numbers against the dequantised weight, a row's bits the same whatever the batch or
thread count, the GGUF's blocks mapped to the runner's projections, and dense weights
wherever it can't be used. The kernel needs AVX512-BF16; elsewhere only the fallback is
checked."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from llm_engine import cpu_ops, gguf_blocks
from llm_engine.linear import PackedQ4Linear, PackedQ8Linear
from llm_engine.weights import default_gguf_path, gguf_source

from tests.unit.engine_harness import Run, build
from tests.unit.test_linear_bf16 import assert_rows_invariant


def _q4_ops():
    ops = cpu_ops.load(torch.bfloat16)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    if not ops.has_linear_q4:
        pytest.skip("this CPU has no AVX512-BF16")
    return ops


def _blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_1 blocks ``uint8 [n, k / 32 * 20]`` with weights of about the model's size."""
    rng = np.random.default_rng(seed)
    blocks = np.empty((n, k // 32, 20), np.uint8)
    d = rng.uniform(0.002, 0.02, (n, k // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) * rng.uniform(0.8, 1.2, d.shape)).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, -1, 2)
    blocks[:, :, 2:4] = m.view(np.uint8).reshape(n, -1, 2)
    blocks[:, :, 4:] = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return blocks.reshape(n, -1)


def _dequantized(blocks: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q4_1))


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (48, 64), (80, 32), (16, 96)])
def test_the_q4_linear_matches_the_dequantized_weight_with_and_without_bias(n, k):
    ops = _q4_ops()
    blocks = _blocks(n, k, seed=n + k)
    w = _dequantized(blocks).double()
    bias = torch.randn(n)
    x = torch.randn(37, k).bfloat16()
    reference = x.double() @ w.T
    plain = PackedQ4Linear(torch.from_numpy(blocks), n, k, None, ops)
    biased = PackedQ4Linear(torch.from_numpy(blocks), n, k, bias, ops)
    scale = reference.abs().max()
    for got, want in ((plain(x), reference), (biased(x), reference + bias.double())):
        assert got.dtype == torch.bfloat16 and got.shape == (37, n)
        # the exact sum, rounded once to bfloat16 (half an ulp: 2^-9 relative), give or take
        # float32 sums
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + scale * 1e-5).all()
    assert plain(x[:0]).shape == (0, n)


def test_a_q4_row_has_the_same_bits_alone_anywhere_in_a_batch_and_on_any_thread_count():
    ops = _q4_ops()
    lin = PackedQ4Linear(torch.from_numpy(_blocks(3072, 576, seed=1)), 3072, 576, None, ops)
    assert_rows_invariant(lin, torch.randn(70, 576).bfloat16(), ops)


def test_q4_packing_rejects_blocks_of_another_shape_and_shapes_that_do_not_fit():
    ops = _q4_ops()
    assert ops.q4_fits(960, 576) and not ops.q4_fits(50, 576) and not ops.q4_fits(960, 80)
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        ops.q4_pack(torch.zeros(576, 360, dtype=torch.uint8), 576, 1536)
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        ops.q4_pack(torch.zeros(50, 40, dtype=torch.uint8), 50, 64)
    with pytest.raises(ValueError, match="Q4_1 blocks"):
        ops.q4_dequantize(torch.zeros(16, 40, dtype=torch.uint8), 16, 64 + 16)


def test_q4_dequantizing_in_c_gives_the_bits_of_gguf_py_rounded_by_torch():
    ops = _q4_ops()
    blocks = _blocks(64, 1536, seed=3)
    want = _dequantized(blocks).to(torch.bfloat16)
    assert torch.equal(ops.q4_dequantize(torch.from_numpy(blocks), 64, 1536).view(torch.int16),
                       want.view(torch.int16))


def test_the_q4_linear_lets_go_of_the_gil_while_it_runs():
    from tests.unit.test_cpu_ops import _other_thread_ran_inside

    ops = _q4_ops()
    # a call of tens of ms, as the bf16 test's: in one of a few ms the other thread was not
    # always scheduled on the 2 cores the kernel's threads hold
    lin = PackedQ4Linear(torch.from_numpy(_blocks(49152, 576, seed=2)), 49152, 576, None, ops)
    x = torch.randn(256, 576).bfloat16()
    assert _other_thread_ran_inside(lambda: lin(x))


def test_unpermuting_q_and_k_rows_is_what_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(192 * 3).reshape(192, 3)
    for heads, kv_heads, n in ((9, 3, 192), (4, 4, 64)):
        processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
        want_k = processor.process(rows[:n], "blk.0.attn_k.weight").weights
        assert np.array_equal(gguf_blocks._unpermute(rows[:n], kv_heads), want_k)
        if n % heads == 0 and (n // heads) % 2 == 0:
            want_q = processor.process(rows[:n], "blk.0.attn_q.weight").weights
            assert np.array_equal(gguf_blocks._unpermute(rows[:n], heads), want_q)


def test_the_default_gguf_blocks_decode_to_the_weights_the_model_loads():
    """The blocks of layer 0's projections, as the runner orders them, decode to exactly the
    loaded bf16 weights; blocks that do not are refused."""
    from llm_engine.weights import resolve_model_dir
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir("")
    assert gguf_source("") == default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    cfg, layer = model.config, model.model.layers[0]
    blocks = gguf_blocks.read_projections(default_gguf_path(), 1, cfg.num_attention_heads, cfg.num_key_value_heads)[0]
    a, m = layer.self_attn, layer.mlp
    weights = {"qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), "o": a.o_proj.weight,
               "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]), "down": m.down_proj.weight}
    ops = _q4_ops()
    for name, weight in weights.items():
        assert gguf_blocks.decodes_to(blocks[name], weight, ops), name
    assert not gguf_blocks.decodes_to(blocks["o"], a.o_proj.weight.T.contiguous(), ops)  # rows in another order
    assert not gguf_blocks.decodes_to(blocks["qkv"], weights["o"], ops)  # another shape
    assert not gguf_blocks.decodes_to(blocks["o"], a.o_proj.weight.float(), ops)  # not bf16


def test_the_gguf_source_follows_the_setting_not_the_cache_marker(tmp_path):
    """A checkpoint folder has no GGUF source; a GGUF path is its own source. The cache's
    marker may name another install's file (CI's cache once held a path from elsewhere)."""
    assert gguf_source(str(tmp_path)) is None
    gguf = tmp_path / "m.gguf"
    assert gguf_source(str(gguf)) is None  # not there
    gguf.write_bytes(b"GGUF")
    assert gguf_source(str(gguf)) == gguf
    (tmp_path / ".complete").write_text(str(tmp_path / "elsewhere.gguf"))
    assert gguf_source(str(tmp_path)) is None


@pytest.fixture(scope="module")
def q4_engine():
    eng = build(dtype="bfloat16", linear_weights="gguf", kvCacheMemoryMiB=64)
    yield eng
    eng.stop()


def test_the_engine_runs_every_decoder_linear_on_the_gguf_blocks(q4_engine):
    runner = q4_engine.runner
    if runner.ops is None or not runner.ops.has_linear_q4:
        pytest.skip("the fused kernels' Q4_1 Linear is not available here")
    projections = [*runner.qkv, *runner.o_proj, *runner.gate_up, *runner.down]
    assert len(projections) == 120 and all(isinstance(lin, PackedQ4Linear) for lin in projections)
    assert runner.fused_layers is not None  # decode steps still run every layer in one C call
    assert sum(lin.packed.numel() for lin in projections) == 106_168_320 * 5 // 8
    if runner.ops.has_linear_q8:  # the tied head on the token embedding's Q8_0 blocks
        assert isinstance(runner.lm_head, PackedQ8Linear)
        # what the bench's memory-bound limit divides by: the Q4_1 blocks and the head's int8 copy
        assert runner.weight_bytes_per_token() == 106_168_320 * 5 // 8 + 49152 * 576 * 17 // 16


def test_the_q4_engine_answers_like_the_dense_one(q4_engine):
    """Other last bits than the dense weights, the same model: greedy continuations of plain
    prompts agree for their first tokens (prompts whose top two tokens are at least 1.1 apart
    in logprob at each of the three, on this EPYC; logprobs moved by up to 0.05)."""
    dense = build(dtype="bfloat16", linear_weights="dense", kvCacheMemoryMiB=64)
    try:
        assert dense.runner.weight_bytes_per_token() == (106_168_320 + 49152 * 576) * 2
        prompts = ["The capital of France is", "1, 2, 3, 4, 5,", "A, B, C, D,"]
        req = dict(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
        for prompt in prompts:
            got, want = Run(q4_engine, prompt, **req).wait(), Run(dense, prompt, **req).wait()
            assert got.text() == want.text(), prompt
            lp = lambda run: [e["logprob"] for o in run.outputs for e in o.logprobs]  # noqa: E731
            assert lp(got) == pytest.approx(lp(want), abs=0.15)
    finally:
        dense.stop()


@pytest.mark.parametrize("setting", ["gguf", "auto"])
def test_gguf_linear_weights_fall_back_to_dense_where_they_cannot_be_used(caplog, setting):
    """Without the fused kernels there is no Q4_1 kernel: the engine loads dense weights, and
    says why when gguf was asked for (auto just takes dense)."""
    with caplog.at_level(logging.DEBUG, logger="llm_engine.projections"):
        eng = build(dtype="float32", cpu_kernels="off", linear_weights=setting, kvCacheMemoryMiB=64)
    try:
        assert not any(isinstance(lin, PackedQ4Linear) or getattr(lin, "blocks", None) is not None
                       for lin in eng.runner.qkv)
        warned = [r for r in caplog.records if "cpuLinearWeights gguf needs" in r.getMessage()]
        assert [r.levelno for r in warned] == [logging.WARNING if setting == "gguf" else logging.DEBUG]
        assert Run(eng, "Hello", max_tokens=2, temperature=0).wait().outputs[-1].finish_reason
    finally:
        eng.stop()


def test_dense_linear_weights_never_read_the_gguf(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was read")

    monkeypatch.setattr(gguf_blocks, "read_projections", refuse)
    monkeypatch.setattr(gguf_blocks, "read_lm_head", refuse)
    eng = build(dtype="bfloat16", linear_weights="dense", kvCacheMemoryMiB=64)
    try:
        assert not any(isinstance(lin, PackedQ4Linear) for lin in eng.runner.qkv)
        assert not isinstance(eng.runner.lm_head, PackedQ8Linear)
    finally:
        eng.stop()
