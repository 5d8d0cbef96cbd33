"""Peers on the same model, prompts and token counts: what a user would otherwise run.

* naive: ``model.generate`` one request at a time (fp32);
* static batch: one ``generate`` over left-padded prompts (fp32);
* transformers continuous batching: ``generate_batch`` with ``attn_implementation="sdpa"``;
* llama.cpp through ``llama-cpp-python`` on the same GGUF, one request at a time.

Every peer ignores EOS so that it produces exactly ``max_tokens`` tokens per request.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator

from bench.machine import native_bf16
from bench.stats import RunResult, StreamTrace, from_traces
from bench.workload import Workload, make_prompts

log = logging.getLogger(__name__)

WARM_PROMPT = "Hello, warm-up."


def load_hf(dtype_name: str, attn: str | None = None, device: str = "cpu"):
    """The stack's default checkpoint (the GGUF converted to an HF folder) in ``dtype_name``."""
    import torch
    from llm_engine.weights import resolve_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir("")
    kwargs = {"dtype": getattr(torch, dtype_name)}
    if attn:
        kwargs["attn_implementation"] = attn
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def weight_bytes(model) -> int:
    """Bytes of the model's distinct parameter tensors (tied embeddings counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class StepClock:
    """A ``generate`` streamer that records when each decoding step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model, tok, prompts: list[str], max_tokens: int, clock: StepClock | None = None) -> int:
    """Greedy ``generate`` over ``prompts`` (left-padded); returns new tokens per sequence."""
    import torch

    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id, streamer=clock)
    return int(out.shape[1] - enc["input_ids"].shape[1])


def run_naive(workload: Workload, model, tok) -> RunResult:
    _generate(model, tok, [WARM_PROMPT], 4)
    prompts = make_prompts(workload.naive_requests)
    traces = []
    t0 = time.perf_counter()
    for prompt in prompts:
        clock = StepClock()
        trace = StreamTrace(sent=time.perf_counter())
        trace.tokens = _generate(model, tok, [prompt], workload.max_tokens, clock)
        trace.token_times = clock.times
        traces.append(trace)
    return from_traces("naive generate", 1, _dtype(model), traces, time.perf_counter() - t0)


def run_static(workload: Workload, model, tok) -> RunResult:
    n = workload.peer_batch
    prompts = workload.prompts_for(n)[:n]
    _generate(model, tok, prompts[:2], 4)
    clock = StepClock()
    t0 = time.perf_counter()
    new = _generate(model, tok, prompts, workload.max_tokens, clock)
    wall = time.perf_counter() - t0
    traces = [StreamTrace(sent=t0, token_times=list(clock.times), tokens=new) for _ in prompts]
    return from_traces("static batch", n, _dtype(model), traces, wall)


def _dtype(model) -> str:
    return str(model.dtype).removeprefix("torch.")


def run_continuous(workload: Workload, dtype_name: str, device: str = "cpu") -> RunResult:
    from transformers import GenerationConfig

    model, tok = load_hf(dtype_name, attn="sdpa", device=device)
    n = workload.peer_batch
    prompts = workload.prompts_for(n)[:n]
    inputs = [tok(p).input_ids for p in prompts]
    cfg = GenerationConfig(max_new_tokens=workload.max_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=tok.pad_token_id)
    # warm-up; the manager (paged cache, batch processor) is kept and reused by the timed call
    model.generate_batch(inputs, generation_config=cfg, max_new_tokens=4, persistent_manager=True)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs, generation_config=cfg, max_new_tokens=workload.max_tokens,
                                record_timestamps=True)
    wall = time.perf_counter() - t0
    traces = []
    for out in outs.values():
        trace = StreamTrace(sent=t0, token_times=list(out.timestamps or []), tokens=len(out.generated_tokens),
                            error=out.error or "")
        traces.append(trace)
    del model
    gc.collect()
    short = [t.tokens for t in traces if t.tokens != workload.max_tokens]
    note = f"{len(short)} requests stopped short" if short else ""
    return from_traces("transformers CB", n, dtype_name, traces, wall, note)


def llama_cpp_missing() -> str:
    """Why the llama.cpp peer cannot run here ("" when it can)."""
    from bench.llama_server import PEERS_BUILD

    if (PEERS_BUILD / "libllama.so").is_file():  # `make bench-peers` installs the package without libraries
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(PEERS_BUILD))
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or a broken shared library
        return f"llama-cpp-python not importable ({type(exc).__name__}: {exc}); see bench/README.md"
    return ""


@contextlib.contextmanager
def _no_extra_buffers() -> Iterator[None]:
    """Load with ``use_extra_bufts=False`` (llama.cpp's ``--no-repack``), which ``Llama()`` does not expose.

    Only on CPUs with AMX: there llama.cpp 0.3.36 repacks the weights into its AMX buffer and then
    segfaults in the first batched decode (ggml_backend_amx_mul_mat, llama.cpp #20824);
    without extra buffer types it runs its ordinary AVX-512 quantised kernels.
    """
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params

    def patched():
        params = original()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def run_llama_cpp(workload: Workload) -> RunResult:
    missing = llama_cpp_missing()
    if missing:
        log.warning("skipping the llama.cpp peer: %s", missing)
        return RunResult(system="llama-cpp-python", concurrency=1, dtype="Q4_1", note=missing)
    import numpy as np
    from llama_cpp import Llama, LogitsProcessorList
    from llm_engine.weights import default_gguf_path

    from bench.llama_server import has_amx

    with _no_extra_buffers() if has_amx() else contextlib.nullcontext():
        llm = Llama(model_path=str(default_gguf_path()), n_ctx=512, n_threads=os.cpu_count() or 1,
                    n_threads_batch=os.cpu_count() or 1, verbose=False, seed=0)
    eos = llm.token_eos()

    def no_eos(_ids, scores):
        scores[eos] = -np.inf
        return scores

    processors = LogitsProcessorList([no_eos])

    def one(prompt: str, max_tokens: int) -> StreamTrace:
        trace = StreamTrace(sent=time.perf_counter())
        for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, top_k=1,
                                           stream=True, logits_processor=processors):
            choices = chunk.get("choices") or [{}]
            if choices[0].get("finish_reason") is None:  # the closing chunk carries no token
                trace.token_times.append(time.perf_counter())
                trace.tokens += 1
        return trace

    one(WARM_PROMPT, 4)
    prompts = make_prompts(workload.naive_requests)
    t0 = time.perf_counter()
    traces = [one(p, workload.max_tokens) for p in prompts]
    wall = time.perf_counter() - t0
    return from_traces("llama-cpp-python", 1, "Q4_1", traces, wall)


def run_peers(workload: Workload) -> tuple[list[RunResult], int]:
    """Every peer the workload asks for; also returns the fp32 weight bytes of the model."""
    results: list[RunResult] = []
    model, tok = load_hf("float32")
    fp32_bytes = weight_bytes(model)
    steps: list[tuple[str, Callable[[], RunResult]]] = [("naive", lambda: run_naive(workload, model, tok))]
    if not workload.quick:
        steps += [
            ("static batch", lambda: run_static(workload, model, tok)),
            ("transformers CB fp32", lambda: run_continuous(workload, "float32")),
            ("transformers CB bf16", lambda: run_continuous(workload, "bfloat16")),
            ("llama-cpp-python", lambda: run_llama_cpp(workload)),
        ]
    for name, step in steps:
        if name.endswith("bf16") and not native_bf16():
            log.info("peer %s skipped: this CPU has no native bf16 (dtype auto runs float32 here)", name)
            results.append(RunResult(system=name, concurrency=0,
                                     note="skipped: no native bf16 on this CPU (emulated, minutes a run)"))
            continue
        log.info("peer: %s", name)
        try:
            res = step()
        except Exception as exc:  # one broken peer must not sink the whole run
            log.exception("peer %s failed", name)
            res = RunResult(system=name, concurrency=0, note=f"failed: {type(exc).__name__}: {exc}")
        log.info("peer %s: %s", name, res.summary())
        results.append(res)
    return results, fp32_bytes
