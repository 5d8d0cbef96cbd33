"""The machine's limits, measured in the same run: matmul roofline and memory read bandwidth."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Forward cost of SmolLM2-135M per generated token (about 2 x parameters), GFLOP.
GFLOP_PER_TOKEN = 0.27


@dataclass
class MachineInfo:
    cpu_model: str
    cores: int
    torch_threads: int
    fp32_gflops: float
    bf16_gflops: float
    mem_read_gbs: float

    def roofline(self, dtype: str) -> float:
        """Matmul GFLOP/s of the dtype in use (bf16 for bfloat16, else fp32)."""
        return self.bf16_gflops if dtype.startswith("bf") else self.fp32_gflops

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def best_of(self, other: MachineInfo) -> MachineInfo:
        """The higher of each limit: a limit is what the machine can do, and a busy or slow
        moment during one probe only lowers it (bf16 matmul read 213 GFLOP/s in one run and
        383-417 in the others on the same machine)."""
        return MachineInfo(self.cpu_model, self.cores, self.torch_threads,
                           max(self.fp32_gflops, other.fp32_gflops), max(self.bf16_gflops, other.bf16_gflops),
                           max(self.mem_read_gbs, other.mem_read_gbs))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def matmul_gflops(dtype_name: str, n: int = 2048, min_time: float = 1.0) -> float:
    """Best sustained GFLOP/s of an ``n``³ matmul in ``dtype_name`` ("float32" or "bfloat16")."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    best = float("inf")
    spent, iters = 0.0, 0
    while spent < min_time or iters < 3:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        dt = time.perf_counter() - t0
        best, spent, iters = min(best, dt), spent + dt, iters + 1
    return 2.0 * n**3 / best / 1e9


def memory_read_gbs(mib: int = 512, repeats: int = 8) -> float:
    """Read bandwidth: best time of ``sum()`` over a buffer far larger than the caches."""
    import torch

    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def native_bf16() -> bool:
    """Does this CPU run bf16 matmuls natively (oneDNN's check: AVX512_BF16 or AMX)?
    Without it torch emulates them, 20-100x slower than fp32."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def measure(quick: bool = False) -> MachineInfo:
    import torch

    min_time = 0.3 if quick else 1.0
    # emulated bf16 at 2048^3 takes minutes a call; a 512^3 reading says as much about it
    bf16_n = 2048 if native_bf16() else 512
    info = MachineInfo(
        cpu_model=cpu_model(), cores=os.cpu_count() or 1, torch_threads=torch.get_num_threads(),
        fp32_gflops=matmul_gflops("float32", min_time=min_time),
        bf16_gflops=matmul_gflops("bfloat16", n=bf16_n, min_time=min_time),
        mem_read_gbs=memory_read_gbs(256 if quick else 512),
    )
    log.info("machine: %s, %d cores; matmul fp32 %.0f GFLOP/s, bf16 %.0f GFLOP/s; memory read %.1f GB/s",
             info.cpu_model, info.cores, info.fp32_gflops, info.bf16_gflops, info.mem_read_gbs)
    return info
