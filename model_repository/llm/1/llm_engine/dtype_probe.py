"""``dtype: auto`` on CPU: time fp32 against bf16 Linear layers once per machine, remember the verdict.

On one CPU fp32 wins; on another (AVX512_BF16, AMX) bf16 Linear layers run 2-3x faster.
The probe times the kernels the runner will use: with the fused CPU kernels, bf16 on
their AMX or AVX512-BF16 Linear where the CPU has one, and fp32 on the faster of torch's
two kernels (:func:`~.linear.choose_fp32_kernels` picks the same way).
The model instances of one server load at the same time, and two probes running side by
side on a small machine each read the other's load (one read 232 ms for both dtypes where
the quiet probe read 17). They then picked different dtypes, and a seeded request's text
depended on which instance ran it. So the probe runs under a lock in the cache directory,
and its verdict is kept there, keyed by what decides it (CPU, torch build, threads,
layer shape): every instance and every restart on the machine uses the same dtype.
Delete the verdict file, or set ``dtype`` explicitly, to decide again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from pathlib import Path

import torch

from . import cpu_ops
from .linear import make_linear
from .weights import cache_lock, cache_root

log = logging.getLogger(__name__)

VERDICTS = "dtype-auto.json"
PROBE_VERSION = 3  # in the key: a verdict of an older probe is measured again
MAX_VERDICTS = 32  # the newest kept: keys change with every kernel build, torch release and thread count
_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_dtype(hidden: int, inter: int, fused: bool = False) -> torch.dtype:
    """The faster of fp32 and bf16 for a ``hidden`` x ``inter`` Linear at 16 rows on this machine,
    with the fused CPU kernels' Linears when ``fused`` (the runner will load them)."""
    fused = fused and cpu_ops.load(torch.bfloat16) is not None  # a verdict on torch's path is not one on these
    key = machine_key(hidden, inter, fused)
    path = cache_root() / VERDICTS
    try:
        with cache_lock("dtype-auto"):
            verdicts = _read(path)
            known = verdicts.get(key)
            if known and known.get("dtype") in _NAMES:
                log.info("dtype auto: %s, as measured on this machine before (fp32 %.2f ms, bf16 %.2f ms "
                         "per 30 Linear calls; delete %s to measure again)", known["dtype"],
                         known.get("fp32_ms", float("nan")), known.get("bf16_ms", float("nan")), path)
                return _NAMES[known["dtype"]]
            best, timings = _measure(hidden, inter, fused)
            verdicts[key] = {"dtype": str(best).removeprefix("torch."),
                             "fp32_ms": round(timings[torch.float32] * 1e3, 3),
                             "bf16_ms": round(timings[torch.bfloat16] * 1e3, 3),
                             "measured_at": round(time.time())}
            _write(path, _newest(verdicts))
            log.info("dtype auto: kept in %s", path)
            return best
    except OSError as exc:  # a read-only cache: measure, and keep nothing
        log.warning("dtype auto: the cache directory is not usable (%s); instances loading together "
                    "may measure each other's load", exc)
        return _measure(hidden, inter, fused)[0]


def _measure(hidden: int, inter: int, fused: bool) -> tuple[torch.dtype, dict[torch.dtype, float]]:
    timings = time_linears(hidden, inter, cpu_ops.load(torch.bfloat16) if fused else None)
    best = min(timings, key=timings.get)
    log.info("dtype auto: fp32 %.2f ms, bf16 %.2f ms per 30 Linear calls -> %s",
             timings[torch.float32] * 1e3, timings[torch.bfloat16] * 1e3, str(best).removeprefix("torch."))
    return best, timings


PROBE_WEIGHT_BYTES = 96 * 2**20  # the probe's fp32 weights in all: more than a CPU's last-level cache
PROBE_CALLS = 30  # Linear calls per timed round (the verdicts' "per 30 Linear calls")


def probe_weights(hidden: int, inter: int) -> int:
    """How many distinct ``inter x hidden`` weights the probe cycles through: enough that
    their fp32 form (at least :data:`PROBE_WEIGHT_BYTES`) does not stay in cache, as the
    model's weights do not; at least 2, and at most one per call of a round."""
    return max(2, min(PROBE_CALLS, -(-PROBE_WEIGHT_BYTES // (hidden * inter * 4))))


def time_linears(hidden: int, inter: int, ops=None) -> dict[torch.dtype, float]:
    """Best of five interleaved rounds of :data:`PROBE_CALLS` calls at 16 rows, in seconds, per dtype.

    It times the kernels the runner will use (:func:`make_linear`): bf16 on ``ops``'s
    Linear (:class:`~.cpu_ops.CpuOps`, the fused kernels) where it fits, else oneDNN's
    prepacked kernel; fp32 on both of torch's kernels, keeping the faster. The calls cycle through
    :func:`probe_weights` distinct weights, read from memory as a decode step reads the
    model's: one weight called 30 times stays in cache, and on a 2-core Xeon that timing
    called fp32 5% faster (11.8 against 12.4 ms) where the engine ran bf16 1.6x faster
    (44.6 against 28 tokens/s at one stream).
    """
    if ops is not None:
        ops.set_threads(torch.get_num_threads())  # as the runner's forward does
    weights = [torch.randn(inter, hidden) * hidden**-0.5 for _ in range(probe_weights(hidden, inter))]
    fp32 = [make_linear(w) for w in weights]  # Fp32Linear on CPU: plain, and prepacked where oneDNN has it
    candidates = [(torch.bfloat16, [make_linear(w.bfloat16(), None, ops) for w in weights]),
                  (torch.float32, [getattr(lin, "plain", lin) for lin in fp32])]
    if all(getattr(lin, "packed", None) is not None for lin in fp32):
        candidates.append((torch.float32, [lin.prepacked for lin in fp32]))
    del weights
    best = [float("inf")] * len(candidates)
    with torch.inference_mode():
        for _ in range(5):  # interleaved, so a busy moment does not decide
            for j, (dt, lins) in enumerate(candidates):
                x = torch.randn(16, hidden, dtype=dt)
                lins[-1](x)
                t0 = time.perf_counter()
                for i in range(PROBE_CALLS):
                    lins[i % len(lins)](x)
                best[j] = min(best[j], time.perf_counter() - t0)
    timings = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for (dt, _), t in zip(candidates, best):
        timings[dt] = min(timings[dt], t)
    return timings


def machine_key(hidden: int, inter: int, fused: bool = False) -> str:
    """What the verdict depends on: the CPU (model and flags), torch's build, threads, shape, the
    fused kernels (the build of them that loaded: a change to their code is measured again), and
    the probe."""
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("flags")), "")
        cpu = f"{model} {hashlib.sha1(' '.join(sorted(flags.split())).encode()).hexdigest()[:12]}"
    except OSError:
        pass
    return (f"{cpu} | torch {torch.__version__} | threads {torch.get_num_threads()} | {hidden}x{inter}"
            f"{f' | fused kernels {cpu_ops.library_id()}' if fused else ''} | probe {PROBE_VERSION}")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _newest(verdicts: dict, keep: int = MAX_VERDICTS) -> dict:
    """The ``keep`` most recently measured verdicts (entries written before ``measured_at``
    existed count as oldest)."""
    def when(item) -> float:
        value = item[1].get("measured_at") if isinstance(item[1], dict) else None
        return value if isinstance(value, (int, float)) else 0
    return dict(sorted(verdicts.items(), key=when, reverse=True)[:keep])


def _write(path: Path, verdicts: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(verdicts, indent=2, sort_keys=True))
    tmp.replace(path)
