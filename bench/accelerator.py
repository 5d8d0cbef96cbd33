"""The engine on an accelerator (CUDA or Ascend NPU) against transformers on the same device.

    python -m bench.accelerator [--out bench/results-accelerator] [--config conf/config.json] [--quick]

The CPU bench (``bench.run``) needs the whole stack; this one measures what changes on an
accelerator, the engine's own loop, with no Triton: the engine alone (in-process, as in
``bench.run``) at 1, 8, 32 and 128 streams, then on the same device and dtype the naive
per-request ``generate``, one static ``generate`` batch, and transformers' continuous
batching (``generate_batch``). Every system greedy-decodes 64 tokens per request with EOS
ignored. It prints the device's limits (bf16 matmul TFLOP/s, copy GB/s), the results and
the engine's ratios over each peer at 32 streams, and writes ``results.csv`` and
``results.png`` into ``--out``. ``--quick --device cpu`` is a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import logging
import sys
import time
from pathlib import Path

from bench.run import REPO_ROOT, _import_paths

log = logging.getLogger("bench")

CONCURRENCIES = (1, 8, 32, 128)
COMPARE_AT = 32


def device_limits(device, n: int = 8192) -> dict[str, float]:
    """bf16 matmul TFLOP/s (n³) and device-to-device copy GB/s (bytes read + written)."""
    import torch
    from llm_engine.device import synchronize

    def timed(fn, repeats: int) -> float:
        for _ in range(3):
            fn()
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize(device)
        return (time.perf_counter() - t0) / repeats

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    tflops = 2 * n**3 / timed(lambda: a @ b, 10) / 1e12
    src = torch.empty(n * n * 16, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / timed(lambda: dst.copy_(src), 10) / 1e9
    return {"bf16_matmul_tflops": round(tflops, 1), "copy_gb_s": round(copy_gbs, 1)}


def ratios(results, at: int) -> list[tuple[str, float]]:
    from bench.stats import ENGINE

    engine = next((r for r in results if r.system == ENGINE and r.concurrency == at), None)
    out = []
    for r in results:
        if r.system != ENGINE and not r.skipped and r.tok_per_s and engine is not None:
            out.append((f"{ENGINE} @{at} / {r.system} @{r.concurrency}", engine.tok_per_s / r.tok_per_s))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.accelerator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results-accelerator")
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "conf" / "config.json")
    parser.add_argument("--device", default="auto", choices=("auto", "npu", "cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (c=1,4; 8 tokens; small matmuls)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    _import_paths()

    import torch
    from llm_engine.device import select_device

    from bench.engine_alone import engine_alone
    from bench.load import drive
    from bench.peers import load_hf, run_continuous, run_naive, run_static
    from bench.report import plot, results_table, write_csv
    from bench.stats import ENGINE
    from bench.workload import QUICK, Workload

    device = select_device(args.device)
    if device.type == "cpu" and args.device != "cpu":
        log.error("no accelerator: torch sees neither an Ascend NPU nor CUDA (the CPU bench is bench.run)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    dtype = "bfloat16"
    workload = QUICK if args.quick else Workload(concurrencies=CONCURRENCIES, staggered=())
    compare_at = max(workload.concurrencies) if args.quick else COMPARE_AT
    args.out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone()
    t0 = time.monotonic()
    limits = device_limits(device, 1024 if args.quick else 8192)
    log.info("%s: %s", name, limits)

    with engine_alone(args.config, dtype) as alone:
        results = asyncio.run(drive({ENGINE: alone.send}, workload, dtype))
    gc.collect()
    model, tok = load_hf(dtype, device=str(device))
    results += [run_naive(workload, model, tok), run_static(workload, model, tok)]
    del model
    gc.collect()
    results.append(run_continuous(workload, dtype, device=str(device)))

    write_csv(args.out / "results.csv", results)
    title = f"{started:%Y-%m-%d} {name}, torch {torch.__version__}"
    plot(args.out / "results.png", results, title)
    found = ratios(results, compare_at)
    summary = {"date": started.isoformat(timespec="seconds"), "device": name, "torch": torch.__version__,
               "limits": limits, "results": [r.summary() for r in results],
               "ratios": {k: round(v, 2) for k, v in found}, "duration_s": round(time.monotonic() - t0, 1)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n## Accelerator bench {started:%Y-%m-%d %H:%M %Z}: {title}\n")
    print(f"bf16 matmul {limits['bf16_matmul_tflops']} TFLOP/s, device copy {limits['copy_gb_s']} GB/s\n")
    print(results_table(results), end="\n\n")
    print("| ratio | value |\n|---|---:|")
    for label, value in found:
        print(f"| {label} | {value:.2f}x |")
    print(f"\nwritten: {args.out} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
