"""Which CPU cores the engine's torch threads run on, and which are left to everything else.

On CPU the engine runs ``cpuThreads`` torch threads and shares the machine with
tritonserver, the adapter, the Python stub's other threads and often the clients.

- With the fused CPU kernels (``ModelConfig.cpuKernels`` ``auto`` and a C compiler), a
  layer is four matmuls and five kernel calls, so a step has few thread barriers and
  the engine takes every core, unpinned. Measured through the whole stack
  on a 2-core AVX2 EPYC, alternating stacks, float32: 2 threads against 1 pinned gave
  98-99 against 72-73 tok/s at 32 streams, 61-67 against 44-48 at 8, and a p50 TTFT of
  115-118 against 191-195 ms at 1 stream (an earlier session: 109-110 against 78-81).
- On the torch path (~45 ATen ops per layer, each a barrier for a thread team), the
  default is cores - 1. With ``ModelConfig.cpuAffinity`` ``auto`` (the default), the
  engine thread (and the intra-op threads it starts) is pinned to the last
  ``cpuThreads`` cores of the process's CPU set, and everything else to the cores
  before them, so the engine never waits in the run queue behind the rest of the
  stack. Measured on 2 cores at 32 streams, ten alternating pairs: 301 tok/s pinned
  against 272 unpinned (means).

The launcher applies the same split to tritonserver and the adapter and passes the
engine's cores to the stub in ``$MINDIE_ENGINE_CPUS``. This module imports no torch, so
the launcher can use it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

ENGINE_CPUS_ENV = "MINDIE_ENGINE_CPUS"  # comma-separated CPU ids for the engine, e.g. "1" or "2,3"
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
T = TypeVar("T")


@dataclass(frozen=True)
class CoreSplit:
    engine: tuple[int, ...]  # the engine thread and its intra-op threads
    rest: tuple[int, ...]  # every other thread: tritonserver, the adapter, the stub's other threads

    def env_value(self) -> str:
        return ",".join(map(str, self.engine))


def available_cpus() -> list[int]:
    """The CPUs this thread may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_quota(cgroup: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU time this process's cgroup may use, in cores (CFS quota ÷ period, cgroup v2
    or v1); ``None`` when unlimited or unknown. A container limited to 4 CPUs on a 64-core
    node still sees 64 CPUs in its affinity mask."""
    try:
        v2 = cgroup / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = cgroup / "cpu"
        if (v1 / "cpu.cfs_quota_us").is_file():
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return None


def usable_cores() -> int:
    """CPUs this thread may run on, capped by the cgroup's CPU quota (rounded up)."""
    cores = len(available_cpus())
    quota = cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"1"``, ``"2,3"`` or ``"4-7"`` (ranges allowed) -> sorted CPU ids; ``ValueError`` if malformed."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _RANGE.fullmatch(part)
        if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return tuple(sorted(cpus))


def _engine_cpus_from_env() -> tuple[int, ...]:
    text = os.environ.get(ENGINE_CPUS_ENV, "").strip()
    if not text:
        return ()
    try:
        return parse_cpus(text)
    except ValueError:
        log.warning("ignoring $%s=%r: not a list of CPU ids", ENGINE_CPUS_ENV, text)
        return ()


def c_compiler() -> str | None:
    """The C compiler the fused CPU kernels are built with (``$CC``, else ``cc``, else ``gcc``)."""
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def fused_kernels_expected(cpu_kernels: str) -> bool:
    """Whether the engine will run the fused CPU kernels: ``ModelConfig.cpuKernels`` and a compiler."""
    return cpu_kernels == "auto" and c_compiler() is not None


def select_cpu_threads(setting: int, fused: bool = False) -> int:
    """torch's intra-op threads on CPU: the setting, else ``$OMP_NUM_THREADS``, else one per
    core of ``$MINDIE_ENGINE_CPUS``, else every core with the fused kernels (``fused``) and
    cores - 1 without them (cores: :func:`usable_cores`).

    The engine shares the machine with tritonserver, the adapter and often the clients.
    When one of them takes a core in the middle of an op, a thread team spanning every
    core waits for it at each barrier (on 2 cores, a float32 softmax took 1.2-8 ms with
    2 threads against 21 us with 1), so on the torch path, with its ~45 ops per layer, one
    core is left to them. The fused path has a tenth of the barriers and gains more from
    the extra core than it loses to them (see the module's docstring).
    """
    if setting:
        return setting
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    given = _engine_cpus_from_env()
    if given:
        return len(given)
    return usable_cores() if fused else max(1, usable_cores() - 1)


def split_cores(threads: int, cpus: list[int]) -> CoreSplit | None:
    """The last ``threads`` of ``cpus`` for the engine, the others for the rest; ``None``
    when the engine would take every core (then nothing is pinned)."""
    cpus = sorted(cpus)
    if threads < 1 or threads >= len(cpus):
        return None
    return CoreSplit(tuple(cpus[-threads:]), tuple(cpus[:-threads]))


def instance_count(model_config: dict) -> int:
    """How many instances of a model Triton runs (each builds an engine), from its config
    as JSON: the ``instance_group`` counts, 1 when the config names none."""
    groups = model_config.get("instance_group") or [{}]
    return sum(int(g.get("count", 1)) for g in groups)


def plan_split(mode: str, threads_setting: int, instances: int = 1, fused: bool = False) -> CoreSplit | None:
    """The split for ``ModelConfig.cpuAffinity`` = ``mode``; ``None`` means pin nothing.

    Nothing is pinned when the mode is ``off``, or when several model instances would
    share the engine's cores. ``$MINDIE_ENGINE_CPUS``, when set, names the engine's cores;
    the rest are then the CPUs of this process outside them.
    """
    if mode == "off" or instances != 1:
        return None
    cpus = available_cpus()
    given = _engine_cpus_from_env()
    if given:
        rest = tuple(c for c in cpus if c not in given)
        return CoreSplit(given, rest) if rest else None
    return split_cores(select_cpu_threads(threads_setting, fused), cpus)


def pin_current_thread(cpus: tuple[int, ...], what: str) -> bool:
    """Restrict the calling thread (and the threads it creates later) to ``cpus``."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError, ValueError) as exc:  # e.g. a container's cpuset forbids them
        log.warning("could not pin %s to CPUs %s: %s", what, list(cpus), exc)
        return False
    return True


def in_a_passing_thread(fn: Callable[..., T], *args, name: str = "llm-load") -> T:
    """Run ``fn(*args)`` in a thread that ends when it returns; return its result or raise its exception.

    libgomp gives every thread that opens a parallel region its own pool of OpenMP workers,
    kept until that thread exits. Once a process has more of them than CPUs, every worker
    goes to sleep as soon as a region ends instead of spinning, and each region after that
    waits for a wake-up. Loading the model opens regions (weight reorders, probes), so when
    it ran in the caller's thread and the engine then ran in its own, a 2-core VM had three
    managed threads: a fused kernel call at 32 rows took ~100 us where it took ~10 with one
    pool, matmuls ~25% longer, and a step ~25 ms more. Work done here frees its pool when
    the thread ends, so the engine thread's pool is the only one."""
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args))
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
