"""The fused CPU kernels' Linears on a GGUF's own Q4_1 and Q8_0 blocks (:mod:`.cpu_ops`'s
library; ``ModelConfig.cpuLinearWeights``, :mod:`.gguf_blocks`): in bfloat16 on AVX512-BF16
``csrc/linear_q4.c`` and ``csrc/linear_q8.c``, in float32 on AVX2 with FMA and F16C the
one-row kernels of ``csrc/linear_q4_avx2.c`` and ``csrc/linear_q8_avx2.c``. Each is bound
where its ``<symbol>_init()`` says the library was built with its instructions."""

from __future__ import annotations

import ctypes

import torch

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# GGUF block formats: bytes per block of 32 weights, and packed bytes per weight (num, den) per dtype
GGUF_FORMATS = {"Q4_1": (20, {torch.bfloat16: (5, 8), torch.float32: (5, 8)}),
                "Q8_0": (34, {torch.bfloat16: (17, 16), torch.float32: (17, 16)})}


class GgufBlockOps:
    """:class:`~.cpu_ops.CpuOps`'s kernels on GGUF blocks; tensors contiguous and on the CPU."""

    dtype: torch.dtype

    def _bind_gguf(self, bind) -> None:
        """Bind this dtype's block kernels that the library has (``bind(symbol, argtypes, restype)``)."""
        self._linear_q4 = self._linear_q8 = self._q4_pack = self._q8_pack = None
        self._rows = {}  # float32: kind -> the one-row kernel on that kind's blocks
        suffix = _SUFFIX[self.dtype]
        for kind in ("q4", "q8"):
            if not bind(f"linear_{kind}_{suffix}_init", [], ctypes.c_int)():
                continue
            if self.dtype == torch.float32:
                self._rows[kind] = bind(f"linear_{kind}_f32_row", [_P, _P, _P, _P, _I, _I])
            else:
                setattr(self, f"_linear_{kind}", bind(f"linear_{kind}_bf16", [_P, _P, _P, _P, _I, _I, _I]))
            setattr(self, f"_{kind}_pack", bind(f"linear_{kind}_{suffix}_pack", [_P, _P, _I, _I]))
            setattr(self, f"_{kind}_dequantize", bind(f"linear_{kind}_{suffix}_dequantize", [_P, _P, _I, _I]))

    @property
    def linear_q4_address(self) -> int | None:
        """The Q4_1 Linear's C function (same signature as the bfloat16 one), or None."""
        return ctypes.cast(self._linear_q4, ctypes.c_void_p).value if self._linear_q4 else None

    @property
    def has_linear_q4(self) -> bool:
        """Is this dtype's GGUF Q4_1 Linear built here: :meth:`linear_q4` (``csrc/linear_q4.c``,
        AVX512-BF16), or in float32 :meth:`linear_row_blocks` on Q4_1 blocks for single rows
        (``csrc/linear_q4_avx2.c``, AVX2 with FMA and F16C)?"""
        return self._linear_q4 is not None or "q4" in self._rows

    @property
    def has_linear_q8(self) -> bool:
        """Is this dtype's GGUF Q8_0 Linear built here: :meth:`linear_q8` (``csrc/linear_q8.c``,
        AVX512-BF16), or in float32 :meth:`linear_row_blocks` on Q8_0 blocks for single rows
        (``csrc/linear_q8_avx2.c``, AVX2 with FMA and F16C)?"""
        return self._linear_q8 is not None or "q8" in self._rows

    @staticmethod
    def q4_fits(n: int, k: int) -> bool:
        """Can :meth:`linear_q4`, :meth:`linear_q8` or :meth:`linear_row_blocks` serve an
        ``[n, k]`` weight (whole blocks of 16 outputs and 32 inputs)?"""
        return n % 16 == 0 and k % 32 == 0 and n > 0 and k > 0

    q8_fits = q4_fits

    def linear_row_blocks(self, kind: str, x: torch.Tensor, packed: torch.Tensor, n: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """float32 ``x @ weight.T + bias`` for one row ``x [1, K]`` and ``n`` outputs from the
        ``kind`` (``q4``, ``q8``) blocks of :meth:`q4_pack` or :meth:`q8_pack`, up to float32
        rounding."""
        x = x.contiguous()
        out = torch.empty(1, n, dtype=torch.float32)
        self._rows[kind](x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                         out.data_ptr(), n, x.shape[1])
        return out

    def q4_pack(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q4_1 blocks ``uint8 [N, K / 32 * 20]`` in the layout :meth:`linear_q4` reads
        (``uint8 [N * K * 5 / 8]``), or in float32 :meth:`linear_row_blocks` (``[N * K * 5 / 8]``)."""
        return self._pack("Q4_1", self._q4_pack, blocks, n, k)

    def q8_pack(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """GGUF Q8_0 blocks ``uint8 [N, K / 32 * 34]`` in the layout :meth:`linear_q8` reads
        (``uint8 [N * K * 17 / 16]``), or in float32 :meth:`linear_row_blocks` (``[N * K * 17 / 16]``)."""
        return self._pack("Q8_0", self._q8_pack, blocks, n, k)

    def q4_dequantize(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The weight ``[N, K]`` GGUF Q4_1 blocks dequantise to, as gguf-py computes it (float32
        ``d * q + m``), in these kernels' dtype (to bfloat16 rounded to nearest even, as torch does)."""
        return self._dequantize("Q4_1", self._q4_dequantize, blocks, n, k)

    def q8_dequantize(self, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The weight ``[N, K]`` GGUF Q8_0 blocks dequantise to, as gguf-py computes it (float32
        ``d * q``, exact), in these kernels' dtype (to bfloat16 rounded to nearest even, as torch does)."""
        return self._dequantize("Q8_0", self._q8_dequantize, blocks, n, k)

    def linear_q4(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for bfloat16 ``x [M, K]``, the weight from :meth:`q4_pack` and a
        float32 ``bias``; each row's bits are the same whatever ``M``."""
        return self._linear_blocks(self._linear_q4, x, packed, n, bias)

    def linear_q8(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for bfloat16 ``x [M, K]``, the weight from :meth:`q8_pack` and a
        float32 ``bias``: bit for bit what the AVX512-BF16 :meth:`linear_bf16` gives on the
        dequantised weight, whatever ``M``."""
        return self._linear_blocks(self._linear_q8, x, packed, n, bias)

    def _blocks(self, kind: str, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        blocks = blocks.contiguous()
        size = GGUF_FORMATS[kind][0]
        if not self.q4_fits(n, k) or blocks.dtype != torch.uint8 or blocks.numel() != n * k // 32 * size:
            raise ValueError(f"not the {kind} blocks of a {n}x{k} weight that fits: {blocks.dtype} "
                             f"{tuple(blocks.shape)}")
        return blocks

    def _pack(self, kind: str, pack, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        blocks = self._blocks(kind, blocks, n, k)
        num, den = GGUF_FORMATS[kind][1][self.dtype]
        packed = torch.empty(n * k * num // den, dtype=torch.uint8)
        pack(blocks.data_ptr(), packed.data_ptr(), n, k)
        return packed

    def _dequantize(self, kind: str, dequantize, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
        blocks = self._blocks(kind, blocks, n, k)
        out = torch.empty(n, k, dtype=self.dtype)
        dequantize(blocks.data_ptr(), out.data_ptr(), n, k)
        return out

    @staticmethod
    def _linear_blocks(linear, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
                       ) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m:
            linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), m, n,
                   x.shape[1])
        return out
