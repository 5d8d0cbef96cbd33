"""The runner's device kernels against torch's reference ops (prepacked linear, matmul attention), and CPU threads."""

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_ops, linear
from llm_engine.linear import is_batch_invariant, make_linear, packing_supported
from llm_engine.runner import matmul_attention, rotate, sdpa_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_linear_matches_f_linear(dtype, rows):
    torch.manual_seed(rows)
    w = torch.randn(96, 64, dtype=dtype)
    b = torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    for bias in (None, b):
        got = make_linear(w, bias)(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-2, atol=1e-2)


def test_bf16_weights_are_prepacked_on_cpu_when_onednn_supports_it():
    # the speed-up this module exists for; on CPUs without bf16 support it falls back
    expected = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packing_supported(torch.device("cpu"), torch.bfloat16) == expected
    assert not packing_supported(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("k", [576, 1536, 4096])
def test_bf16_linears_are_batch_invariant(k):
    """A row's result may not depend on the other rows (seeded requests in a batch), for the
    linears the fused path makes: the fused bf16 kernel where the CPU has AMX or AVX512-BF16,
    else oneDNN's form the load-time probe picks. (On AMX CPUs oneDNN's bf16 kernels change their
    blocking with the row count, and no form the probe can pick is invariant for all data:
    the torch path, ``cpuKernels: off``, is not batch-invariant there; see test_engine_bf16.)"""
    torch.manual_seed(k)
    w = (torch.randn(576, k) * k**-0.5).bfloat16()
    lin = make_linear(w, None, cpu_ops.load(torch.bfloat16))
    assert is_batch_invariant(lin, k, torch.bfloat16, torch.device("cpu"))
    x = torch.randn(9, k, dtype=torch.bfloat16)
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=2e-2, atol=2e-2)


def _rowwise(weight, bias, differs):
    """A stand-in kernel whose rows are exact, plus one ulp-sized error when ``differs(rows)``."""
    def lin(x):
        y = (x.float()[:, None, :] * weight.float()[None]).sum(-1)
        return (y + (1e-2 if differs(x.shape[0]) else 0.0)).to(x.dtype)
    return lin


def test_a_kernel_that_differs_only_for_single_rows_gets_them_padded(monkeypatch):
    """oneDNN took another path for one row of SmolLM2's down projection than for 2-512:
    padding a single row to two is then enough, with no K split."""
    monkeypatch.setattr(linear, "_kernel", lambda w, b: _rowwise(w, b, lambda rows: rows == 1))
    w = torch.randn(32, 128).bfloat16()
    assert linear._invariant_strategy(w) == linear.PAD_ONE_ROW
    lin = linear._build(w, None, linear.PAD_ONE_ROW)
    x = torch.randn(5, 128).bfloat16()
    assert torch.equal(lin(x[2:3]), lin(x)[2:3])
    assert lin(x[2:3]).shape == (1, 32)


def test_a_kernel_that_differs_between_larger_batches_is_not_padded(monkeypatch):
    monkeypatch.setattr(linear, "_kernel", lambda w, b: _rowwise(w, b, lambda rows: rows % 2 == 1))
    assert linear._invariant_strategy(torch.randn(32, 128).bfloat16()) != linear.PAD_ONE_ROW


def _decode_mask(lengths, lk):
    return (torch.arange(lk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def _runner_layout(q, k, v):
    """SDPA's ``[B, H, L, D]`` tensors in the runner's: token-major queries, head-major keys."""
    return q.transpose(1, 2).contiguous(), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matmul_attention_matches_sdpa_for_batched_decode(dtype, tol):
    torch.manual_seed(0)
    b, h, kv, d, lk = 6, 9, 3, 64, 40
    q = torch.randn(b, h, 1, d, dtype=dtype)
    k, v = torch.randn(b, kv, lk, d, dtype=dtype), torch.randn(b, kv, lk, d, dtype=dtype)
    mask = _decode_mask([40, 1, 17, 33, 5, 40], lk)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True).transpose(1, 2)
    qr, kr, vr = _runner_layout(q, k, v)
    torch.testing.assert_close(matmul_attention(qr, kr, vr, ~mask, d**-0.5), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(sdpa_attention(qr, kr, vr, mask, d**-0.5), ref, rtol=tol, atol=tol)


def test_matmul_attention_matches_sdpa_for_padded_prefill_chunks():
    torch.manual_seed(1)
    p, h, kv, d, lq, lk = 3, 9, 3, 64, 8, 12
    q = torch.randn(p, h, lq, d)
    k, v = torch.randn(p, kv, lk, d), torch.randn(p, kv, lk, d)
    offset = torch.tensor([4, 0, 2])[:, None, None]  # cached tokens before each chunk
    mask = (torch.arange(lk)[None, None, :] <= offset + torch.arange(lq)[None, :, None])[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    qr, kr, vr = _runner_layout(q, k, v)
    torch.testing.assert_close(matmul_attention(qr, kr, vr, ~mask, 0.125), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_is_bit_identical_to_the_rotate_half_form(dtype):
    torch.manual_seed(2)
    t, heads, d = 5, 12, 64
    x = torch.randn(t, heads, d, dtype=dtype)
    angles = torch.rand(t, 1, d // 2) * 10
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    ref = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    sin_signed = torch.cat([-sin[..., : d // 2], sin[..., d // 2 :]], -1)
    assert torch.equal(rotate(x, cos, sin_signed), ref)


def _fp32_ops():
    from llm_engine import cpu_ops

    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler: no fused kernels")
    return ops


@pytest.mark.parametrize("for_batches,for_one_row", [("plain", "plain"), ("prepacked", "plain"),
                                                     ("prepacked", "prepacked"), ("plain", "fused"),
                                                     ("prepacked", "fused")])
def test_fp32_linear_gives_f_linear_results_with_each_kernel_choice(for_batches, for_one_row):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    torch.manual_seed(3)
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = make_linear(w, b)
    assert isinstance(lin, linear.Fp32Linear) and lin.packed is not None
    if for_one_row == "fused":
        lin.ops = _fp32_ops()
    lin.use(for_batches, for_one_row)
    for rows in (1, 2, 17):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    kinds = {for_batches, for_one_row}
    assert (lin.packed is None) == ("prepacked" not in kinds)  # copies no kernel uses are dropped
    assert (lin.weight is None) == (kinds == {"prepacked"})


@pytest.mark.parametrize("one_row_costs,expect_one_row", [
    ({"plain": 1, "prepacked": 1.5}, "plain"),
    ({"plain": 2, "prepacked": 1.5}, "prepacked"),
    ({"plain": 2, "prepacked": 1.5, "fused": 1.0}, "fused"),  # 1.5x faster than prepacked: worth a 2nd form
    ({"plain": 2, "prepacked": 1.5, "fused": 1.45}, "prepacked"),  # not by FP32_GAIN: one weight form
])
def test_choose_fp32_kernels_follows_the_measured_times(monkeypatch, one_row_costs, expect_one_row):
    """Prepacked twice as fast on batches: it serves them; single rows get whichever is
    faster (a kernel that needs the other weight form must win by FP32_GAIN), and a weight
    form that no kernel uses is dropped."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    clock = {"t": 0.0}
    costs = {("plain", 8): 2.0, ("prepacked", 8): 1.0, **{(k, 1): v for k, v in one_row_costs.items()}}
    real = {k: getattr(linear.Fp32Linear, k) for k in linear.Fp32Linear.KINDS}

    def costed(kind):
        def kernel(self, x):
            clock["t"] += costs[kind, x.shape[0]]
            return real[kind](self, x)
        kernel.__name__ = kind
        return kernel

    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock["t"])
    for kind in real:
        monkeypatch.setattr(linear.Fp32Linear, kind, costed(kind))
    ws = [torch.randn(128, 64) for _ in range(3)]
    layers = [make_linear(w) for w in ws]
    linear.choose_fp32_kernels(layers, _fp32_ops() if "fused" in one_row_costs else None, batch_rows=8)
    for lin, w in zip(layers, ws):
        assert lin.for_batches.__name__ == "prepacked" and lin.for_one_row.__name__ == expect_one_row
        assert (lin.weight is None) == (expect_one_row == "prepacked")
        for rows in (1, 8):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
