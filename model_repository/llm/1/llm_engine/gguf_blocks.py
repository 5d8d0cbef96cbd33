"""A GGUF checkpoint's own quantised blocks: the decoder Linears' Q4_1 (``csrc/linear_q4.c``;
in float32 ``csrc/linear_q4_avx2.c``, for single rows) and the lm_head's Q8_0
(``csrc/linear_q8.c``; in float32 ``csrc/linear_q8_avx2.c``, for single rows).

The engine normally runs on the float weights transformers dequantises a GGUF into
(:mod:`.weights` caches them as an HF folder). With ``ModelConfig.cpuLinearWeights``
``gguf`` (or ``auto``, where it applies) the runner instead keeps, for every layer's q/k/v,
o, gate/up and down projections, the file's own Q4_1 blocks, in the order of its fused
projections, and for the lm_head the Q8_0 blocks of ``output.weight`` or, where the head is
tied, of ``token_embd.weight``. Reading 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight instead
of bfloat16's 2 is what a few streams wait on.

Each projection's and the head's blocks are checked at load: dequantised (and rounded to
bfloat16 where the model runs in it) they must equal, bit for bit, the weight the model loaded. That proves the tensor names, the
row order (llama.cpp permutes the rows of q and k for its rotary layout; transformers
undoes it) and the concatenation, for any model; a projection that fails keeps its
dense weight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

Q4_1_BLOCK_BYTES = 20  # per 32 weights: float16 d, float16 m, 16 bytes of 4-bit codes
Q8_0_BLOCK_BYTES = 34  # per 32 weights: float16 d, 32 int8 codes
_GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
               "up": "ffn_up", "down": "ffn_down"}
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the runner's fused projections


@dataclass
class GgufFile:
    """A GGUF's tensors by name, parsed once: gguf-py takes ~2 s to read SmolLM2's file."""

    name: str
    tensors: dict


def open_gguf(path: Path) -> GgufFile:
    from gguf import GGUFReader

    return GgufFile(path.name, {t.name: t for t in GGUFReader(str(path)).tensors})


def read_projections(source: Path | GgufFile, layers: int, num_heads: int, num_kv_heads: int,
                     required: bool = True) -> list[dict[str, np.ndarray]] | None:
    """Per layer, ``{"qkv", "o", "gate_up", "down"}``: ``uint8 [N, K / 32 * 20]`` blocks, rows in
    the order the runner's projections have them; None unless every one of those tensors is
    Q4_1 (a warning when ``required``)."""
    from gguf import GGMLQuantizationType

    gguf = source if isinstance(source, GgufFile) else open_gguf(source)
    tensors = gguf.tensors
    out = []
    for i in range(layers):
        raw = {}
        for key, name in _GGUF_NAMES.items():
            t = tensors.get(f"blk.{i}.{name}.weight")
            if t is None or t.tensor_type != GGMLQuantizationType.Q4_1:
                kind = "missing" if t is None else t.tensor_type.name
                (log.warning if required else log.info)(
                    "cpuLinearWeights: blk.%d.%s.weight in %s is %s, not Q4_1; dense weights are used", i, name,
                    gguf.name, kind)
                return None
            raw[key] = np.asarray(t.data)
        out.append({
            "qkv": np.concatenate([_unpermute(raw["q"], num_heads), _unpermute(raw["k"], num_kv_heads), raw["v"]]),
            "o": np.array(raw["o"]),
            "gate_up": np.concatenate([raw["gate"], raw["up"]]),
            "down": np.array(raw["down"]),
        })
    return out


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order of q or k (as transformers' GGUF loader does): within
    each head, rows (2j, 2j + 1) go back to (j, j + half)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).swapaxes(2, 1).reshape(rows.shape)


def read_lm_head(source: Path | GgufFile) -> np.ndarray | None:
    """The lm_head's Q8_0 blocks ``uint8 [vocab, hidden / 32 * 34]``: ``output.weight``, else the
    tied ``token_embd.weight``; None where that tensor is another type."""
    from gguf import GGMLQuantizationType

    gguf = source if isinstance(source, GgufFile) else open_gguf(source)
    head = gguf.tensors.get("output.weight")
    if head is None:
        head = gguf.tensors.get("token_embd.weight")
    if head is None or head.tensor_type != GGMLQuantizationType.Q8_0:
        log.info("the lm_head of %s is %s, not Q8_0; it keeps the dense weight", gguf.name,
                 "missing" if head is None else head.tensor_type.name)
        return None
    return np.array(head.data)  # a copy: the reader maps the file read-only


def decodes_to(blocks: np.ndarray, weight: torch.Tensor, ops, kind: str = "q4_1") -> bool:
    """Do ``blocks`` of ``kind`` (``q4_1``: float32 ``d * q + m``; ``q8_0``: ``d * q``, as gguf-py
    dequantises them) give exactly ``weight``, bfloat16 (rounded to it) or float32? ``ops``:
    :class:`~llm_engine.cpu_ops.CpuOps` of the weight's dtype with that kind's kernels."""
    n, k = weight.shape
    block_bytes, dequantize = {"q4_1": (Q4_1_BLOCK_BYTES, ops.q4_dequantize),
                               "q8_0": (Q8_0_BLOCK_BYTES, ops.q8_dequantize)}[kind]
    if (weight.dtype not in (torch.bfloat16, torch.float32) or not ops.q4_fits(n, k)
            or blocks.shape != (n, k // 32 * block_bytes)):
        return False
    dense = dequantize(torch.from_numpy(blocks), n, k)
    bits = torch.int16 if weight.dtype == torch.bfloat16 else torch.int32
    return torch.equal(dense.view(bits), weight.detach().cpu().view(bits))
