"""Where the CPU goes while the stack serves: CPU seconds per process group, from /proc.

The stack's overhead against the engine alone is mostly CPU taken from the engine's
cores (bench/README.md). The bench reads each group's CPU time around every turn of
the stack, so each run says how much of a core the adapter, tritonserver, the model's
stub and the bench's own clients took at each concurrency.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

CLIENTS = "clients (the bench process)"
GROUP_ORDER = ("adapter", "tritonserver", "stub", "launcher", CLIENTS)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_of(cmdline: str) -> str:
    """A stack process's group, from its command line."""
    if "triton_python_backend_stub" in cmdline:
        return "stub"
    if "tritonserver" in cmdline.split(" ", 1)[0]:
        return "tritonserver"
    if "adapter.launch" in cmdline:
        return "launcher"
    if "-m adapter" in cmdline:
        return "adapter"
    return "other"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CpuMeter:
    """CPU seconds per group of the processes ``pids()`` names, and of this process.

    ``pids`` is asked at every reading, so a restarted stub is still counted (the CPU of
    a process that ended between two readings is lost).
    """

    def __init__(self, pids: Callable[[], list[int]]):
        self.pids = pids

    def read(self) -> dict[str, dict[int, float]]:
        groups: dict[str, dict[int, float]] = {}
        for pid in self.pids():
            groups.setdefault(group_of(_cmdline(pid)), {})[pid] = cpu_seconds(pid)
        groups[CLIENTS] = {os.getpid(): cpu_seconds(os.getpid())}
        return groups

    @staticmethod
    def spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
        """CPU seconds each group spent between two readings (a process new since ``before`` counts from 0)."""
        return {group: sum(t - before.get(group, {}).get(pid, 0.0) for pid, t in procs.items())
                for group, procs in after.items()}


def shares(cpu_s: dict[str, float], wall_s: float, tokens: int) -> dict[str, dict[str, float]]:
    """Per group: percent of one core over ``wall_s``, and CPU milliseconds per output token."""
    return {group: {"core_pct": round(100 * s / wall_s, 1) if wall_s > 0 else 0.0,
                    "ms_per_token": round(1000 * s / tokens, 3) if tokens else 0.0}
            for group, s in sorted(cpu_s.items(), key=lambda kv: _rank(kv[0]))}


def _rank(group: str) -> int:
    return GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)


def cpu_table(per_level: dict[int, dict[str, dict[str, float]]]) -> str:
    """Markdown: each group's share of a core and CPU per token during the stack's turns, per concurrency."""
    groups = sorted({g for level in per_level.values() for g in level}, key=_rank)
    head = "| streams | " + " | ".join(groups) + " |"
    lines = [head, "|---:|" + "---:|" * len(groups)]
    for c, level in sorted(per_level.items()):
        cells = [f"{level[g]['core_pct']}% ({level[g]['ms_per_token']} ms/tok)" if g in level else ""
                 for g in groups]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
