"""Linear layers with the fastest kernel the device offers, behind one small interface.

Speed. On CPU in bfloat16, oneDNN reorders a plain weight into its blocked layout on
every call. Reordering once at load (``mkldnn._reorder_linear_weight``) and calling
``mkldnn._linear_pointwise`` gives the same numbers 1.3-2x faster (measured on a
2-core EPYC over the 120 layer matmuls of SmolLM2-135M: 23.3 -> 12.4 ms at 1 row,
37.4 -> 29.5 ms at 32 rows). Everywhere else ``F.linear`` is used as it is.

Batch invariance. A seeded request must sample the same text whatever else shares its
step, so a row's result must not depend on how many rows the matmul has. oneDNN's bf16
kernels keep that for short reductions, but for SmolLM2's down projection (K = 1536)
a single row took another path than 2 or more rows and differed in the last bit for a
few rows in a hundred (2 to 512 rows all agreed), and bf16 rounding turns such one-ulp
differences into different tokens. So each reduced-precision weight shape is probed
once at load and gets the first of these that is batch-invariant: the kernel as it is;
the kernel with a single row padded to two (free at one row, which is memory-bound);
the reduction split along K into chunks, summed in float32 in a fixed order (the
split down projection cost ~4 ms of a ~75 ms step at 32 rows). float32 kernels differ
between batch sizes too (MKL), but only in the last bits of float32, which rarely
changes a sampled token; they are used as they are.

bfloat16 on CPUs with AMX or AVX512-BF16. The fused kernels' bfloat16 Linear
(:class:`PackedBf16Linear`) is batch-invariant by construction and replaces all of the
above for the shapes it fits. On AMX tiles, over SmolLM2's 121 matmuls on a 2-core Sapphire
Rapids, it took 15.7 against 33.8 ms at one row and 21.6 against 58.6 ms at 32 rows (there
oneDNN's bf16 kernels also change their blocking with the row count, so the probe's choice
held for its data but not for all). On AVX512-BF16 without AMX, on a 2-core AMD EPYC, it
took 8.7 against 13.4 ms at one row (31 GB/s of weights, against 20 for oneDNN), 10.2
against 14.0 at 8 rows and 25.4 against 27.9 at 32 rows (~340 GFLOP/s).

GGUF Q4_1 blocks (``ModelConfig.cpuLinearWeights``, :class:`PackedQ4Linear`). Where the
model is a GGUF whose layer Linears are Q4_1 (the embedded SmolLM2 is), the decoder
Linears can read those blocks, 0.625 bytes a weight, instead of the dequantised bfloat16
weights (``csrc/linear_q4.c``, on AVX512-BF16; :mod:`.gguf_blocks` maps and checks the
blocks). Batch-invariant by construction too, with other last bits than the bfloat16
kernel (a scale per block of 32, applied in float32). The lm_head likewise reads the
GGUF's Q8_0 blocks (:class:`PackedQ8Linear`, ``csrc/linear_q8.c``), 1.0625 bytes a weight
for one or two rows.

float32 on CPU. Whether oneDNN's prepacked kernel beats ``F.linear`` (MKL) depends on the
CPU: on a 2-core AVX2 EPYC (no AVX-512) 120 layer matmuls at 8 rows took 71 ms prepacked
against 120 ms, at 32 rows 217 against 272, but at one row 45 against 35. So the runner
times the model's float32 matmuls once at load (:func:`choose_fp32_kernels`): the
prepacked kernel serves batches where it is faster, and single rows get the fastest of
the two and the fused kernels' one-row Linear (``cpu_ops``), which reads the weights at
nearly the machine's bandwidth where torch's kernels reach about half of it at one row.

GGUF blocks in float32 (AVX2, FMA and F16C; ``csrc/linear_q4_avx2.c``, ``csrc/linear_q8_avx2.c``).
Single rows can also read a GGUF's own blocks: the layers' Q4_1 (0.625 bytes a weight against 4)
and the lm_head's Q8_0 (1.0625), timed by :func:`choose_fp32_kernels` for each group of Linears
holding the same blocks; a second weight form beside the prepacked one, they must win by
:data:`FP32_GAIN`. Their sums go block by block, so their last bits differ from the dense kernels'
(as those differ from each other). On a 2-core AVX2 EPYC (best of 30-40, other processes running),
SmolLM2-135M's 120 layer matmuls at one row took 6.9-8.2 against 17.7 ms on the dense fused kernel
(10 GB/s of blocks against its 24: widening codes to floats is half of it), the lm_head 1.6 against 4.7.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Linear = Callable[[torch.Tensor], torch.Tensor]
PROBE_ROWS = 64
PAD_ONE_ROW = 0  # in _strategy_for_shape: pad single rows to two, no K split
_strategy_for_shape: dict[tuple, int] = {}  # (N, K, dtype, device type) -> K chunks, or PAD_ONE_ROW
FP32_GAIN = 1.1  # a float32 kernel is chosen over the other only when this much faster


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, ops=None) -> Linear:
    """``x -> x @ weight.T + bias`` for 2-D ``x``: prepacked where that helps, batch-invariant
    on CPU at reduced precision. ``ops`` (:class:`~llm_engine.cpu_ops.CpuOps`) offers the fused
    kernels' bfloat16 Linear (AMX or AVX512-BF16), used for the shapes it fits and passes the probe."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if weight.device.type != "cpu":
        return _kernel(weight, bias)
    if weight.dtype == torch.float32:
        return Fp32Linear(weight, bias)
    if ops is not None and ops.bf16_fits(weight):
        packed = PackedBf16Linear(weight, bias, ops)
        if packed_invariant(packed, tuple(weight.shape)):
            return packed
    key = (*weight.shape, weight.dtype, weight.device.type)
    if key not in _strategy_for_shape:
        _strategy_for_shape[key] = _invariant_strategy(weight)
    return _build(weight, bias, _strategy_for_shape[key])


def _build(weight: torch.Tensor, bias: torch.Tensor | None, strategy: int) -> Linear:
    if strategy == 1:
        return _kernel(weight, bias)
    if strategy == PAD_ONE_ROW:
        return _padded(_kernel(weight, bias))
    return _chunked(weight, bias, strategy)


def _kernel(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    if packing_supported(weight.device, weight.dtype):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        except RuntimeError as exc:  # an oneDNN build without the op: plain matmul
            log.warning("weight prepacking unavailable (%s); using plain linear", exc)
    return lambda x: F.linear(x, weight, bias)


class PackedBf16Linear:
    """bfloat16 on CPUs with AMX or AVX512-BF16: the fused kernels' Linear
    (``csrc/linear_amx.c``, ``csrc/linear_avx512bf16.c``), which is batch-invariant as it is,
    so no shape needs oneDNN's padded or K-split forms. Holds only the packed weight (the
    same size as the weight)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops):
        self.ops = ops
        self.packed = ops.bf16_pack(weight)
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_bf16(x, self.packed, self.bias)


class PackedQ4Linear:
    """GGUF Q4_1 weights on the fused kernels' Q4 Linear (``csrc/linear_q4.c``, AVX512-BF16;
    ``ModelConfig.cpuLinearWeights``), batch-invariant as it is. Holds only the packed blocks,
    0.625 bytes a weight. SmolLM2-135M's 120 layer matmuls on a 2-core AMD EPYC, against the
    bfloat16 kernel (best of four, ms, with float32 scales in the record): 4.4-4.7 against
    8.0-8.3 at one row, 7.0 / 8.1 at 8, 22.5 / 22.5 at 32, 159 / 145 at 256 rows. The file's
    float16 scales: 3.4 against 3.9-4.7 at one row, the same at 32, with the same bits."""

    def __init__(self, blocks: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, ops):
        self.ops = ops
        self.n = n
        self.packed = ops.q4_pack(blocks, n, k)
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_q4(x, self.packed, self.n, self.bias)


class PackedQ8Linear:
    """The lm_head of a GGUF whose head is Q8_0 (``ModelConfig.cpuLinearWeights``): calls of up
    to :attr:`NARROW_ROWS` rows read the Q8_0 codes (``csrc/linear_q8.c``, 1.0625 bytes a weight
    against 2), more rows the AVX512-BF16 kernel's packed bfloat16 weight. The Q8 kernel gives
    that kernel's bits on the dequantised weight, so a row's bits do not depend on which served
    it. It rebuilds each weight from its code (seven vector instructions per 32), so it only pays
    where a call waits on memory: SmolLM2-135M's lm_head (49152 x 576) on a 2-core AMD EPYC,
    alone, best of 14, took 1.05 against 1.47 ms at one row, 1.36 against 1.57 at two and 1.49
    against 1.62 at four; inside decode steps (two engines in one process, steps alternating,
    60 each, p50) 1.07-1.13 against 1.25-1.65 ms at one row (steps 1.03-1.12x faster), at two
    1.38-1.40 against 1.46-1.73 (0.99-1.08x), and no faster at three or four."""

    NARROW_ROWS = 2

    def __init__(self, blocks: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ops):
        self.ops = ops
        self.n, k = weight.shape
        self.codes = ops.q8_pack(blocks, self.n, k)
        self.dense = PackedBf16Linear(weight, bias, ops)
        self.bias = self.dense.bias
        self.bytes_per_row = self.codes.numel()  # what a one-token step reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.NARROW_ROWS:
            return self.dense(x)
        return self.ops.linear_q8(x, self.codes, self.n, self.bias)


_packed_checked: dict[tuple, bool] = {}  # (kernel, N, K) -> passed the batch-invariance probe


def packed_invariant(linear: PackedBf16Linear | PackedQ4Linear | PackedQ8Linear, weight_shape: tuple[int, int]
                     ) -> bool:
    """Probe a fused-kernel Linear once per kernel and shape (it is invariant by construction;
    this checks the machine). A shape that fails keeps a dense or oneDNN form, with a warning."""
    kernel = {PackedQ4Linear: "q4_1", PackedQ8Linear: "q8_0"}.get(type(linear), linear.ops.bf16_kernel)
    key = (kernel, *weight_shape)
    if key not in _packed_checked:
        _packed_checked[key] = is_batch_invariant(linear, weight_shape[1], torch.bfloat16, torch.device("cpu"))
        if not _packed_checked[key]:
            log.warning("linear %dx%d: the %s kernel was not batch-invariant here; another is used",
                        *key[1:], key[0])
    return _packed_checked[key]


class Fp32Linear:
    """float32 on CPU: ``F.linear``, oneDNN's prepacked kernel or, for single rows, the fused
    kernels' :meth:`~llm_engine.cpu_ops.CpuOps.linear_row`, on the dense weight or, where
    :meth:`add_blocks` gave it them, on the GGUF's Q4_1 or Q8_0 blocks, as
    :func:`choose_fp32_kernels` measured; plain until then."""

    KINDS = ("plain", "prepacked", "fused", "q4", "q8")
    BLOCK_KINDS = ("q4", "q8")  # one-row kernels on GGUF blocks: Q4_1, Q8_0
    FORMS = {"plain": "dense", "fused": "dense", "prepacked": "prepacked", "q4": "q4", "q8": "q8"}  # weight read

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.contiguous()
        self.shape = tuple(self.weight.shape)
        self.bias = None if bias is None else bias.contiguous()
        self.packed = None
        self.blocks = self.block_kind = None  # GGUF blocks ("q4" or "q8") as ops.linear_row_blocks reads them
        self.ops = None  # CpuOps with linear_row, for the "fused", "q4" and "q8" kinds
        self.kinds = ("plain", "plain")  # (for batches, for single rows)
        if torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            except RuntimeError as exc:
                log.info("float32 prepacking unavailable (%s)", exc)
        self.for_batches = self.for_one_row = self.plain

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def prepacked(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_row(x, self.weight, self.bias)

    def q4(self, x: torch.Tensor) -> torch.Tensor:  # on Q4_1 blocks; fused where it has none
        return self._on_blocks("q4", x)

    def q8(self, x: torch.Tensor) -> torch.Tensor:  # on Q8_0 blocks; fused where it has none
        return self._on_blocks("q8", x)

    def _on_blocks(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        if self.block_kind != kind:
            return self.fused(x)
        return self.ops.linear_row_blocks(kind, x, self.blocks, self.shape[0], self.bias)

    def add_blocks(self, kind: str, blocks: torch.Tensor, ops) -> None:
        """Hold this weight's GGUF blocks (checked by the caller to decode to it exactly) for the
        ``kind`` kernel: "q4", Q4_1 ``uint8 [N, K / 32 * 20]``, or "q8", Q8_0 ``[N, K / 32 * 34]``;
        ``ops``: float32, with ``has_linear_q4`` or ``has_linear_q8``."""
        self.ops = ops
        self.blocks = {"q4": ops.q4_pack, "q8": ops.q8_pack}[kind](blocks, *self.shape)
        self.block_kind = kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.for_one_row(x) if x.shape[0] == 1 else self.for_batches(x)

    def use(self, for_batches: str, for_one_row: str) -> None:
        """Set the kernels (:data:`KINDS`; "q4" and "q8" are "fused" without those blocks) and
        drop the weight forms neither uses."""
        if for_one_row in self.BLOCK_KINDS and self.block_kind != for_one_row:
            for_one_row = "fused"
        self.kinds = (for_batches, for_one_row)
        self.for_batches, self.for_one_row = getattr(self, for_batches), getattr(self, for_one_row)
        forms = {self.FORMS[for_batches], self.FORMS[for_one_row]}
        if "prepacked" not in forms:
            self.packed = None
        if self.block_kind not in forms:
            self.blocks = self.block_kind = None
        if "dense" not in forms:
            self.weight = None

    def one_row_bytes(self) -> int:
        """Bytes of weights a single row reads."""
        return self.blocks.numel() if self.kinds[1] in self.BLOCK_KINDS else self.shape[0] * self.shape[1] * 4

    def second_form_bytes(self) -> int:
        """Bytes of the weight form only single rows read (0 where batches read it too)."""
        batches, one_row = self.kinds
        return 0 if self.FORMS[batches] == self.FORMS[one_row] else self.one_row_bytes()


def choose_fp32_kernels(linears: list[Linear], ops=None, batch_rows: int = 16) -> None:
    """Time a model's float32 matmuls as a forward runs them (each weight read from memory
    once per pass): plain and prepacked at ``batch_rows`` rows, and those, ``ops``'s one-row
    kernel (when given) and, for Linears holding GGUF blocks, the one-row kernel on them at one
    row. Batches get the faster kernel over all; single rows the fastest for each group of
    Linears holding the same blocks (Q4_1, Q8_0 or none), timed together. One that needs a
    second form of the weights must win by :data:`FP32_GAIN`; that second copy is logged."""
    layers = [lin for lin in linears if isinstance(lin, Fp32Linear) and lin.packed is not None]
    if not layers:
        return
    fused = ops is not None and ops.has_linear_row
    if fused:
        ops.set_threads(torch.get_num_threads())
        for lin in layers:
            lin.ops = ops
    groups: dict[str | None, list[Fp32Linear]] = {}  # by the blocks each holds, in the model's order
    for lin in layers:
        groups.setdefault(lin.block_kind if fused else None, []).append(lin)
    best: dict[tuple[str, int, str | None], float] = {}
    with torch.inference_mode():
        for rows in (batch_rows, 1):
            xs = {group: [torch.randn(rows, lin.shape[1]) for lin in members] for group, members in groups.items()}
            for rnd in range(4):  # a warm round, then best of three, interleaved
                for group, members in groups.items():
                    one_row = ("fused", group) if group else ("fused",)  # groups other than None: fused
                    for kind in ("plain", "prepacked") + (one_row if rows == 1 and fused else ()):
                        t0 = time.perf_counter()
                        for lin, x in zip(members, xs[group]):
                            getattr(lin, kind)(x)
                        if rnd:
                            key = (kind, rows, group)
                            best[key] = min(best.get(key, float("inf")), time.perf_counter() - t0)
    batches = {kind: sum(best[kind, batch_rows, group] for group in groups) for kind in ("plain", "prepacked")}
    for_batches = "prepacked" if batches["plain"] > FP32_GAIN * batches["prepacked"] else "plain"
    chosen, parts = 0.0, []
    for group, members in groups.items():
        one_row = {kind: t for (kind, rows, g), t in best.items() if rows == 1 and g == group}
        for_one_row = _fastest(one_row, for_batches)
        for lin in members:
            lin.use(for_batches, for_one_row)
        chosen += one_row[for_one_row]
        timings = ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in sorted(one_row.items()))
        what = {None: "dense", "q4": "on Q4_1 blocks", "q8": "on Q8_0 blocks"}[group]
        parts.append(f"{len(members)} {what}: {timings} ms -> {for_one_row}")
    extra = sum(lin.second_form_bytes() for lin in layers) / 2**20
    log.info("float32 matmuls, %d of them: plain %.1f ms, prepacked %.1f ms at %d rows -> %s for batches; at 1 "
             "row, %s; %.1f ms as chosen%s", len(layers), batches["plain"] * 1e3, batches["prepacked"] * 1e3,
             batch_rows, for_batches, "; ".join(parts), chosen * 1e3,
             f" (a second weight form kept for single rows: {extra:.0f} MiB)" if extra else "")


def _fastest(one_row: dict[str, float], for_batches: str) -> str:
    """The fastest kind; one reading another weight form than ``for_batches`` must win by :data:`FP32_GAIN`."""
    same_form = [k for k in one_row if Fp32Linear.FORMS[k] == Fp32Linear.FORMS[for_batches]]
    other_form = [k for k in one_row if k not in same_form]
    fastest = min(same_form, key=one_row.get)
    rival = min(other_form, key=one_row.get) if other_form else None
    return rival if rival and FP32_GAIN * one_row[rival] < one_row[fastest] else fastest


def _padded(kernel: Linear) -> Linear:
    """``kernel`` with a single row computed as two (the row twice), as larger batches are."""
    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return kernel(x.expand(2, -1).contiguous())[:1]
        return kernel(x)

    return linear


def _chunked(weight: torch.Tensor, bias: torch.Tensor | None, chunks: int) -> Linear:
    """Split the reduction into ``chunks`` equal parts, each its own kernel, summed in float32."""
    k = weight.shape[1] // chunks
    parts = [(slice(i * k, (i + 1) * k), _kernel(weight[:, i * k : (i + 1) * k].contiguous(), None))
             for i in range(chunks)]
    fbias = None if bias is None else bias.float()

    def linear(x: torch.Tensor) -> torch.Tensor:
        acc = None
        for cols, part in parts:
            y = part(x[:, cols].contiguous()).float()
            acc = y if acc is None else acc.add_(y)
        if fbias is not None:
            acc.add_(fbias)
        return acc.to(x.dtype)

    return linear


def is_batch_invariant(linear: Linear, in_features: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Does each row come out bit-identical whether it is computed alone or among others?"""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(PROBE_ROWS, in_features, generator=gen).to(device=device, dtype=dtype)
    with torch.inference_mode():
        full = linear(x)
        for rows in (slice(0, 1), slice(0, 2), slice(0, 5), slice(7, 8), slice(3, 20), slice(31, 32),
                     slice(10, 43), slice(1, 64)):
            if not torch.equal(linear(x[rows]), full[rows]):
                return False
        return all(torch.equal(linear(x[i : i + 1]), full[i : i + 1]) for i in range(PROBE_ROWS))


def _invariant_strategy(weight: torch.Tensor) -> int:
    """The cheapest batch-invariant form for this shape: 1 (as it is), :data:`PAD_ONE_ROW`,
    or the fewest equal K-chunks (2, 4, ...)."""
    n, k = weight.shape
    dtype = str(weight.dtype).removeprefix("torch.")
    plain = _kernel(weight, None)
    if is_batch_invariant(plain, k, weight.dtype, weight.device):
        return 1
    if is_batch_invariant(_padded(plain), k, weight.dtype, weight.device):
        log.info("linear %dx%d (%s): single rows padded to two for batch-invariant results", n, k, dtype)
        return PAD_ONE_ROW
    chunks = 2
    while k % chunks == 0 and k // chunks >= 64:
        if is_batch_invariant(_chunked(weight, None, chunks), k, weight.dtype, weight.device):
            log.info("linear %dx%d (%s): split into %d K-chunks for batch-invariant results", n, k, dtype, chunks)
            return chunks
        chunks *= 2
    log.warning("linear %dx%d (%s): no batch-invariant form found; a seeded request's text may "
                "depend on what shares its batch", n, k, dtype)
    return 1
