"""One forward step over a flattened batch of tokens with a paged KV cache.

The runner reuses the Hugging Face modules of Llama-family checkpoints (Llama,
Mistral, Qwen2/Qwen3, SmolLM, ...) for projections, norms, MLP and rotary tables,
and does attention itself against a block-paged KV pool, so that sequences of
different lengths decode together without padding the cache.

A step's tokens are flattened to ``[T, hidden]`` for all linear layers. Attention
runs in three groups: every one-token decode in one batched call, short prefill
chunks padded into one call, and each long prefill chunk on its own. The KV pool is
head-major (``[layer, k/v, kv_head, slot, head_dim]``), so gathering a context by slot
gives ``[kv_head, tokens, head_dim]``, the layout the batched matmuls read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_ops
from .fused_layers import FusedLayers
from .projections import build_projections

log = logging.getLogger(__name__)
# RMSNorm classes computing x * rsqrt(mean(x^2) + eps) * weight, which F.rms_norm fuses.
FUSABLE_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


@dataclass
class StepInput:
    """What the scheduler asks the runner to compute in one step."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, flat KV slot per token
    decode_rows: torch.Tensor  # [Bd] token index of each one-token decode
    decode_ctx: torch.Tensor  # [Bd, Lmax] slot ids of each decode's context (pad = dummy slot)
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] bool, True = attend
    prefills: list[tuple[int, int, int, torch.Tensor | None]]  # (start_row, n_tokens, ctx_len, ctx_slots)
    logit_rows: torch.Tensor  # [R] token rows whose logits are needed
    short_prefills: PrefillBatch | None = None  # short prefill chunks, attended in one padded call
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each decode (the fused kernels)


@dataclass
class PrefillBatch:
    """Several short prefill chunks padded to ``[P, Lq]`` queries over ``[P, Lk]`` keys."""

    q_index: torch.Tensor  # [P * Lq] token row of each padded query (pads repeat a valid row)
    q_valid: torch.Tensor  # [P * Lq] bool, False for pads
    q_rows: torch.Tensor  # token rows of the valid queries, in padded order
    kv_slots: torch.Tensor  # [P * Lk] slot of each key (pads = the dummy slot)
    mask: torch.Tensor  # [P, 1, Lq, Lk] bool, causal within each sequence's context
    shape: tuple[int, int, int]  # P, Lq, Lk
    q_seq: torch.Tensor | None = None  # chunk (0..P-1) of each valid query, in q_rows order
    q_lens: torch.Tensor | None = None  # keys each valid query attends (its position + 1)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Grouped-query attention as two batched matmuls.

    ``q [B, Lq, H, D]`` (token-major, as the projections produce it) attends over head-major
    ``k, v [KV, B, Lk, D]`` (as the paged cache gathers them, with no further copy);
    ``blocked [B, 1, Lq, Lk]`` is True where a query may *not* attend. Returns ``[B, Lq, H, D]``.
    Softmax runs in float32. On CPU in bf16/fp16, ``scaled_dot_product_attention`` with a
    mask is 4-9x slower than this for batched decode (measured at 32 rows, 40-400 keys),
    so the runner uses it there, at every batch size: each row's result is then the same
    alone or in a batch, and with any padding of the keys (masked keys add exact zeros),
    which seeded sampling needs.
    """
    b, lq, h, d = q.shape
    kv = k.shape[0]
    g = h // kv
    qh = q.view(b, lq, kv, g, d).permute(2, 0, 3, 1, 4).reshape(kv, b, g * lq, d)
    scores = torch.matmul(qh, k.transpose(-1, -2)).view(kv, b, g, lq, -1).float()
    scores = scores.mul_(scale).masked_fill_(blocked.reshape(1, b, 1, lq, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs.view(kv, b, g * lq, -1), v)  # [KV, B, g*Lq, D]
    return out.view(kv, b, g, lq, d).permute(1, 3, 0, 2, 4).reshape(b, lq, h, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`matmul_attention`'s contract through ``scaled_dot_product_attention``
    (``allowed`` is True where a query may attend)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, ``x * cos + rotate_half(x) * sin``, in four ops for all heads at once.

    ``sin_signed`` is ``sin`` with its first half negated, so that swapping the halves of
    ``x`` (one ``flip``) stands in for ``rotate_half``: the same products and sums, so the
    same numbers as the usual form.
    """
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return x * cos + swapped * sin_signed


class ModelRunner:
    """Holds the model, the KV pool and the rotary tables on one device."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int, block_size: int,
                 max_positions: int, fused_kernels: bool = True, gguf_q4_source: Path | None = None,
                 gguf_q4_required: bool = False):
        """``gguf_q4_source``: the GGUF file the model was converted from, whose Q4_1 blocks the
        decoder Linears use where this runner can (``ModelConfig.cpuLinearWeights``; see
        :mod:`.gguf_blocks`); ``gguf_q4_required``: warn where it can't (``gguf`` rather than ``auto``)."""
        cfg = model.config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.inner = model.model
        self.layers = list(self.inner.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.dummy_slot = self.num_slots  # always zero, used to pad contexts
        # Head-major pool: gathering a context gives [KV, tokens, D], what attention multiplies.
        shape = (len(self.layers), 2, self.num_kv_heads, self.num_slots + 1, self.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        with torch.inference_mode():
            pos = torch.arange(max_positions, device=device)
            probe = torch.zeros(1, dtype=dtype, device=device)
            cos, sin = self.inner.rotary_emb(probe, pos[None])
        self.cos, self.sin = cos[0], sin[0]  # [P, head_dim]
        half = self.head_dim // 2
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # Masked attention: SDPA, except on CPU at reduced precision (see matmul_attention).
        self.matmul_attention = device.type == "cpu" and dtype != torch.float32
        self._attend = matmul_attention if self.matmul_attention else sdpa_attention
        self.ops = self._load_fused_kernels() if fused_kernels else None
        self._fuse_projections(gguf_q4_source, gguf_q4_required)
        self.fused_layers = FusedLayers.for_runner(self)  # every layer in one C call, where it can
        if self.fused_layers is not None:
            log.info("decoder layers in one fused call per step (steps without long prompt chunks)")

    def _fuse_projections(self, q4_source: Path | None, q4_required: bool) -> None:
        """The layers' projections and the lm_head as :mod:`.projections` builds them (q/k/v and
        gate/up fused), and the norms the forward uses."""
        built = build_projections(self.model, self.ops, self.dtype, self.device, self.num_heads, self.num_kv_heads,
                                  q4_source, q4_required)
        self.qkv, self.o_proj, self.gate_up, self.down = built.qkv, built.o_proj, built.gate_up, built.down
        self.lm_head = built.lm_head
        self._weight_bytes_per_token = built.weight_bytes_per_token
        self.act = [layer.mlp.act_fn for layer in self.layers]
        self.intermediate = built.intermediate
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.input_norm = [self._norm(layer.input_layernorm) for layer in self.layers]
        self.post_norm = [self._norm(layer.post_attention_layernorm) for layer in self.layers]
        self.final_norm = self._norm(self.inner.norm)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a one-token step reads: every projection and the lm_head in the form
        its kernel reads (GGUF Q4_1 blocks: 0.625 bytes a weight; else the dtype's size), for the
        bench's memory-bound limit. Norms and the one embedding row are left out."""
        return self._weight_bytes_per_token

    def _load_fused_kernels(self) -> cpu_ops.CpuOps | None:
        """The fused CPU kernels (:mod:`cpu_ops`) where this model and device can use them."""
        cfg = self.model.config
        norms = [layer.input_layernorm for layer in self.layers] + [layer.post_attention_layernorm
                                                                    for layer in self.layers]
        standard = (
            self.device.type == "cpu"
            and getattr(cfg, "hidden_act", None) in ("silu", "swish")
            and not hasattr(self.layers[0].self_attn, "q_norm")
            and self.head_dim % 2 == 0 and self.num_heads % self.num_kv_heads == 0
            and all(type(n).__name__ in FUSABLE_NORMS and _norm_eps(n) is not None for n in norms)
        )
        if not standard:
            return None
        ops = cpu_ops.load(self.dtype)
        if ops is None:
            return None
        as_f32 = lambda n: n.weight.detach().float().contiguous()  # noqa: E731
        self.norm_in = [(as_f32(ly.input_layernorm), _norm_eps(ly.input_layernorm)) for ly in self.layers]
        self.norm_post = [(as_f32(ly.post_attention_layernorm), _norm_eps(ly.post_attention_layernorm))
                          for ly in self.layers]
        self.cos_f32 = self.cos.float().contiguous()
        self.sin_signed_f32 = self.sin_signed.float().contiguous()
        log.info("fused CPU kernels on (%s)", str(self.dtype).removeprefix("torch."))
        return ops

    @staticmethod
    def _norm(module):
        """The fused ``F.rms_norm`` for the standard RMSNorm classes; the module itself otherwise."""
        eps = _norm_eps(module)
        if type(module).__name__ in FUSABLE_NORMS and eps is not None and module.weight.dtype != torch.float32:
            shape, weight = (module.weight.shape[0],), module.weight.detach().float()
            return lambda x: F.rms_norm(x.float(), shape, weight, eps).to(x.dtype)
        if type(module).__name__ in FUSABLE_NORMS and eps is not None:
            shape, weight = (module.weight.shape[0],), module.weight
            return lambda x: F.rms_norm(x, shape, weight, eps)
        return module

    @staticmethod
    def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_hidden_layers * 2 * kv_heads * head_dim * elem

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            self.kv[:, :, :, dst * bs : (dst + 1) * bs] = self.kv[:, :, :, src * bs : (src + 1) * bs]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run the model; return float32 logits ``[R, vocab]`` for ``step.logit_rows``."""
        if self.ops is not None:
            return self._forward_fused(step)
        h = self.inner.embed_tokens(step.input_ids)
        cos = self.cos[step.positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_signed[step.positions].unsqueeze(1)
        masks = self._step_masks(step)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer.self_attn, self.input_norm[i](h), cos, sin, step, masks)
            x = self.gate_up[i](self.post_norm[i](h))
            gate, up = x.split(x.shape[-1] // 2, dim=-1)
            h = h + self.down[i](self.act[i](gate) * up)
        h = self.final_norm(h[step.logit_rows])
        return self.lm_head(h).float()

    def _forward_fused(self, step: StepInput) -> torch.Tensor:
        """:meth:`forward` with the fused CPU kernels: per layer four matmuls and five kernel calls."""
        ops, heads, d = self.ops, self.num_heads, self.head_dim
        t = step.input_ids.shape[0]
        h = self.inner.embed_tokens(step.input_ids).contiguous()  # the residual stream, updated in place
        ops.set_threads(torch.get_num_threads())
        if self.fused_layers is not None and not step.prefills:  # the loop below, in C
            self.fused_layers(h, step)
            return self.lm_head(self.final_norm(h[step.logit_rows])).float()
        x = torch.empty_like(h)  # the normed input of the next matmul
        q = torch.empty(t, heads, d, dtype=h.dtype)
        attn = torch.empty(t, heads, d, dtype=h.dtype)
        act = torch.empty(t, self.intermediate, dtype=h.dtype)
        delta = None
        for i in range(len(self.layers)):
            ops.add_rms_norm(h, delta, x, *self.norm_in[i])
            qkv = self.qkv[i](x).contiguous()
            cache = self.kv[i]
            ops.rope_store_kv(qkv, step.positions, self.cos_f32, self.sin_signed_f32, heads,
                              self.num_kv_heads, q, cache, step.slots)
            self._attention_fused(q, cache, attn, step)
            ops.add_rms_norm(h, self.o_proj[i](attn.view(t, heads * d)).contiguous(), x, *self.norm_post[i])
            ops.silu_mul(self.gate_up[i](x).contiguous(), act)
            delta = self.down[i](act).contiguous()
        ops.add_rms_norm(h, delta, None, *self.norm_post[-1])
        h = self.final_norm(h[step.logit_rows])
        return self.lm_head(h).float()

    def _attention_fused(self, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, step: StepInput) -> None:
        """Decodes and short prefill chunks in the paged kernel, each query row on its own;
        long prompts' chunks through SDPA."""
        if step.decode_rows.numel():
            self.ops.paged_attention(q, cache, out, step.decode_rows, None, step.decode_lens, step.decode_ctx,
                                     self.scaling)
        pb = step.short_prefills
        if pb is not None:
            p, _, lk = pb.shape
            self.ops.paged_attention(q, cache, out, pb.q_rows, pb.q_seq, pb.q_lens, pb.kv_slots.view(p, lk),
                                     self.scaling)
        for start, n, ctx_len, ctx_slots in step.prefills:
            slots = step.slots[start : start + n] if ctx_slots is None else ctx_slots
            kp = cache[0].index_select(1, slots).unsqueeze(1)  # [KV, 1, ctx, D]
            vp = cache[1].index_select(1, slots).unsqueeze(1)
            out[start : start + n] = self._chunk_attention(q[start : start + n], kp, vp, ctx_len)

    def _chunk_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """A long prompt's chunk through SDPA: queries ``q [n, H, D]`` (the last ``n`` of
        ``ctx_len`` positions) over ``k, v [KV, 1, ctx_len, D]``; returns ``[n, H, D]``."""
        n = q.shape[0]
        if n == ctx_len:  # the whole context is in this chunk
            op = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1), v.transpose(0, 1),
                                                is_causal=True, scale=self.scaling, enable_gqa=True)
            return op[0].transpose(0, 1)
        rows = torch.arange(n, device=q.device)[:, None] + (ctx_len - n)
        allowed = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        return sdpa_attention(q.unsqueeze(0), k, v, allowed, self.scaling)[0]

    def _step_masks(self, step: StepInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decode and short-prefill masks in the form the attention kernel takes, once per step."""
        pb = step.short_prefills
        masks = (step.decode_mask if step.decode_rows.numel() else None, pb.mask if pb is not None else None)
        if self.matmul_attention:  # it takes the blocked positions
            return tuple(None if m is None else ~m for m in masks)
        return masks

    def _attention(self, i: int, attn, x, cos, sin, step: StepInput, masks) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv[i](x)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms, before the rotary embedding
            q = attn.q_norm(qkv[:, : self.q_size].reshape(t, heads, d))
            k = attn.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, kv_heads, d))
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv_heads, d)
        qk = rotate(qk, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, self.q_size + self.kv_size :].view(t, kv_heads, d)
        cache_k, cache_v = self.kv[i, 0], self.kv[i, 1]  # [KV, slots, D]
        cache_k.index_copy_(1, step.slots, k.transpose(0, 1))
        cache_v.index_copy_(1, step.slots, v.transpose(0, 1))
        decode_mask, prefill_mask = masks
        if decode_mask is not None and step.decode_rows.numel() == t:  # decode only: rows are 0..t-1
            out = self._decode(q, cache_k, cache_v, step, decode_mask)
            return self.o_proj[i](out.reshape(t, heads * d))
        out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
        if decode_mask is not None:
            out[step.decode_rows] = self._decode(q[step.decode_rows], cache_k, cache_v, step, decode_mask)
        if prefill_mask is not None:
            pb = step.short_prefills
            p, lq, lk = pb.shape
            qp = q.index_select(0, pb.q_index).view(p, lq, heads, d)
            kp = cache_k.index_select(1, pb.kv_slots).view(kv_heads, p, lk, d)
            vp = cache_v.index_select(1, pb.kv_slots).view(kv_heads, p, lk, d)
            op = self._attend(qp, kp, vp, prefill_mask, self.scaling)
            out[pb.q_rows] = op.reshape(p * lq, heads, d)[pb.q_valid]
        for start, n, ctx_len, ctx_slots in step.prefills:
            if ctx_slots is None:  # whole context is in this chunk
                kp = k[start : start + n].transpose(0, 1).unsqueeze(1)  # [KV, 1, n, D]
                vp = v[start : start + n].transpose(0, 1).unsqueeze(1)
            else:  # a later chunk: attend over the context already in the cache
                kp = cache_k.index_select(1, ctx_slots).unsqueeze(1)  # [KV, 1, ctx, D]
                vp = cache_v.index_select(1, ctx_slots).unsqueeze(1)
            out[start : start + n] = self._chunk_attention(q[start : start + n], kp, vp, ctx_len)
        return self.o_proj[i](out.reshape(t, heads * d))

    def _decode(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, step: StepInput,
                mask: torch.Tensor) -> torch.Tensor:
        """One query per decoding sequence (``q [Bd, H, D]``) over its gathered context."""
        bd, length = step.decode_ctx.shape
        flat = step.decode_ctx.reshape(-1)
        kd = cache_k.index_select(1, flat).view(self.num_kv_heads, bd, length, self.head_dim)
        vd = cache_v.index_select(1, flat).view(self.num_kv_heads, bd, length, self.head_dim)
        return self._attend(q.unsqueeze(1), kd, vd, mask, self.scaling).squeeze(1)


def _norm_eps(module) -> float | None:
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))
