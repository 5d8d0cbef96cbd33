"""Build a ready :class:`Engine` from the settings file: weights, device, dtype, KV budget."""

from __future__ import annotations

import logging
import time

import torch

from .admission import EngineLimits
from .config import Settings
from .cpu_cores import fused_kernels_expected, in_a_passing_thread, plan_split, select_cpu_threads
from .device import select_device, select_dtype
from .engine import Engine
from .kv_cache import BlockManager
from .runner import ModelRunner
from .scheduler import Scheduler
from .weights import gguf_source, model_limits, resolve_model_dir

log = logging.getLogger(__name__)

REQUIRED_MODULES = ("embed_tokens", "layers", "norm", "rotary_emb")
# prefillChunkTokens' auto value on CPU: SmolLM2-135M on 2 cores, 8 streams decoding while a
# 2000-token prompt came in: the longest step 2.3 s in one chunk, 0.39-0.41 s in chunks of
# 256 (0.23 s at 128, 0.88 s at 512), the newcomer's first token 5-10% later
CPU_PREFILL_CHUNK_TOKENS = 256


def build_engine(settings: Settings, device_id: int = 0, metrics=None, instances: int = 1) -> Engine:
    """``instances``: how many engines this model runs on the machine (Triton's instance count).

    The loading runs in a thread of its own, so that the OpenMP workers it starts end with
    it and the engine thread's are the process's only ones (see :func:`in_a_passing_thread`)."""
    engine = in_a_passing_thread(_build_engine, settings, device_id, metrics, instances)
    torch.set_grad_enabled(False)  # in the caller's thread, as before (grad mode is per thread)
    return engine


def _build_engine(settings: Settings, device_id: int, metrics, instances: int) -> Engine:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    mc, deploy, sched = settings.model, settings.deploy, settings.schedule
    model_dir = resolve_model_dir(mc.modelWeightPath)
    log.info("loading %s from %s", mc.modelName, model_dir)
    device = select_device(mc.device, device_id)
    cores, fused = None, False
    if device.type == "cpu":
        fused = fused_kernels_expected(mc.cpuKernels)
        torch.set_num_threads(select_cpu_threads(mc.cpuThreads, fused))
        cores = plan_split(mc.cpuAffinity, mc.cpuThreads, instances, fused)
    config = AutoConfig.from_pretrained(model_dir)
    dtype = select_dtype(mc.dtype, device, config.hidden_size, getattr(config, "intermediate_size", 1536), fused)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, m) for m in REQUIRED_MODULES):
        raise ValueError(f"unsupported architecture {config.model_type!r}: the engine runs Llama-family "
                         "decoder checkpoints (Llama, Mistral, Qwen2/3, SmolLM)")
    info = model_limits(model_dir)
    if not info["vocab_size"]:
        log.warning("config.json has no vocab_size/padded_vocab_size; top_k clamping is disabled")
    block_size = sched.cacheBlockSize
    per_token = ModelRunner.kv_bytes_per_token(config, dtype)
    num_blocks = sched.kvCacheBlocks or max(1, sched.kvCacheMemoryMiB * 2**20 // (per_token * block_size))
    max_pos = min(deploy.maxSeqLen, info["max_position_embeddings"] or deploy.maxSeqLen) + 1
    q4_source = gguf_source(mc.modelWeightPath) if mc.cpuLinearWeights != "dense" else None
    if q4_source is None and mc.cpuLinearWeights == "gguf":
        log.warning("cpuLinearWeights gguf: %s is not a GGUF file; dense weights are used", mc.modelWeightPath)
    runner = ModelRunner(model, device, dtype, num_blocks, block_size, max_pos,
                         fused_kernels=mc.cpuKernels == "auto", gguf_q4_source=q4_source,
                         gguf_q4_required=mc.cpuLinearWeights == "gguf")
    blocks = BlockManager(num_blocks, block_size, sched.enablePrefixCache)
    chunk = sched.prefillChunkTokens or (CPU_PREFILL_CHUNK_TOKENS if device.type == "cpu" else 0)
    scheduler = Scheduler(blocks, sched.maxBatchSize, sched.maxPrefillBatchSize, sched.maxPrefillTokens,
                          sched.maxWaitingRequests, prefill_chunk_tokens=chunk)
    limits = EngineLimits(
        max_seq_len=deploy.maxSeqLen, max_input_len=deploy.maxInputTokenLen,
        max_iter_times=sched.maxIterTimes, max_position_embeddings=info["max_position_embeddings"],
        truncation=deploy.truncation, default_top_k=info["default_top_k"],
        vocab_size=info["vocab_size"] or runner.vocab_size, default_temperature=info["default_temperature"],
        kv_blocks=num_blocks, kv_block_size=block_size,
    )
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    engine = Engine(runner, tokenizer, blocks, scheduler, limits, eos_ids, metrics, cores,
                    step_timeout=sched.stepTimeout, max_failed_steps=sched.maxFailedSteps)
    cpus = f"engine {list(cores.engine)}, rest {list(cores.rest)}" if cores else "unpinned"
    log.info(
        "engine ready in %.1fs: device=%s threads=%d cpus=%s dtype=%s fused_cpu_kernels=%s kv_blocks=%d x %d tokens (%.0f MiB) "
        "maxBatchSize=%d maxPrefillTokens=%d prefillChunkTokens=%s maxSeqLen=%d maxIterTimes=%d prefix_cache=%s eos=%s "
        "default top_k=%d temperature=%g",
        time.monotonic() - t0, device, torch.get_num_threads(), cpus, str(dtype).removeprefix("torch."),
        runner.ops is not None, num_blocks,
        block_size,
        num_blocks * block_size * per_token / 2**20, sched.maxBatchSize, sched.maxPrefillTokens, chunk or "off",
        deploy.maxSeqLen, sched.maxIterTimes, sched.enablePrefixCache, eos_ids, limits.default_top_k,
        limits.default_temperature,
    )
    return engine
