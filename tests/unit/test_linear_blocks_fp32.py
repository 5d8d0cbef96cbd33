"""The float32 one-row Linears on a GGUF's own blocks (``ModelConfig.cpuLinearWeights``): the
layers' Q4_1 (``csrc/linear_q4_avx2.c``) and the lm_head's Q8_0 (``csrc/linear_q8_avx2.c``).
Each gives the dense product up to float32 rounding, dequantises exactly as gguf-py does and
gives a row the same bits on any thread count; :class:`~llm_engine.linear.Fp32Linear` holds
them beside the prepacked weight for batches and :func:`~llm_engine.linear.choose_fp32_kernels`
picks them per group where they win; the engine answers as the dense one. The kernels need
AVX2 with FMA and F16C; elsewhere these tests are skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llm_engine import cpu_ops, linear
from llm_engine.linear import Fp32Linear, make_linear

from tests.unit import test_linear_q4, test_linear_q8
from tests.unit.engine_harness import Run, build

# kind: the test module with its random blocks and gguf-py's dequantisation, packed bytes per weight
KINDS = {"q4": (test_linear_q4, 5 / 8), "q8": (test_linear_q8, 17 / 16)}
SHAPES = [(576, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (16, 32), (48, 96), (80, 64)]


def _row_ops(kind: str = "q4"):
    ops = cpu_ops.load(torch.float32)
    if ops is None:
        pytest.skip("no C compiler on this machine")
    if not getattr(ops, f"has_linear_{kind}"):
        pytest.skip("this CPU has no AVX2 with FMA and F16C")
    return ops


def _blocks(kind: str, n: int, k: int, seed: int):
    return KINDS[kind][0]._blocks(n, k, seed)


def _dequantized(kind: str, blocks) -> torch.Tensor:
    return KINDS[kind][0]._dequantized(blocks)


def _pack(ops, kind: str, blocks, n: int, k: int) -> torch.Tensor:
    return getattr(ops, f"{kind}_pack")(torch.from_numpy(blocks), n, k)


def _close_to_dense(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding: within 1e-5 of the row's largest output."""
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got - want).abs() <= scale * 1e-5).all(), ((got - want).abs() / scale).max()


@pytest.mark.parametrize("kind, n, k", [(kind, n, k) for kind in KINDS for n, k in SHAPES] + [("q8", 49152, 576)])
def test_the_row_kernel_matches_f_linear_on_the_dequantized_weight_with_and_without_bias(kind, n, k):
    """(49152, 576): SmolLM2's lm_head; 80 outputs: 10 groups of 8, whole panels and a short one."""
    ops = _row_ops(kind)
    ops.set_threads(torch.get_num_threads())
    blocks = _blocks(kind, n, k, seed=n + k)
    w, bias = _dequantized(kind, blocks), torch.randn(n)
    packed = _pack(ops, kind, blocks, n, k)
    assert packed.numel() == blocks.size == n * k * KINDS[kind][1]  # the blocks' own bytes
    for seed in range(2):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
        _close_to_dense(ops.linear_row_blocks(kind, x, packed, n, None), F.linear(x, w))
        _close_to_dense(ops.linear_row_blocks(kind, x, packed, n, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantizing_in_float32_gives_the_bits_of_gguf_py(kind):
    ops = _row_ops(kind)
    blocks = _blocks(kind, 64, 1536, seed=3)
    got = getattr(ops, f"{kind}_dequantize")(torch.from_numpy(blocks), 64, 1536)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), _dequantized(kind, blocks).view(torch.int32))


@pytest.mark.parametrize("kind, n", [("q4", 3072), ("q8", 49152)])
def test_a_row_has_the_same_bits_on_one_thread_and_on_several(kind, n):
    ops = _row_ops(kind)
    packed, x = _pack(ops, kind, _blocks(kind, n, 576, seed=1), n, 576), torch.randn(1, 576)
    try:
        ops.set_threads(1)
        one = ops.linear_row_blocks(kind, x, packed, n, None)
        ops.set_threads(max(2, torch.get_num_threads()))
        assert torch.equal(ops.linear_row_blocks(kind, x, packed, n, None), one)
    finally:
        ops.set_threads(torch.get_num_threads())


def _block_linear(kind: str, n: int, k: int, seed: int, ops) -> tuple[Fp32Linear, torch.Tensor, torch.Tensor]:
    blocks = _blocks(kind, n, k, seed)
    w, b = _dequantized(kind, blocks), torch.randn(n)
    lin = make_linear(w, b, ops)
    if not isinstance(lin, Fp32Linear) or lin.packed is None:
        pytest.skip("no oneDNN prepacking in this torch build")
    lin.add_blocks(kind, torch.from_numpy(blocks), ops)
    return lin, w, b


@pytest.mark.parametrize("kind, other_kind", [("q4", "q8"), ("q8", "q4")])
def test_an_fp32_linear_on_blocks_serves_single_rows_from_them_and_batches_prepacked(kind, other_kind):
    ops = _row_ops(kind)
    lin, w, b = _block_linear(kind, 96, 64, seed=5, ops=ops)
    lin.use("prepacked", kind)
    assert lin.weight is None and lin.blocks is not None and lin.packed is not None  # no dense copy left
    assert lin.one_row_bytes() == lin.second_form_bytes() == 96 * 64 * KINDS[kind][1]
    for rows in (1, 2, 17):
        x = torch.randn(rows, 64)
        _close_to_dense(lin(x), F.linear(x, w, b))
    other, _, _ = _block_linear(kind, 96, 64, seed=5, ops=ops)
    other.use("prepacked", "fused")
    assert other.blocks is None and other.weight is not None  # blocks no kernel reads are dropped
    another, _, _ = _block_linear(kind, 96, 64, seed=5, ops=ops)
    another.use("prepacked", other_kind)  # another kind's blocks: fused on the dense weight, these dropped
    assert another.kinds == ("prepacked", "fused") and another.blocks is None and another.weight is not None


def _timed_by(monkeypatch, cost) -> None:
    """Fake timings for choose_fp32_kernels: its clock advances by ``cost(linear, kind, rows)``
    at each call of a kernel, which still runs."""
    clock = {"t": 0.0}
    real = {k: getattr(Fp32Linear, k) for k in Fp32Linear.KINDS}

    def costed(kind):
        def kernel(self, x):
            clock["t"] += cost(self, kind, x.shape[0])
            return real[kind](self, x)

        kernel.__name__ = kind
        return kernel

    monkeypatch.setattr(linear.time, "perf_counter", lambda: clock["t"])
    for kind in real:
        monkeypatch.setattr(Fp32Linear, kind, costed(kind))


@pytest.mark.parametrize("q4_cost, expect", [(0.5, "q4"), (1.45, "prepacked")])
def test_choose_fp32_kernels_takes_the_q4_blocks_for_single_rows_only_where_they_win(
    monkeypatch, q4_cost, expect
):
    """The blocks are a second weight form beside the prepacked one: they must win by
    FP32_GAIN. A Linear without blocks is timed and chosen for apart (here prepacked: the
    fused kernel does not win by FP32_GAIN)."""
    ops = _row_ops("q4")
    costs = {
        ("plain", 8): 2.0,
        ("prepacked", 8): 1.0,
        ("plain", 1): 2.0,
        ("prepacked", 1): 1.5,
        ("fused", 1): 1.6,
        ("q4", 1): q4_cost,
    }
    # "q4" without blocks runs (and costs) "fused"
    _timed_by(monkeypatch, lambda lin, kind, rows: 0.0 if kind == "q4" and lin.blocks is None else costs[kind, rows])
    layers = [_block_linear("q4", 64, 64, seed=s, ops=ops)[0] for s in range(3)]
    head = make_linear(torch.randn(128, 64), None, ops)
    linear.choose_fp32_kernels([*layers, head], ops, batch_rows=8)
    for lin in layers:
        assert lin.kinds == ("prepacked", expect)
        assert (lin.blocks is not None) == (expect == "q4") and lin.weight is None
    assert head.kinds == ("prepacked", "prepacked") and head.blocks is None


@pytest.mark.parametrize("q8_cost, expect", [(0.5, "q8"), (1.45, "prepacked")])
def test_choose_fp32_kernels_times_the_q8_head_apart_from_the_q4_layers(monkeypatch, q8_cost, expect):
    """Each group of Linears holding the same blocks gets its own single-row kernel: the Q4_1
    layers theirs, the Q8_0 head the Q8 kernel only where it beats prepacked by FP32_GAIN."""
    ops = _row_ops("q8")
    if not ops.has_linear_q4:
        pytest.skip("no float32 Q4_1 kernel")
    costs = {"plain": 2.0, "prepacked": 1.5, "fused": 1.6, "q4": 0.5, "q8": q8_cost}
    _timed_by(monkeypatch, lambda lin, kind, rows: 1.0 if rows > 1 and kind == "prepacked" else costs[kind])
    layers = [_block_linear("q4", 64, 64, seed=s, ops=ops)[0] for s in range(3)]
    head, w, _ = _block_linear("q8", 128, 64, seed=9, ops=ops)
    linear.choose_fp32_kernels([*layers, head], ops, batch_rows=8)
    assert all(lin.kinds == ("prepacked", "q4") for lin in layers)
    assert head.kinds == ("prepacked", expect) and (head.blocks is not None) == (expect == "q8")


def test_a_float32_engine_reads_the_gguf_q4_blocks_for_single_rows_and_answers_like_the_dense_one():
    """Each projection holds the blocks exactly where single rows are chosen to read them
    (timed at load); greedy text is the dense engine's."""
    _row_ops("q4")
    q4 = build(dtype="float32", linear_weights="gguf", kvCacheMemoryMiB=64)
    try:
        runner = q4.runner
        projections = [*runner.qkv, *runner.o_proj, *runner.gate_up, *runner.down]
        assert len(projections) == 120 and all(isinstance(lin, Fp32Linear) for lin in projections)
        on_q4 = [lin.kinds[1] == "q4" for lin in projections]
        assert all(on_q4) or not any(on_q4)
        assert all((lin.blocks is not None) == q for lin, q in zip(projections, on_q4))
        head = runner.lm_head  # its Q8_0 blocks likewise (csrc/linear_q8_avx2.c; above)
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
