"""The GGUF Q8_0 Linear (``csrc/linear_q8.c``), the lm_head of a GGUF whose head is Q8_0:
bit for bit the AVX512-BF16 kernel's results on the dequantised weight (so a row's bits do
not depend on which of the two served its batch), right numbers against that weight, and
the default GGUF's head decodes to the weight the model loads. The kernel needs
AVX512-BF16 (without AMX, whose kernel has other bits); elsewhere these tests skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llm_engine import cpu_ops, gguf_blocks
from llm_engine.linear import PackedBf16Linear, PackedQ8Linear
from llm_engine.weights import default_gguf_path

from tests.unit.test_linear_bf16 import assert_rows_invariant


def _q8_ops():
    ops = cpu_ops.load(torch.bfloat16)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    if not ops.has_linear_q8 or ops.bf16_kernel != "avx512_bf16":
        pytest.skip("this CPU has no AVX512-BF16, or has AMX")
    return ops


def _blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q8_0 blocks ``uint8 [n, k / 32 * 34]`` with weights of about the model's size,
    every code from -128 to 127 included."""
    rng = np.random.default_rng(seed)
    blocks = np.empty((n, k // 32, 34), np.uint8)
    d = rng.uniform(0.0005, 0.002, (n, k // 32)).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(n, -1, 2)
    blocks[:, :, 2:] = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    blocks[0, 0, 2:4] = [0x80, 0x7F]  # -128 and 127
    return blocks.reshape(n, -1)


def _dequantized(blocks: np.ndarray) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0))


def _linear(blocks: np.ndarray, n: int, k: int, bias, ops) -> tuple[PackedQ8Linear, torch.Tensor]:
    weight = _dequantized(blocks).to(torch.bfloat16)
    return PackedQ8Linear(torch.from_numpy(blocks), weight, bias, ops), weight


@pytest.mark.parametrize("n, k", [(3072, 576), (48, 64), (80, 32), (16, 96)])
def test_the_q8_kernel_gives_the_bf16_kernels_bits_on_the_dequantized_weight(n, k):
    ops = _q8_ops()
    blocks = _blocks(n, k, seed=n + k)
    for bias in (None, torch.randn(n)):
        lin, weight = _linear(blocks, n, k, bias, ops)
        dense = PackedBf16Linear(weight, bias, ops)
        x = torch.randn(37, k).bfloat16()
        for rows in (1, 2, 3, 4, 5, 8, 37):  # the kernel itself, at any row count
            got = ops.linear_q8(x[:rows], lin.codes, n, lin.bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            assert torch.equal(got.view(torch.int16), dense(x[:rows]).view(torch.int16)), rows
        # and right: the exact sum over the bfloat16 weights, rounded once to bfloat16 (2^-9
        # relative), give or take float32 sums
        want = x[:3].double() @ weight.double().T + (0 if bias is None else bias.double())
        got = lin(x[:3]).double()
        assert ((got - want).abs() <= want.abs() * 2**-8 + want.abs().max() * 1e-5).all()
        assert lin(x[:0]).shape == (0, n)


def test_a_q8_head_row_has_the_same_bits_whichever_kernel_serves_its_batch():
    """One or two rows read the Q8_0 codes, more the bfloat16 weight: a row's bits agree."""
    ops = _q8_ops()
    lin, _ = _linear(_blocks(3072, 576, seed=1), 3072, 576, None, ops)
    x = torch.randn(70, 576).bfloat16()
    assert_rows_invariant(lin, x, ops)
    full = lin(x)
    for start in range(0, 66, 7):
        for rows in range(2, 9):
            assert torch.equal(lin(x[start:start + rows]), full[start:start + rows]), (start, rows)


def test_q8_packing_rejects_blocks_of_another_shape_and_shapes_that_do_not_fit():
    ops = _q8_ops()
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        ops.q8_pack(torch.zeros(576, 360, dtype=torch.uint8), 576, 576)  # Q4_1-sized rows
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        ops.q8_pack(torch.zeros(50, 68, dtype=torch.uint8), 50, 64)
    with pytest.raises(ValueError, match="Q8_0 blocks"):
        ops.q8_dequantize(torch.zeros(16, 68, dtype=torch.uint8), 16, 64 + 16)
    lin, _ = _linear(_blocks(64, 96, seed=5), 64, 96, None, ops)
    assert lin.bytes_per_row == 64 * 96 * 17 // 16  # what a step of a few rows reads


def test_q8_dequantizing_in_c_gives_the_bits_of_gguf_py_rounded_by_torch():
    ops = _q8_ops()
    blocks = _blocks(64, 1536, seed=3)
    want = _dequantized(blocks).to(torch.bfloat16)
    assert torch.equal(ops.q8_dequantize(torch.from_numpy(blocks), 64, 1536).view(torch.int16),
                       want.view(torch.int16))


def test_the_q8_linear_lets_go_of_the_gil_while_it_runs():
    from tests.unit.test_cpu_ops import _other_thread_ran_inside

    ops = _q8_ops()
    codes = ops.q8_pack(torch.from_numpy(_blocks(49152, 576, seed=2)), 49152, 576)
    x = torch.randn(256, 576).bfloat16()  # the kernel itself, on a call of tens of ms
    assert _other_thread_ran_inside(lambda: ops.linear_q8(x, codes, 49152, None))


def test_the_default_gguf_head_decodes_to_the_lm_head_the_model_loads():
    """SmolLM2's head is tied to its Q8_0 token embedding; the blocks decode to exactly the
    loaded bf16 weight, and blocks that do not are refused."""
    from llm_engine.weights import resolve_model_dir
    from transformers import AutoModelForCausalLM

    ops = _q8_ops()
    blocks = gguf_blocks.read_lm_head(default_gguf_path())
    assert blocks is not None and blocks.flags.writeable
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(""), dtype=torch.bfloat16)
    head = model.lm_head.weight
    assert blocks.shape == (head.shape[0], head.shape[1] // 32 * 34)
    assert gguf_blocks.decodes_to(blocks, head, ops, "q8_0")
    assert not gguf_blocks.decodes_to(blocks, head.flip(0).contiguous(), ops, "q8_0")  # rows in another order
    assert not gguf_blocks.decodes_to(blocks, head.float(), ops, "q8_0")  # not bf16
    assert not gguf_blocks.decodes_to(blocks[:16], head[:32], ops, "q8_0")  # another shape
