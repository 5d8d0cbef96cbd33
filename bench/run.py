"""One benchmark run on one machine: limits, the stack, the engine alone and the peers.

    python -m bench.run [--quick] [--out bench/results] [--config conf/config.json] [--llama-server PATH]

1. measures the machine (fp32/bf16 matmul GFLOP/s at 2048³, memory read GB/s), and
   again at the end; the higher reading of each is the limit;
2. starts a private stack (``adapter.launch`` on free ports) and the engine in-process,
   and drives streaming clients at each concurrency through both, taking turns
   (``bench.load.drive``: the stack's overhead);
3. runs the peers (naive ``generate``, static batch, transformers continuous
   batching fp32/bf16, llama-cpp-python when importable, and llama.cpp's
   ``llama-server`` with one slot per stream when a binary is found, driven like
   the stack);
4. prints the tables and writes ``results.csv``, ``checks.csv``, ``summary.json``
   and ``results.png`` into ``--out``.

``--quick`` is a smoke test: concurrency 1 and 4, 8 tokens, naive peer only.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR = REPO_ROOT / "model_repository" / "llm" / "1"

log = logging.getLogger("bench")


def _import_paths() -> None:
    """Make ``adapter`` and ``llm_engine`` importable here and in the launched stack."""
    for p in (str(ENGINE_DIR), str(REPO_ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in (str(REPO_ROOT), str(ENGINE_DIR)):
        if p not in parts:
            parts.append(p)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (c=1,4; 8 tokens; naive peer)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results", help="output folder")
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "conf" / "config.json",
                        help="settings file to copy for the bench's own stack (ports are replaced)")
    parser.add_argument("--llama-server", default=None,
                        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, the make bench-peers "
                             "build, then PATH; skipped when none is found)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    for noisy in ("httpx", "httpcore", "ContinuousBatchingLogger"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _import_paths()

    from llm_engine.cpu_cores import in_a_passing_thread

    from bench.cpu import CpuMeter, cpu_table
    from bench.engine_alone import engine_alone
    from bench.llama_server import SYSTEM as LLAMA_SERVER
    from bench.llama_server import find_binary, run_llama_server
    from bench.load import clients_on, drive_stack_and_engine
    from bench.machine import measure
    from bench.peers import run_peers
    from bench.report import (
        checks_table,
        compare,
        machine_table,
        plot,
        results_table,
        write_checks_csv,
        write_csv,
    )
    from bench.stack import Stack, descendants
    from bench.stats import STACK, RunResult
    from bench.workload import FULL, QUICK

    if args.llama_server:
        find_binary(args.llama_server)  # a wrong path fails now, not after the rest of the run
    workload = QUICK if args.quick else FULL
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone()
    t0 = time.monotonic()
    load_start = os.getloadavg()
    log.info("workload: %s; load average %.2f", workload, load_start[0])

    # The probes' OpenMP workers must not outlive them: with a second pool beside the engine's
    # (the engine alone runs in this process), libgomp stops spinning and every region waits.
    machine = in_a_passing_thread(measure, workload.quick)
    results = []
    with Stack(out / "stack.log", args.config) as stack:
        stack_dtype, dtype_auto = stack.engine_dtype(), stack.dtype_decision()
        stack_threads = stack.engine_threads()
        log.info("the stack's engine runs %s (%s)", stack_dtype or "an unknown dtype (no 'engine ready' log line)",
                 dtype_auto or "dtype set in the settings")
        with engine_alone(args.config, stack_dtype) as alone, clients_on(stack.rest_cpus()):
            weight_bytes = alone.weight_bytes_per_token
            meter = CpuMeter(lambda: [stack.proc.pid, *descendants(stack.proc.pid)])
            results += asyncio.run(drive_stack_and_engine(stack.base_url, stack.model_name, alone.send, workload,
                                                          stack_dtype, meter))
    gc.collect()
    peer_results, fp32_bytes = run_peers(workload)
    results += peer_results
    if not workload.quick:
        log.info("peer: llama-server")
        try:
            results += run_llama_server(workload, out / "llama-server.log", args.llama_server)
        except Exception as exc:  # a broken peer must not sink the whole run
            log.exception("peer llama-server failed")
            results.append(RunResult(system=LLAMA_SERVER, concurrency=0, note=f"failed: {exc}"))

    machine_start, machine_end = machine, in_a_passing_thread(measure, workload.quick)  # again, after the systems ran
    machine = machine_start.best_of(machine_end)
    checks = compare(results, machine, fp32_bytes, weight_bytes)
    write_csv(out / "results.csv", results)
    write_checks_csv(out / "checks.csv", checks)
    title = f"{started:%Y-%m-%d} {machine.cpu_model}, {machine.cores} cores" + (" (quick)" if args.quick else "")
    plot(out / "results.png", results, title)
    load_end = os.getloadavg()
    stack_cpu = {r.concurrency: r.cpu for r in results if r.system == STACK and r.cpu}
    summary = {"date": started.isoformat(timespec="seconds"), "duration_s": round(time.monotonic() - t0, 1),
               "loadavg_1m_start": load_start[0], "loadavg_1m_end": load_end[0],
               "stack_dtype": stack_dtype, "stack_dtype_auto": dtype_auto, "stack_torch_threads": stack_threads,
               "machine": machine.as_dict(), "machine_probes": [machine_start.as_dict(), machine_end.as_dict()],
               "workload": asdict(workload), "fp32_weight_bytes": fp32_bytes, "weight_bytes_per_token": weight_bytes,
               "results": [r.summary() for r in results],
               "stack_cpu": {str(c): groups for c, groups in stack_cpu.items()},
               "checks": [{"name": c.name, "value": c.value, "target": c.target, "status": c.status,
                           "detail": c.note} for c in checks]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))

    print(f"\n## Bench {started:%Y-%m-%d %H:%M %Z}: {title}\n")
    print(machine_table(machine), end="\n\n")
    print(f"1-minute load average: {load_start[0]:.2f} at start, {load_end[0]:.2f} at end "
          f"(other work on the machine skews every number)\n")
    print(results_table(results), end="\n\n")
    print(checks_table(checks), end="\n\n")
    if stack_cpu:
        print("CPU of the stack's processes during its turns (% of one core; CPU ms per output token):\n")
        print(cpu_table(stack_cpu), end="\n\n")
    failed = sum(r.errors for r in results)
    if failed:
        log.warning("%d requests failed (see the logs above and %s): the affected rows are not valid",
                    failed, out / "stack.log")
    print(f"written: {out / 'results.csv'}, {out / 'checks.csv'}, {out / 'summary.json'}, "
          f"{out / 'results.png'} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
