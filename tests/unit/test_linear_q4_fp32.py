"""The float32 one-row GGUF Q4_1 Linear (``csrc/linear_q4_avx2.c``, ``ModelConfig.cpuLinearWeights``):
the dense product up to float32 rounding, a row's bits the same on any thread count, how
:class:`~llm_engine.linear.Fp32Linear` holds and picks it, and the engine on it. The kernel
needs AVX2 with FMA and F16C; elsewhere these tests are skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_ops, linear
from llm_engine.linear import Fp32Linear, make_linear

from tests.unit.engine_harness import Run, build
from tests.unit.test_linear_q4 import _blocks, _dequantized


def _q4_row_ops():
    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    if not ops.has_linear_q4:
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    return ops


def _close_to_dense(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding: within 1e-5 of the row's largest output."""
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= scale * 1e-5).all(), ((got - want).abs() / scale).max()


@pytest.mark.parametrize(
    "n, k", [(576, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (16, 32), (48, 96)]
)
def test_the_q4_row_kernel_matches_f_linear_on_the_dequantized_weight_with_and_without_bias(n, k):
    ops = _q4_row_ops()
    ops.set_threads(torch.get_num_threads())
    blocks = _blocks(n, k, seed=n + k)
    w, bias = _dequantized(blocks), torch.randn(n)
    packed = ops.q4_pack(torch.from_numpy(blocks), n, k)
    assert packed.numel() == blocks.size  # the blocks' own 0.625 bytes a weight
    for seed in range(3):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
        _close_to_dense(ops.linear_row_blocks("q4", x, packed, n, None), F.linear(x, w))
        _close_to_dense(ops.linear_row_blocks("q4", x, packed, n, bias), F.linear(x, w, bias))


def test_q4_dequantizing_in_float32_gives_the_bits_of_gguf_py():
    ops = _q4_row_ops()
    blocks = _blocks(64, 1536, seed=3)
    got = ops.q4_dequantize(torch.from_numpy(blocks), 64, 1536)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), _dequantized(blocks).view(torch.int32))


def test_a_q4_row_has_the_same_bits_on_one_thread_and_on_several():
    ops = _q4_row_ops()
    blocks = _blocks(3072, 576, seed=1)
    packed, x = ops.q4_pack(torch.from_numpy(blocks), 3072, 576), torch.randn(1, 576)
    try:
        ops.set_threads(1)
        one = ops.linear_row_blocks("q4", x, packed, 3072, None)
        ops.set_threads(max(2, torch.get_num_threads()))
        assert torch.equal(ops.linear_row_blocks("q4", x, packed, 3072, None), one)
    finally:
        ops.set_threads(torch.get_num_threads())


def _q4_linear(n: int, k: int, seed: int, ops) -> tuple[Fp32Linear, torch.Tensor, torch.Tensor]:
    blocks = _blocks(n, k, seed)
    w, b = _dequantized(blocks), torch.randn(n)
    lin = make_linear(w, b, ops)
    if not isinstance(lin, Fp32Linear) or lin.packed is None:
        pytest.skip("no oneDNN prepacking in this torch build")
    lin.add_blocks("q4", torch.from_numpy(blocks), ops)
    return lin, w, b


def test_an_fp32_linear_on_q4_blocks_serves_single_rows_from_them_and_batches_prepacked():
    ops = _q4_row_ops()
    lin, w, b = _q4_linear(96, 64, seed=5, ops=ops)
    lin.use("prepacked", "q4")
    assert lin.weight is None and lin.blocks is not None and lin.packed is not None  # no dense copy left
    assert lin.one_row_bytes() == lin.second_form_bytes() == 96 * 64 * 5 // 8
    for rows in (1, 2, 17):
        x = torch.randn(rows, 64)
        _close_to_dense(lin(x), F.linear(x, w, b))
    other, _, _ = _q4_linear(96, 64, seed=5, ops=ops)
    other.use("prepacked", "fused")
    assert other.blocks is None and other.weight is not None  # blocks no kernel reads are dropped


@pytest.mark.parametrize("q4_cost, expect", [(0.5, "q4"), (1.45, "prepacked")])
def test_choose_fp32_kernels_takes_the_q4_blocks_for_single_rows_only_where_they_win(
    monkeypatch, q4_cost, expect
):
    """The blocks are a second weight form beside the prepacked one: they must win by
    FP32_GAIN. A Linear without blocks is timed and chosen for apart (here prepacked: the
    fused kernel does not win by FP32_GAIN)."""
    ops = _q4_row_ops()
    clock = {"t": 0.0}
    costs = {
        ("plain", 8): 2.0,
        ("prepacked", 8): 1.0,
        ("plain", 1): 2.0,
        ("prepacked", 1): 1.5,
        ("fused", 1): 1.6,
        ("q4", 1): q4_cost,
    }
    real = {k: getattr(Fp32Linear, k) for k in Fp32Linear.KINDS}

    def costed(kind):
        def kernel(self, x):
            if self.blocks is not None or kind != "q4":  # "q4" without blocks runs (and costs) "fused"
                clock["t"] += costs[kind, x.shape[0]]
            return real[kind](self, x)

        kernel.__name__ = kind
        return kernel

    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock["t"])
    for kind in real:
        monkeypatch.setattr(Fp32Linear, kind, costed(kind))
    layers = [_q4_linear(64, 64, seed=s, ops=ops)[0] for s in range(3)]
    head = make_linear(torch.randn(128, 64), None, ops)
    linear.choose_fp32_kernels([*layers, head], ops, batch_rows=8)
    for lin in layers:
        assert lin.kinds == ("prepacked", expect)
        assert (lin.blocks is not None) == (expect == "q4") and lin.weight is None
    assert head.kinds == ("prepacked", "prepacked") and head.blocks is None


def test_a_float32_engine_reads_the_gguf_q4_blocks_for_single_rows_and_answers_like_the_dense_one():
    """Each projection holds the blocks exactly where single rows are chosen to read them
    (timed at load); greedy text is the dense engine's."""
    _q4_row_ops()
    q4 = build(dtype="float32", linear_weights="gguf", kvCacheMemoryMiB=64)
    try:
        runner = q4.runner
        projections = [*runner.qkv, *runner.o_proj, *runner.gate_up, *runner.down]
        assert len(projections) == 120 and all(isinstance(lin, Fp32Linear) for lin in projections)
        on_q4 = [lin.kinds[1] == "q4" for lin in projections]
        assert all(on_q4) or not any(on_q4)
        assert all((lin.blocks is not None) == q for lin, q in zip(projections, on_q4))
        head = runner.lm_head  # its Q8_0 blocks likewise (csrc/linear_q8_avx2.c; test_linear_q8_fp32.py)
        assert isinstance(head, Fp32Linear) and (head.blocks is not None) == (head.kinds[1] == "q8")
        layer_bytes = 106_168_320 * 5 // 8 if all(on_q4) else 106_168_320 * 4
        head_bytes = 49152 * 576 * 17 // 16 if head.kinds[1] == "q8" else 49152 * 576 * 4
        assert runner.weight_bytes_per_token() == layer_bytes + head_bytes
        req = dict(max_tokens=6, temperature=0, ignore_eos=True)
        got = Run(q4, "The capital of France is", **req).wait().text()
    finally:
        q4.stop()
    dense = build(dtype="float32", linear_weights="dense", kvCacheMemoryMiB=64)
    try:
        assert Run(dense, "The capital of France is", **req).wait().text() == got
    finally:
        dense.stop()
