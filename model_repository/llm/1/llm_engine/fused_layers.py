"""Every decoder layer of a bfloat16 CPU step in one call (``csrc/decoder_layers.c``).

Where every projection of the model runs on one of the fused kernels' Linears (bfloat16 on
AMX or AVX512-BF16, or GGUF Q4_1 blocks), the runner's layer loop is nothing but kernel
calls, so the whole loop can run in C: the same kernels on the same data in the same
order, the same bits, without
~120 ctypes calls and their tensors a step, and with the GIL released for all of it. The
runner keeps its Python loop for steps with long prompt chunks (attended with SDPA) and
for every other model, dtype and device.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_ops import ptr_or_none
from .linear import PackedBf16Linear, PackedQ4Linear

_P, _I = ctypes.c_void_p, ctypes.c_int64


class DecoderModel(ctypes.Structure):
    """``decoder_model`` of decoder_layers.c."""

    _fields_ = [*((name, _I) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                          "num_slots")),
                ("scale", ctypes.c_float),
                *((name, _P) for name in ("linear", "norm_in", "norm_post", "eps_in", "eps_post", "qkv", "o",
                                          "gate_up", "down", "qkv_bias", "o_bias", "down_bias", "kv"))]


class DecoderStep(ctypes.Structure):
    """``decoder_step`` of decoder_layers.c."""

    _fields_ = [("t", _I),
                *((name, _P) for name in ("h", "x", "q", "attn", "qkv", "o", "gate_up", "act", "down",
                                          "positions", "slots", "cos", "sin_signed")),
                ("decode_n", _I), ("decode_width", _I),
                *((name, _P) for name in ("decode_rows", "decode_lens", "decode_ctx")),
                ("prefill_n", _I), ("prefill_width", _I),
                *((name, _P) for name in ("prefill_rows", "prefill_seq", "prefill_lens", "prefill_slots"))]


def _pointers(items, ctype=_P) -> ctypes.Array:
    return (ctype * len(items))(*items)


class FusedLayers:
    """The runner's decoder layers as one C call; build with :meth:`for_runner`."""

    def __init__(self, runner, linear: int) -> None:
        """``linear``: the address of the C Linear every projection runs on."""
        self.runner = runner
        n = len(runner.layers)
        # The arrays the struct points into, kept alive with it.
        self._arrays = {
            "norm_in": _pointers([w.data_ptr() for w, _ in runner.norm_in]),
            "norm_post": _pointers([w.data_ptr() for w, _ in runner.norm_post]),
            "eps_in": _pointers([eps for _, eps in runner.norm_in], ctypes.c_float),
            "eps_post": _pointers([eps for _, eps in runner.norm_post], ctypes.c_float),
            "qkv": _pointers([lin.packed.data_ptr() for lin in runner.qkv]),
            "o": _pointers([lin.packed.data_ptr() for lin in runner.o_proj]),
            "gate_up": _pointers([lin.packed.data_ptr() for lin in runner.gate_up]),
            "down": _pointers([lin.packed.data_ptr() for lin in runner.down]),
            "qkv_bias": _pointers([ptr_or_none(lin.bias) for lin in runner.qkv]),
            "o_bias": _pointers([ptr_or_none(lin.bias) for lin in runner.o_proj]),
            "down_bias": _pointers([ptr_or_none(lin.bias) for lin in runner.down]),
            "kv": _pointers([runner.kv[i].data_ptr() for i in range(n)]),
        }
        self.model = DecoderModel(
            layers=n, hidden=runner.inner.embed_tokens.weight.shape[1], heads=runner.num_heads,
            kv_heads=runner.num_kv_heads, head_dim=runner.head_dim, inter=runner.intermediate,
            num_slots=runner.kv.shape[3], scale=runner.scaling, linear=linear,
            **{name: ctypes.addressof(array) for name, array in self._arrays.items()})

    @classmethod
    def for_runner(cls, runner) -> FusedLayers | None:
        """For a bfloat16 model on the fused kernels whose every projection is on the same one of
        their Linears."""
        ops = runner.ops
        if ops is None or runner.dtype != torch.bfloat16 or not ops.linear_bf16_address:
            return None
        kinds = {type(lin) for lin in [*runner.qkv, *runner.o_proj, *runner.gate_up, *runner.down]}
        if kinds == {PackedBf16Linear}:
            return cls(runner, ops.linear_bf16_address)
        if kinds == {PackedQ4Linear}:
            return cls(runner, ops.linear_q4_address)
        return None

    def __call__(self, h: torch.Tensor, step) -> None:
        """Run every layer over the residual stream ``h [T, hidden]`` (contiguous, updated in place)."""
        r = self.runner
        t, hidden, d = h.shape[0], h.shape[1], r.head_dim
        empty = lambda *shape: torch.empty(*shape, dtype=h.dtype)  # noqa: E731
        bufs = {"x": empty(t, hidden), "q": empty(t, r.num_heads, d), "attn": empty(t, r.num_heads, d),
                "qkv": empty(t, (r.num_heads + 2 * r.num_kv_heads) * d), "o": empty(t, hidden),
                "gate_up": empty(t, 2 * r.intermediate), "act": empty(t, r.intermediate), "down": empty(t, hidden)}
        s = DecoderStep(t=t, h=h.data_ptr(), positions=step.positions.data_ptr(), slots=step.slots.data_ptr(),
                        cos=r.cos_f32.data_ptr(), sin_signed=r.sin_signed_f32.data_ptr(),
                        **{name: buf.data_ptr() for name, buf in bufs.items()})
        if step.decode_rows.numel():
            s.decode_n, s.decode_width = step.decode_rows.shape[0], step.decode_ctx.shape[1]
            s.decode_rows, s.decode_lens = step.decode_rows.data_ptr(), step.decode_lens.data_ptr()
            s.decode_ctx = step.decode_ctx.data_ptr()
        pb = step.short_prefills
        if pb is not None:
            s.prefill_n, s.prefill_width = pb.q_rows.shape[0], pb.shape[2]
            s.prefill_rows, s.prefill_seq = pb.q_rows.data_ptr(), pb.q_seq.data_ptr()
            s.prefill_lens, s.prefill_slots = pb.q_lens.data_ptr(), pb.kv_slots.data_ptr()
        r.ops.decoder_layers(self.model, s)
