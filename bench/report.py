"""Ratios against the targets of shared/spec/performance.md, the printed tables, CSV and plot."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench.llama_server import SYSTEM as LLAMA_SERVER
from bench.machine import GFLOP_PER_TOKEN, MachineInfo
from bench.stats import ENGINE, STACK, STAGGERED, RunResult, percentile, ratio

CSV_FIELDS = ["system", "dtype", "concurrency", "requests", "output_tokens", "wall_s", "tok_per_s",
              "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors", "note"]


@dataclass
class Check:
    """One line of the comparison: a measured value against its target (``ok`` None = no target)."""

    name: str
    value: float
    unit: str  # "x", "%" or "ms"
    target: str
    ok: bool | None
    note: str = ""

    def shown(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        if self.unit == "x":
            return f"{self.value:.2f}x"
        if self.unit == "%":
            return f"{self.value:.0f}%"
        return f"{self.value:+.1f} ms" if self.unit == "ms+" else f"{self.value:.1f} {self.unit}"

    @property
    def status(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        if self.ok is None:
            return "-"
        return "PASS" if self.ok else "FAIL"


def find(results: Iterable[RunResult], system: str, concurrency: int | None = None,
         dtype: str | None = None) -> RunResult | None:
    for r in results:
        if r.system == system and not r.skipped and (concurrency is None or r.concurrency == concurrency) \
                and (dtype is None or r.dtype == dtype):
            return r
    return None


def _tps(r: RunResult | None) -> float:
    return r.tok_per_s if r is not None else math.nan


def _ttft50(r: RunResult | None) -> float:
    return percentile(r.ttft_s, 50) if r is not None else math.nan


def _at_least(name: str, value: float, target: float, unit: str = "x", note: str = "") -> Check:
    ok = None if math.isnan(value) else value >= target
    shown = f">= {target:g}x" if unit == "x" else f">= {target:g}%"
    return Check(name, value, unit, shown, ok, note)


def weight_bytes_for(dtype: str, fp32_bytes: int) -> int:
    return fp32_bytes // 2 if dtype in ("bfloat16", "float16") else fp32_bytes


def compare(results: list[RunResult], machine: MachineInfo, fp32_weight_bytes: int,
            weight_bytes: int | None = None) -> list[Check]:
    """Every target of the spec that this run can judge. ``weight_bytes``: what one token reads
    of the weights in the format the engine loaded (GGUF Q4_1 blocks read fewer than the
    dtype's size); by default the fp32 checkpoint's size scaled to the stack's dtype."""
    stack = [r for r in results if r.system == STACK and not r.skipped]
    if not stack:
        return []
    top = max(r.concurrency for r in stack)
    mid = 8 if find(results, STACK, 8) else top
    s_top, s_one = find(results, STACK, top), find(results, STACK, 1)
    dtype = s_top.dtype if s_top else ""
    checks = [
        _at_least(f"stack@{top} / naive generate", ratio(_tps(s_top), _tps(find(results, "naive generate"))), 10),
        _at_least(f"stack@{top} / static batch", ratio(_tps(s_top), _tps(find(results, "static batch"))), 1.5),
    ]
    for dt in ("float32", "bfloat16"):
        cb = find(results, "transformers CB", dtype=dt)
        same = dt == dtype
        checks.append(Check(f"stack@{top} / transformers CB {dt}", ratio(_tps(s_top), _tps(cb)), "x",
                            ">= 2x" if same else "(other dtype)",
                            None if not same or cb is None else ratio(_tps(s_top), _tps(cb)) >= 2))
    checks.append(_at_least(f"stack@{top} / llama-cpp-python (1 stream)",
                            ratio(_tps(s_top), _tps(find(results, "llama-cpp-python"))), 3))
    checks.append(_at_least(f"stack@{top} / llama-server@{top}",
                            ratio(_tps(s_top), _tps(find(results, LLAMA_SERVER, top))), 1))
    flops = _tps(s_top) * GFLOP_PER_TOKEN
    checks.append(_at_least(f"stack@{top} % of {dtype or '?'} matmul roofline",
                            100 * ratio(flops, machine.roofline(dtype)), 50, "%",
                            f"{flops:.1f} of {machine.roofline(dtype):.0f} GFLOP/s"))
    wbytes = weight_bytes or weight_bytes_for(s_one.dtype if s_one else dtype, fp32_weight_bytes)
    limit = machine.mem_read_gbs * 1e9 / wbytes if wbytes else math.nan
    checks.append(_at_least("stack@1 % of memory-bound limit", 100 * ratio(_tps(s_one), limit), 70, "%",
                            f"limit {limit:.0f} tok/s = {machine.mem_read_gbs:.1f} GB/s / {wbytes / 1e6:.0f} MB"))
    llama = find(results, "llama-cpp-python")
    checks.append(_at_least("stack@1 / llama-cpp-python (stretch)", ratio(_tps(s_one), _tps(llama)), 1))
    checks.append(_at_least("stack@1 / llama-server@1 (stretch)",
                            ratio(_tps(s_one), _tps(find(results, LLAMA_SERVER, 1))), 1))
    for c in sorted({r.concurrency for r in stack}):
        eng = find(results, ENGINE, c)
        loss = 100 * (1 - ratio(_tps(find(results, STACK, c)), _tps(eng)))
        checks.append(Check(f"stack overhead, throughput @{c}", loss, "%", "< 5%",
                            None if math.isnan(loss) else loss < 5))
    added = 1e3 * (_ttft50(s_one) - _ttft50(find(results, ENGINE, 1)))
    checks.append(Check("stack overhead, p50 TTFT @1", added, "ms+", "< +2 ms",
                        None if math.isnan(added) else added < 2))
    ttft_ratio = ratio(_ttft50(find(results, STACK, mid)), _ttft50(s_one))
    checks.append(Check(f"stack p50 TTFT @{mid} / @1", ttft_ratio, "x", "<= 2x",
                        None if math.isnan(ttft_ratio) else ttft_ratio <= 2))
    peer = ratio(_ttft50(find(results, LLAMA_SERVER, mid)), _ttft50(find(results, LLAMA_SERVER, 1)))
    checks.append(Check(f"llama-server p50 TTFT @{mid} / @1", peer, "x", "(the peer, for reference)", None))
    # the same target with arrivals spread out: each newcomer finds the others decoding
    spread = ratio(_ttft50(find(results, f"{STACK} {STAGGERED}", mid)), _ttft50(s_one))
    checks.append(Check(f"stack p50 TTFT @{mid} {STAGGERED} / @1", spread, "x", "<= 2x",
                        None if math.isnan(spread) else spread <= 2))
    peer = ratio(_ttft50(find(results, f"{LLAMA_SERVER} {STAGGERED}", mid)), _ttft50(find(results, LLAMA_SERVER, 1)))
    checks.append(Check(f"llama-server p50 TTFT @{mid} {STAGGERED} / @1", peer, "x", "(the peer, for reference)",
                        None))
    return checks


def _fmt(v: object) -> str:
    return "" if v is None else str(v)


def results_table(results: list[RunResult]) -> str:
    """Markdown table of every measured system (skipped peers show their reason)."""
    head = "| system | dtype | streams | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | note |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        s = r.summary()
        if r.skipped:
            lines.append(f"| {r.system} | {r.dtype} | | skipped | | | | | {r.note} |")
            continue
        note = "; ".join(x for x in (r.note, f"{r.errors} errors" if r.errors else "") if x)
        lines.append(f"| {r.system} | {r.dtype} | {r.concurrency} | {_fmt(s['tok_per_s'])} | "
                     f"{_fmt(s['ttft_p50_ms'])} | {_fmt(s['ttft_p99_ms'])} | {_fmt(s['itl_p50_ms'])} | "
                     f"{_fmt(s['itl_p99_ms'])} | {note} |")
    return "\n".join(lines)


def checks_table(checks: list[Check]) -> str:
    lines = ["| comparison | measured | target | status | detail |", "|---|---:|---|---|---|"]
    lines += [f"| {c.name} | {c.shown()} | {c.target} | {c.status} | {c.note} |" for c in checks]
    return "\n".join(lines)


def machine_table(m: MachineInfo) -> str:
    return (f"| CPU | cores | torch threads | fp32 matmul GFLOP/s | bf16 matmul GFLOP/s | memory read GB/s |\n"
            f"|---|---:|---:|---:|---:|---:|\n"
            f"| {m.cpu_model} | {m.cores} | {m.torch_threads} | {m.fp32_gflops:.0f} | {m.bf16_gflops:.0f} | "
            f"{m.mem_read_gbs:.1f} |")


def write_csv(path: Path, results: list[RunResult]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow(r.summary())


def write_checks_csv(path: Path, checks: list[Check]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["comparison", "value", "unit", "target", "status", "detail"])
        for c in checks:
            writer.writerow([c.name, "" if math.isnan(c.value) else round(c.value, 4), c.unit.rstrip("+"),
                             c.target, c.status, c.note])


def plot(path: Path, results: list[RunResult], title: str = "") -> None:
    """Throughput and p50 TTFT against concurrency: lines for stack/engine, markers for peers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.8))
    measured = [r for r in results if not r.skipped and r.concurrency > 0]
    markers = iter("osD^v<>ph*")
    for system in dict.fromkeys(r.system for r in measured):
        for dtype in dict.fromkeys(r.dtype for r in measured if r.system == system):
            rows = sorted((r for r in measured if r.system == system and r.dtype == dtype),
                          key=lambda r: r.concurrency)
            xs = [r.concurrency for r in rows]
            label = f"{system} ({dtype})" if dtype else system
            style = "-" if system in (STACK, ENGINE) else "--" if len(rows) > 1 else ""
            marker = next(markers, "o")
            ax_t.plot(xs, [r.tok_per_s for r in rows], style, marker=marker, label=label)
            ax_l.plot(xs, [1e3 * percentile(r.ttft_s, 50) for r in rows], style, marker=marker, label=label)
    ticks = sorted({r.concurrency for r in measured})
    for ax in (ax_t, ax_l):
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("output tokens/s (total)")
    ax_t.set_title("throughput")
    ax_l.set_ylabel("p50 time to first token (ms)")
    ax_l.set_yscale("log")
    ax_l.set_title("TTFT")
    ax_t.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
