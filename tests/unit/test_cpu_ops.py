"""The fused CPU kernels (llm_engine/cpu_ops.py) against torch references, their batch
invariance, how the library is built, and which kernels let go of the GIL. The runner's
forward on them: test_fused_forward.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_cores, cpu_ops
from llm_engine.runner import rotate

DTYPES = [torch.float32, torch.bfloat16]
# bf16 results are rounded once from float32 here, and in several steps by torch
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def ops_for(dtype):
    ops = cpu_ops.load(dtype)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 70])  # 70: a tail shorter than a vector of lanes
def test_add_rms_norm_matches_torch(dtype, dim):
    ops = ops_for(dtype)
    torch.manual_seed(dim)
    h, delta = torch.randn(5, dim, dtype=dtype), torch.randn(5, dim, dtype=dtype)
    weight = torch.rand(dim) + 0.5
    want_h = (h.float() + delta.float()).to(dtype)
    want = F.rms_norm(want_h.float(), (dim,), weight, 1e-5).to(dtype)
    out = torch.empty_like(h)
    ops.add_rms_norm(h, delta, out, weight, 1e-5)
    assert torch.equal(h, want_h)  # the residual add rounds once, as torch's does
    torch.testing.assert_close(out, want, **TOL[dtype])
    ops.add_rms_norm(h, None, out, weight, 1e-5)  # no delta: norm only, h unchanged
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_matches_rotate_and_writes_the_cache_at_each_slot(dtype):
    ops = ops_for(dtype)
    torch.manual_seed(0)
    t, heads, kv_heads, d, slots_n = 4, 6, 2, 16, 40
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, dtype=dtype)
    positions = torch.tensor([0, 7, 3, 19])
    slots = torch.tensor([5, 11, 0, 38])
    angles = torch.randn(32, d)
    cos, sin = angles.cos(), angles.sin()
    sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1)
    cache = torch.zeros(2, kv_heads, slots_n, d, dtype=dtype)
    q = torch.empty(t, heads, d, dtype=dtype)
    ops.rope_store_kv(qkv, positions, cos, sin_signed, heads, kv_heads, q, cache, slots)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d).float()
    want = rotate(qk, cos[positions][:, None], sin_signed[positions][:, None])
    torch.testing.assert_close(q, want[:, :heads].to(dtype), **TOL[dtype])
    torch.testing.assert_close(cache[0][:, slots].transpose(0, 1), want[:, heads:].to(dtype), **TOL[dtype])
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    assert torch.equal(cache[1][:, slots].transpose(0, 1), v)  # v is copied as it is
    untouched = torch.ones(slots_n, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[:, :, untouched].any()


def _attention_case(dtype, lens, seed=0, heads=9, kv_heads=3, d=64, slots_n=300):
    torch.manual_seed(seed)
    cache = torch.randn(2, kv_heads, slots_n, d, dtype=dtype)
    width = max(lens) + 3  # wider than any context: the kernel reads only the first len slots
    ctx = torch.stack([torch.randperm(slots_n)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, d, dtype=dtype)
    return q, cache, ctx, torch.tensor(lens)


def _reference_attention(q, cache, ctx, lens, scale):
    outs = []
    for i, n in enumerate(lens.tolist()):
        k = cache[0][:, ctx[i, :n]].float()  # [KV, n, D]
        v = cache[1][:, ctx[i, :n]].float()
        o = F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=scale, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_matches_sdpa_over_the_gathered_context(dtype):
    ops = ops_for(dtype)
    lens = [1, 17, 130, 64]
    q, cache, ctx, lens_t = _attention_case(dtype, lens)
    out = torch.zeros_like(q)
    ops.paged_attention(q, cache, out, torch.arange(len(lens)), None, lens_t, ctx, 0.125)
    torch.testing.assert_close(out, _reference_attention(q, cache, ctx, lens_t, 0.125), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [
    (14, 2, 64),  # 7 query heads per kv head: taken 4 and 3
    (8, 8, 128),  # no grouping, the other specialised head dim
    (6, 2, 20),   # a head dim of neither size, with a tail shorter than 8 lanes
    (4, 1, 4),    # a head dim shorter than 8 lanes
])
def test_paged_attention_other_head_shapes(dtype, heads, kv_heads, d):
    ops = ops_for(dtype)
    lens = [1, 3, 17, 64, 130]
    q, cache, ctx, lens_t = _attention_case(dtype, lens, heads=heads, kv_heads=kv_heads, d=d)
    out = torch.zeros_like(q)
    ops.paged_attention(q, cache, out, torch.arange(len(lens)), None, lens_t, ctx, 0.125)
    torch.testing.assert_close(out, _reference_attention(q, cache, ctx, lens_t, 0.125), **TOL[dtype])
    alone = torch.zeros_like(q[:1])
    ops.paged_attention(q[3:4].contiguous(), cache, alone, torch.tensor([0]), None, lens_t[3:4],
                        ctx[3:4].contiguous(), 0.125)
    assert torch.equal(alone[0], out[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_rows_and_shared_contexts(dtype):
    """Prefill queries: several rows share one context row, each attending its own prefix;
    rows not named are left alone."""
    ops = ops_for(dtype)
    q, cache, ctx, _ = _attention_case(dtype, [40, 40])
    rows, which, lens = torch.tensor([4, 1, 2]), torch.tensor([1, 0, 1]), torch.tensor([3, 40, 12])
    qs = torch.randn(6, 9, 64, dtype=dtype)
    out = torch.full_like(qs, 7.0)
    ops.paged_attention(qs, cache, out, rows, which, lens, ctx, 0.125)
    want = _reference_attention(qs[rows], cache, ctx[which], lens, 0.125)
    torch.testing.assert_close(out[rows], want, **TOL[dtype])
    assert (out[[0, 3, 5]] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_gives_a_row_the_same_bits_alone_and_anywhere_in_a_batch(dtype):
    """Seeded sampling needs a row's numbers not to depend on what shares its step."""
    ops = ops_for(dtype)
    lens = [33, 5, 120, 77, 2, 64, 9, 100]
    q, cache, ctx, lens_t = _attention_case(dtype, lens, seed=3)
    together = torch.empty_like(q)
    ops.paged_attention(q, cache, together, torch.arange(8), None, lens_t, ctx, 0.125)
    for i in (0, 2, 7):
        alone = torch.empty_like(q[:1])
        ops.paged_attention(q[i : i + 1].contiguous(), cache, alone, torch.tensor([0]), None, lens_t[i : i + 1],
                            ctx[i : i + 1].contiguous(), 0.125)
        assert torch.equal(alone[0], together[i])
    h, weight = torch.randn(8, 576, dtype=dtype), torch.rand(576)
    x = torch.randn(8, 2 * 1536, dtype=dtype)
    normed, act = torch.empty_like(h), torch.empty(8, 1536, dtype=dtype)
    ops.add_rms_norm(h.clone(), None, normed, weight, 1e-5)
    ops.silu_mul(x, act)
    for i in (0, 5):
        one, one_act = torch.empty_like(h[:1]), torch.empty_like(act[:1])
        ops.add_rms_norm(h[i : i + 1].clone(), None, one, weight, 1e-5)
        ops.silu_mul(x[i : i + 1].contiguous(), one_act)
        assert torch.equal(one[0], normed[i]) and torch.equal(one_act[0], act[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_gives_the_same_bits_on_one_thread_and_on_several(dtype):
    """The rows of a big step are split over threads; each is still computed whole, in order."""
    ops = ops_for(dtype)
    lens = [33, 5, 120, 77, 2, 64, 9, 100] * 4
    q, cache, ctx, lens_t = _attention_case(dtype, lens, seed=4)
    torch.manual_seed(5)
    h, delta, weight = torch.randn(64, 576, dtype=dtype), torch.randn(64, 576, dtype=dtype), torch.rand(576)
    x = torch.randn(64, 2 * 1536, dtype=dtype)
    qkv, positions = torch.randn(64, (9 + 2 * 3) * 64, dtype=dtype), torch.randint(0, 200, (64,))
    cos, sin = torch.rand(200, 64), torch.rand(200, 64)
    results = []
    for threads in (1, 2, 3):
        ops.set_threads(threads)
        try:
            attn = torch.empty_like(q)
            ops.paged_attention(q, cache, attn, torch.arange(len(lens)), None, lens_t, ctx, 0.125)
            hh, normed, act = h.clone(), torch.empty_like(h), torch.empty(64, 1536, dtype=dtype)
            ops.add_rms_norm(hh, delta, normed, weight, 1e-5)
            ops.silu_mul(x, act)
            q_out, kv = torch.empty(64, 9, 64, dtype=dtype), torch.zeros(2, 3, 64, 64, dtype=dtype)
            ops.rope_store_kv(qkv, positions, cos, sin, 9, 3, q_out, kv, torch.randperm(64))
        finally:
            ops.set_threads(1)
        results.append((attn, hh, normed, act, q_out))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_the_kernels_share_torchs_openmp_runtime():
    """Two OpenMP runtimes in one process would each keep a spinning thread team."""
    ops_for(torch.float32)
    if not Path("/proc/self/maps").exists():
        pytest.skip("no /proc")
    assert len(cpu_ops.openmp_runtimes()) == 1, cpu_ops.openmp_runtimes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    ops = ops_for(dtype)
    torch.manual_seed(1)
    x = torch.randn(3, 2 * 100, dtype=dtype) * 6  # into exp's tails on both sides
    x[0, 0], x[0, 1], x[0, 100] = -120.0, 95.0, 2.0
    out = torch.empty(3, 100, dtype=dtype)
    ops.silu_mul(x, out)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(out, (F.silu(gate) * up).to(dtype), **TOL[dtype])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_stays_nan_through_silu_mul(dtype):
    """exp's clamps are compares, not fminf/fmaxf, which would turn a NaN into exp(-87)."""
    x = torch.ones(2, 2 * 40, dtype=dtype)
    x[0, 3] = float("nan")
    out = torch.empty(2, 40, dtype=dtype)
    ops_for(dtype).silu_mul(x, out)
    assert out[0, 3].isnan() and not out[0, :3].isnan().any() and not out[1].isnan().any()


def test_a_failing_build_means_the_torch_path_and_leaves_no_file(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_ops, "SOURCES", [bad])
    monkeypatch.setenv("MINDIE_TRITON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ops, "_library", None)
    if cpu_cores.c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_ops.build_library() is None
    assert cpu_ops.load(torch.float32) is None
    assert not list((tmp_path / "cache" / "kernels").iterdir())


def test_the_library_is_built_once_and_then_reused(monkeypatch, tmp_path):
    if cpu_cores.c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("MINDIE_TRITON_CACHE", str(tmp_path))
    first = cpu_ops.build_library()
    stamp = first.stat().st_mtime_ns
    assert cpu_ops.build_library() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


def test_a_failed_openmp_build_is_tried_again_not_replaced_for_good(monkeypatch, tmp_path):
    """Without OpenMP the single-threaded build serves, under a key of its own: once OpenMP
    builds again (a passing fault, a compiler that gained it), the next load gets it."""
    if cpu_cores.c_compiler() is None:
        pytest.skip("no C compiler on this machine")
    tiny = tmp_path / "tiny.c"
    tiny.write_text("int cpu_ops_abi_version(void) { return 0; }\n")
    monkeypatch.setattr(cpu_ops, "SOURCES", [tiny])
    monkeypatch.setattr(cpu_ops, "HEADERS", [])
    monkeypatch.setenv("MINDIE_TRITON_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_ops, "OPENMP", "-fno-such-option-here")
    single = cpu_ops.build_library()
    assert single is not None and single.is_file()
    assert cpu_ops.build_library() == single  # cached: no new file
    monkeypatch.setattr(cpu_ops, "OPENMP", "-fopenmp")
    threaded = cpu_ops.build_library()
    assert threaded is not None and threaded != single
    assert sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir()) == sorted([single.name, threaded.name])


def test_float16_and_other_architectures_keep_the_torch_path():
    assert cpu_ops.load(torch.float16) is None


@pytest.mark.parametrize("n_out, k", [(96, 64), (100, 77), (3, 5), (1536, 576)])
def test_linear_row_matches_f_linear_with_and_without_bias(n_out, k):
    ops = ops_for(torch.float32)
    torch.manual_seed(5)
    w, b, x = torch.randn(n_out, k), torch.randn(n_out), torch.randn(1, k)
    ops.set_threads(2)
    try:
        torch.testing.assert_close(ops.linear_row(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ops.linear_row(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        strided = torch.randn(k, 3)[:, 1][None]
        assert torch.equal(ops.linear_row(strided, w, b), ops.linear_row(strided.contiguous(), w, b))
    finally:
        ops.set_threads(1)


def test_linear_row_gives_the_same_bits_on_one_thread_and_on_several():
    ops = ops_for(torch.float32)
    torch.manual_seed(6)
    w, x = torch.randn(3072, 576), torch.randn(1, 576)
    results = []
    for threads in (1, 2, 3):
        ops.set_threads(threads)
        results.append(ops.linear_row(x, w, None))
    ops.set_threads(1)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_bfloat16_kernels_have_no_linear_row():
    assert not ops_for(torch.bfloat16).has_linear_row and ops_for(torch.float32).has_linear_row


def _other_thread_ran_inside(call) -> bool:
    """Did another Python thread run in the middle of ``call()`` (so the call let go of the GIL)?"""
    import threading
    import time

    stamps, stop, started = [], threading.Event(), threading.Event()

    def count():
        started.set()
        while not stop.is_set():
            stamps.append(time.perf_counter())
            for _ in range(1000):
                pass

    t = threading.Thread(target=count)
    t.start()
    started.wait()
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    t.join()
    margin = (t1 - t0) * 0.25
    return any(t0 + margin < stamp < t1 - margin for stamp in stamps)


def test_paged_attention_lets_go_of_the_gil_and_the_short_kernels_keep_it():
    """The stub's sender thread builds responses while the engine is in a long kernel."""
    ops = ops_for(torch.float32)
    lens = [4000] * 24
    q, cache, ctx, lens_t = _attention_case(torch.float32, lens, slots_n=4096)
    out = torch.zeros_like(q)
    rows = torch.arange(len(lens))
    assert _other_thread_ran_inside(lambda: ops.paged_attention(q, cache, out, rows, None, lens_t, ctx, 0.125))
    h, normed, weight = torch.randn(8192, 4096), torch.empty(8192, 4096), torch.ones(4096)
    assert not _other_thread_ran_inside(lambda: ops.add_rms_norm(h, None, normed, weight, 1e-5))
