"""The float32 one-row GGUF Q8_0 Linear (``csrc/linear_q8_avx2.c``, ``ModelConfig.cpuLinearWeights``),
the lm_head of a GGUF whose head is Q8_0: the dense product up to float32 rounding, exact
dequantisation, a row's bits the same on any thread count, and how
:class:`~llm_engine.linear.Fp32Linear` holds and picks it. The kernel needs AVX2 with FMA and
F16C; elsewhere these tests are skipped. The engine on it: test_linear_q4_fp32.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_ops, linear
from llm_engine.linear import Fp32Linear, make_linear

from tests.unit.test_linear_q4_fp32 import _close_to_dense
from tests.unit.test_linear_q8 import _blocks, _dequantized


def _q8_row_ops():
    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    if not ops.has_linear_q8:
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    return ops


@pytest.mark.parametrize("n, k", [(49152, 576), (576, 576), (3072, 576), (576, 1536), (16, 32), (48, 96), (80, 64)])
def test_the_q8_row_kernel_matches_f_linear_on_the_dequantized_weight_with_and_without_bias(n, k):
    """(49152, 576): SmolLM2's lm_head; 80 outputs: 10 groups of 8, two panels and a short one."""
    ops = _q8_row_ops()
    ops.set_threads(torch.get_num_threads())
    blocks = _blocks(n, k, seed=n + k)
    w, bias = _dequantized(blocks), torch.randn(n)
    packed = ops.q8_pack(torch.from_numpy(blocks), n, k)
    assert packed.numel() == blocks.size  # the blocks' own 1.0625 bytes a weight
    for seed in range(2):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
        _close_to_dense(ops.linear_row_blocks("q8", x, packed, n, None), F.linear(x, w))
        _close_to_dense(ops.linear_row_blocks("q8", x, packed, n, bias), F.linear(x, w, bias))


def test_q8_dequantizing_in_float32_gives_the_bits_of_gguf_py():
    ops = _q8_row_ops()
    blocks = _blocks(64, 1536, seed=3)
    got = ops.q8_dequantize(torch.from_numpy(blocks), 64, 1536)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), _dequantized(blocks).view(torch.int32))


def test_a_q8_row_has_the_same_bits_on_one_thread_and_on_several():
    ops = _q8_row_ops()
    blocks = _blocks(49152, 576, seed=1)
    packed, x = ops.q8_pack(torch.from_numpy(blocks), 49152, 576), torch.randn(1, 576)
    try:
        ops.set_threads(1)
        one = ops.linear_row_blocks("q8", x, packed, 49152, None)
        ops.set_threads(max(2, torch.get_num_threads()))
        assert torch.equal(ops.linear_row_blocks("q8", x, packed, 49152, None), one)
    finally:
        ops.set_threads(torch.get_num_threads())


def _q8_linear(n: int, k: int, seed: int, ops) -> tuple[Fp32Linear, torch.Tensor, torch.Tensor]:
    blocks = _blocks(n, k, seed)
    w, b = _dequantized(blocks), torch.randn(n)
    lin = make_linear(w, b, ops)
    if not isinstance(lin, Fp32Linear) or lin.packed is None:
        pytest.skip("no oneDNN prepacking in this torch build")
    lin.add_blocks("q8", torch.from_numpy(blocks), ops)
    return lin, w, b


def test_an_fp32_linear_on_q8_blocks_serves_single_rows_from_them_and_batches_prepacked():
    ops = _q8_row_ops()
    lin, w, b = _q8_linear(96, 64, seed=5, ops=ops)
    lin.use("prepacked", "q8")
    assert lin.weight is None and lin.blocks is not None and lin.packed is not None
    assert lin.one_row_bytes() == lin.second_form_bytes() == 96 * 64 * 17 // 16
    for rows in (1, 2, 17):
        x = torch.randn(rows, 64)
        _close_to_dense(lin(x), F.linear(x, w, b))
    other, _, _ = _q8_linear(96, 64, seed=5, ops=ops)
    other.use("prepacked", "q4")  # another kind's blocks: fused on the dense weight, the Q8_0 blocks dropped
    assert other.kinds == ("prepacked", "fused") and other.blocks is None and other.weight is not None


@pytest.mark.parametrize("q8_cost, expect", [(0.5, "q8"), (1.45, "prepacked")])
def test_choose_fp32_kernels_times_the_q8_head_apart_from_the_q4_layers(monkeypatch, q8_cost, expect):
    """Each group of Linears holding the same blocks gets its own single-row kernel: the Q4_1
    layers theirs, the Q8_0 head the Q8 kernel only where it beats prepacked by FP32_GAIN."""
    ops = _q8_row_ops()
    if not ops.has_linear_q4:
        pytest.skip("no float32 Q4_1 kernel")
    from tests.unit.test_linear_q4_fp32 import _q4_linear

    clock = {"t": 0.0}
    costs = {"plain": 2.0, "prepacked": 1.5, "fused": 1.6, "q4": 0.5, "q8": q8_cost}
    real = {k: getattr(Fp32Linear, k) for k in Fp32Linear.KINDS}

    def costed(kind):
        def kernel(self, x):
            clock["t"] += 1.0 if x.shape[0] > 1 and kind == "prepacked" else costs[kind]
            return real[kind](self, x)

        kernel.__name__ = kind
        return kernel

    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock["t"])
    for kind in real:
        monkeypatch.setattr(Fp32Linear, kind, costed(kind))
    layers = [_q4_linear(64, 64, seed=s, ops=ops)[0] for s in range(3)]
    head, w, _ = _q8_linear(128, 64, seed=9, ops=ops)
    linear.choose_fp32_kernels([*layers, head], ops, batch_rows=8)
    assert all(lin.kinds == ("prepacked", "q4") for lin in layers)
    assert head.kinds == ("prepacked", expect) and (head.blocks is not None) == (expect == "q8")
