"""The fused kernels' bfloat16 Linear (``csrc/linear_amx.c`` on AMX tiles, else
``csrc/linear_avx512bf16.c`` on AVX512-BF16): right numbers, and a row's bits the same
whatever the batch, its place in it, or the thread count. Runs with the kernel this CPU
gets (Sapphire Rapids: AMX; Zen 4, Cooper Lake: AVX512-BF16); elsewhere only the fallback
is checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_ops
from llm_engine.linear import PackedBf16Linear, make_linear

from tests.unit.test_engine_bf16 import AMX


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


def _bf16_ops():
    ops = cpu_ops.load(torch.bfloat16)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    return ops


def _packed_ops():
    ops = _bf16_ops()
    if ops.bf16_kernel is None:
        pytest.skip("this CPU has neither AMX-BF16 (granted by Linux) nor AVX512-BF16")
    return ops


def test_the_best_bf16_kernel_the_cpu_has_is_offered():
    ops = _bf16_ops()
    expected = "amx" if AMX else "avx512_bf16" if "avx512_bf16" in _cpu_flags() else None
    assert ops.bf16_kernel == expected
    assert not cpu_ops.load(torch.float32).bf16_fits(torch.zeros(16, 32))


def test_only_shapes_of_whole_blocks_fit():
    ops = _packed_ops()
    assert ops.bf16_fits(torch.zeros(960, 576, dtype=torch.bfloat16))
    for n, k in [(100, 576), (960, 77), (8, 32)]:
        assert not ops.bf16_fits(torch.zeros(n, k, dtype=torch.bfloat16))
    assert not ops.bf16_fits(torch.zeros(960, 576))  # float32
    # AMX multiplies 32 inputs a tile; AVX512-BF16 two at a time
    assert ops.bf16_fits(torch.zeros(16, 40, dtype=torch.bfloat16)) == (ops.bf16_kernel == "avx512_bf16")


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (48, 64), (80, 64), (16, 96)])
def test_the_linear_matches_a_float32_reference_with_and_without_bias(n, k):
    ops = _packed_ops()
    torch.manual_seed(7)
    w, b = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(37, k).bfloat16()
    lin, biased = PackedBf16Linear(w, None, ops), PackedBf16Linear(w, b, ops)
    reference = x.float() @ w.float().T
    for got, want, torchs in ((lin(x), reference, F.linear(x, w)),
                              (biased(x), reference + b.float(), F.linear(x, w, b))):
        assert got.dtype == torch.bfloat16 and got.shape == (37, n)
        # one rounding to bfloat16: no further from the float32 result than torch's own kernel
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        assert (got.float() - want).abs().max() <= (torchs.float() - want).abs().max() * 1.5 + 1e-3
    strided = torch.randn(k, 3).bfloat16()[:, 1][None]
    assert torch.equal(lin(strided), lin(strided.contiguous()))
    assert lin(x[:0]).shape == (0, n)


def test_a_row_has_the_same_bits_alone_anywhere_in_a_batch_and_on_any_thread_count():
    ops = _packed_ops()
    torch.manual_seed(8)
    w = (torch.randn(3072, 576) * 0.05).bfloat16()
    assert_rows_invariant(PackedBf16Linear(w, None, ops), torch.randn(70, 576).bfloat16(), ops)


def assert_rows_invariant(lin, x: torch.Tensor, ops) -> None:
    """Each row of ``lin(x)`` has the same bits alone, anywhere in a batch, and on 1-3 threads."""
    try:
        ops.set_threads(2)
        full = lin(x)
        for rows in (slice(0, 1), slice(5, 6), slice(15, 17), slice(3, 40), slice(16, 32), slice(33, 70),
                     slice(69, 70), slice(0, 9), slice(2, 22)):
            assert torch.equal(lin(x[rows]), full[rows]), rows
        assert all(torch.equal(lin(x[i : i + 1]), full[i : i + 1]) for i in range(x.shape[0]))
        for threads in (1, 3):
            ops.set_threads(threads)
            assert torch.equal(lin(x), full)
    finally:
        ops.set_threads(1)


def test_make_linear_takes_the_packed_kernel_where_it_fits_and_onednn_elsewhere():
    ops = _packed_ops()
    fits = make_linear((torch.randn(576, 576) * 0.05).bfloat16(), None, ops)
    odd = make_linear((torch.randn(100, 576) * 0.05).bfloat16(), None, ops)
    plain = make_linear((torch.randn(576, 576) * 0.05).bfloat16())
    assert isinstance(fits, PackedBf16Linear)
    assert not isinstance(odd, PackedBf16Linear) and not isinstance(plain, PackedBf16Linear)
    x = torch.randn(3, 576).bfloat16()
    assert odd(x).shape == (3, 100)


def test_the_packed_linear_lets_go_of_the_gil_while_it_runs():
    from tests.unit.test_cpu_ops import _other_thread_ran_inside

    ops = _packed_ops()
    lin = PackedBf16Linear((torch.randn(49152, 576) * 0.05).bfloat16(), None, ops)
    x = torch.randn(256, 576).bfloat16()
    assert _other_thread_ran_inside(lambda: lin(x))
