"""The runner's Linears: one matmul for q/k/v and one for gate/up per layer, each projection
on the best kernel its weight fits.

At small batch each matmul call costs more in overhead than in arithmetic, so fusing them
is most of the single-stream speed. Every projection becomes a :func:`~.linear.make_linear`
(prepacked where the device gains from it), or, where the model came from a GGUF whose
layer Linears are Q4_1 and the runner can use them, in bfloat16 a
:class:`~.linear.PackedQ4Linear` on the file's own blocks, and the lm_head a
:class:`~.linear.PackedQ8Linear` on its Q8_0 blocks; in float32 an
:class:`~.linear.Fp32Linear` that also holds the Q4_1 blocks (the lm_head its Q8_0 blocks)
for single rows, where :func:`~.linear.choose_fp32_kernels` finds them faster
(``ModelConfig.cpuLinearWeights``; :mod:`.gguf_blocks`). The original modules are dropped, so the weights are held once (plus
those blocks); the tied embedding stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import gguf_blocks
from .linear import (
    Fp32Linear,
    Linear,
    PackedBf16Linear,
    PackedQ4Linear,
    PackedQ8Linear,
    choose_fp32_kernels,
    make_linear,
    packed_invariant,
)

log = logging.getLogger(__name__)


@dataclass
class Projections:
    qkv: list[Linear]
    o_proj: list[Linear]
    gate_up: list[Linear]
    down: list[Linear]
    lm_head: Linear
    intermediate: int  # the MLP's width (gate and up are twice that together)
    weight_bytes_per_token: int  # every projection and the lm_head in the form its kernel reads


def build_projections(model, ops, dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int,
                      q4_source: Path | None = None, q4_required: bool = False) -> Projections:
    """The fused projections of ``model``'s decoder layers and its lm_head; deletes the layers'
    projection modules. ``q4_source``: the GGUF the model was converted from, whose Q4_1 blocks
    are used where ``ops`` can; ``q4_required``: warn where they can't (``gguf``, not ``auto``)."""
    layers = list(model.model.layers)
    gguf = _usable_gguf(q4_source, q4_required, ops, dtype, device)
    q4 = gguf_blocks.read_projections(gguf, len(layers), num_heads, num_kv_heads, q4_required) if gguf else None
    head_blocks = gguf_blocks.read_lm_head(gguf) if q4 and ops.has_linear_q8 else None
    del gguf  # the blocks are copies; the file's mapping can go
    size = torch.empty(0, dtype=dtype).element_size()
    weight_bytes = 0

    def projection(weight: torch.Tensor, bias: torch.Tensor | None, blocks, kind: str = "q4") -> Linear:
        """On ``blocks`` (Q4_1; in float32 ``kind`` "q8": Q8_0) where given, the kernel fits the
        shape and they decode to exactly ``weight``; else :func:`make_linear`."""
        nonlocal weight_bytes
        if blocks is not None and dtype == torch.float32:  # dense, and blocks for single rows
            weight_bytes += weight.numel() * size
            return _fp32_projection(weight, bias, blocks, kind, ops)
        if blocks is not None and ops.q4_fits(*weight.shape):
            if gguf_blocks.decodes_to(blocks, weight, ops):
                linear = PackedQ4Linear(torch.from_numpy(blocks), *weight.shape, bias, ops)
                if packed_invariant(linear, tuple(weight.shape)):
                    weight_bytes += linear.packed.numel()
                    return linear
            else:
                log.warning("cpuLinearWeights: a %dx%d projection's Q4_1 blocks do not decode to the loaded "
                            "weight; it keeps the dense weight", *weight.shape)
        weight_bytes += weight.numel() * size
        return make_linear(weight, bias, ops)

    qkv, o_proj, gate_up, down = [], [], [], []
    intermediate = layers[0].mlp.gate_proj.weight.shape[0]
    for i, layer in enumerate(layers):
        a, m = layer.self_attn, layer.mlp
        blocks = q4[i] if q4 else dict.fromkeys(gguf_blocks.PROJECTIONS)
        b = None
        if a.q_proj.bias is not None:
            b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        qkv.append(projection(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), b, blocks["qkv"]))
        o_proj.append(projection(a.o_proj.weight, a.o_proj.bias, blocks["o"]))
        gate_up.append(projection(torch.cat([m.gate_proj.weight, m.up_proj.weight]), None, blocks["gate_up"]))
        down.append(projection(m.down_proj.weight, m.down_proj.bias, blocks["down"]))
        del a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj
    head = model.lm_head
    lm_head = _q8_head(head, head_blocks, ops)
    if lm_head is None:
        lm_head = projection(head.weight, head.bias, head_blocks if dtype == torch.float32 else None, "q8")
    else:
        weight_bytes += lm_head.bytes_per_row
    linears = [*qkv, *o_proj, *gate_up, *down, lm_head]
    choose_fp32_kernels(linears, ops)
    fp32 = [lin for lin in linears if isinstance(lin, Fp32Linear)]
    weight_bytes -= sum(lin.shape[0] * lin.shape[1] * 4 - lin.one_row_bytes() for lin in fp32)  # blocks chosen
    if packed := sum(isinstance(lin, PackedBf16Linear | PackedQ8Linear) for lin in linears):
        extra = head.weight.numel() * 2 / 2**20 if isinstance(lm_head, PackedBf16Linear | PackedQ8Linear) else 0.0
        log.info("bfloat16 matmuls on the fused %s kernel: %d of %d (the lm_head's weight stays beside its "
                 "packed copy: %.0f MiB more)", ops.bf16_kernel, packed, len(linears), extra)
    if q4 and dtype == torch.float32:
        for kind, what in (("q4", "decoder Linears on GGUF Q4_1"), ("q8", "the lm_head on GGUF Q8_0")):
            rows = [lin for lin in fp32 if lin.block_kind == kind]
            log.info("%s blocks for single rows (cpuLinearWeights): %d of %d, %.0f MiB beside the dense weights "
                     "for batches%s", what, len(rows), len(linears), sum(lin.blocks.numel() for lin in rows) / 2**20,
                     "" if rows else " (none held, or the dense kernels were faster here)")
    if q4s := [lin for lin in linears if isinstance(lin, PackedQ4Linear)]:
        log.info("decoder Linears on GGUF Q4_1 blocks (cpuLinearWeights): %d of %d, %.0f MiB", len(q4s),
                 len(linears), sum(lin.packed.numel() for lin in q4s) / 2**20)
    if isinstance(lm_head, PackedQ8Linear):
        log.info("lm_head on GGUF Q8_0 blocks (cpuLinearWeights) for steps of up to %d rows: %.0f MiB read "
                 "against %.0f, held beside the packed bfloat16 weight", lm_head.NARROW_ROWS,
                 lm_head.bytes_per_row / 2**20, head.weight.numel() * 2 / 2**20)
    return Projections(qkv, o_proj, gate_up, down, lm_head, intermediate, weight_bytes)


def _fp32_projection(weight: torch.Tensor, bias: torch.Tensor | None, blocks, kind: str, ops) -> Linear:
    """A float32 projection that also holds its ``kind`` ("q4": Q4_1, "q8": Q8_0) ``blocks`` (for
    single rows, should :func:`choose_fp32_kernels` pick them) where they decode to exactly ``weight``."""
    linear = make_linear(weight, bias, ops)
    has_kernel = ops.has_linear_q4 if kind == "q4" else ops.has_linear_q8
    if (not isinstance(linear, Fp32Linear) or linear.packed is None or not has_kernel
            or not ops.q4_fits(*weight.shape)):
        return linear  # no prepacked kernel for batches: choose_fp32_kernels leaves it plain
    if gguf_blocks.decodes_to(blocks, weight, ops, {"q4": "q4_1", "q8": "q8_0"}[kind]):
        linear.add_blocks(kind, torch.from_numpy(blocks), ops)
    else:
        log.warning("cpuLinearWeights: a %dx%d projection's %s blocks do not decode to the loaded weight; it "
                    "keeps the dense weight", *weight.shape, {"q4": "Q4_1", "q8": "Q8_0"}[kind])
    return linear


def _q8_head(head: torch.nn.Linear, blocks, ops) -> PackedQ8Linear | None:
    """The lm_head on its GGUF Q8_0 ``blocks`` where they decode to exactly its weight and the
    bfloat16 kernel is the one whose bits the Q8 kernel reproduces (AVX512-BF16, not AMX)."""
    if blocks is None or ops.bf16_kernel != "avx512_bf16" or not ops.bf16_fits(head.weight):
        return None
    if not ops.q8_fits(*head.weight.shape):
        return None
    if not gguf_blocks.decodes_to(blocks, head.weight, ops, "q8_0"):
        log.warning("cpuLinearWeights: the lm_head's Q8_0 blocks do not decode to the loaded weight; it keeps "
                    "the dense weight")
        return None
    linear = PackedQ8Linear(torch.from_numpy(blocks), head.weight, head.bias, ops)
    return linear if packed_invariant(linear, tuple(head.weight.shape)) else None


def _usable_gguf(source: Path | None, required: bool, ops, dtype: torch.dtype, device: torch.device
                 ) -> gguf_blocks.GgufFile | None:
    """``source``, opened once, where these kernels can use its blocks."""
    if source is None:
        return None
    if ops is None or not ops.has_linear_q4:
        (log.warning if required else log.debug)(
            "cpuLinearWeights gguf needs the fused CPU kernels, in bfloat16 on a CPU with AVX512-BF16 or in "
            "float32 on one with AVX2, FMA and F16C (here: device %s, dtype %s, its Q4_1 kernel %s); dense weights "
            "are used", device.type, str(dtype).removeprefix("torch."), "not built" if ops else "absent")
        return None
    if not required and ops.bf16_kernel == "amx":
        log.info("cpuLinearWeights auto: dense weights on this AMX CPU (the Q4_1 kernel was measured against "
                 "the AVX512-BF16 kernel only; gguf uses it)")
        return None
    return gguf_blocks.open_gguf(source)
