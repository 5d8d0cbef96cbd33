"""Device choice behind one small interface: Ascend NPU, else CUDA, else CPU."""

from __future__ import annotations

import importlib
import logging

import torch

from .dtype_probe import cpu_dtype

log = logging.getLogger(__name__)


def npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")  # registers the "npu" device with torch
    except Exception:
        return False
    return hasattr(torch, "npu") and torch.npu.is_available()


def select_device(kind: str = "auto", device_id: int = 0) -> torch.device:
    """``auto`` picks npu (torch_npu importable), then cuda, then cpu."""
    if kind in ("auto", "npu") and npu_available():
        torch.npu.set_device(device_id)
        return torch.device("npu", device_id)
    if kind == "npu":
        raise RuntimeError("device 'npu' requested but torch_npu is not usable")
    if kind in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(device_id)
        # cuDNN's SDPA builds a plan for each new shape, and a decode step's shapes change
        # with every token: on an H200 (torch 2.11) a step took 59 ms at batch 1 with it and
        # 18 ms without (batch 32: 64 ms and 33 ms). Flash / memory-efficient SDPA remain.
        torch.backends.cuda.enable_cudnn_sdp(False)
        return torch.device("cuda", device_id)
    if kind == "cuda":
        raise RuntimeError("device 'cuda' requested but CUDA is not available")
    return torch.device("cpu")


def use_in_this_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current one. A new thread starts on device 0,
    so the engine's own thread would otherwise open a context (and its memory) on the
    first GPU or NPU whatever device its instance was given.

    On CPU, carry torch's intra-op thread count into this thread: OpenMP keeps it per
    thread, and a new one starts at one per CPU, which oneDNN and MKL then used whatever
    ``cpuThreads`` said (torch's own parallel loops read the process-wide count)."""
    if device.type == "cpu":
        torch.set_num_threads(torch.get_num_threads())
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def select_dtype(name: str, device: torch.device, hidden: int = 576, inter: int = 1536,
                 fused: bool = False) -> torch.dtype:
    """Resolve ``auto``: bf16 on accelerators; on CPU, whichever Linear is faster at 16 rows
    on this machine (:mod:`.dtype_probe`), with the fused CPU kernels' when ``fused``."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cpu":
        return torch.bfloat16
    return cpu_dtype(hidden, inter, fused)
