"""``dtype: auto`` on CPU: measured once per machine under a lock, and every instance agrees."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch
from llm_engine import dtype_probe
from llm_engine.device import select_dtype
from llm_engine.weights import CACHE_ENV, cache_lock


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def test_the_verdict_is_measured_once_and_kept(cache, monkeypatch):
    first = select_dtype("auto", torch.device("cpu"), 64, 128)
    assert first in (torch.float32, torch.bfloat16)
    kept = json.loads((cache / dtype_probe.VERDICTS).read_text())
    assert list(kept) == [dtype_probe.machine_key(64, 128)]
    entry = kept[dtype_probe.machine_key(64, 128)]
    assert entry["dtype"] == str(first).removeprefix("torch.")
    assert entry["fp32_ms"] > 0 and entry["bf16_ms"] > 0

    def no_second_probe(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(dtype_probe, "time_linears", no_second_probe)
    assert select_dtype("auto", torch.device("cpu"), 64, 128) == first
    assert select_dtype("float32", torch.device("cpu"), 64, 128) == torch.float32  # explicit wins
    assert select_dtype("auto", torch.device("cuda"), 64, 128) == torch.bfloat16  # no probe off CPU


def test_another_shape_or_thread_count_is_measured_on_its_own(cache):
    select_dtype("auto", torch.device("cpu"), 64, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        select_dtype("auto", torch.device("cpu"), 64, 128)
    finally:
        torch.set_num_threads(threads)
    select_dtype("auto", torch.device("cpu"), 64, 256)
    assert len(json.loads((cache / dtype_probe.VERDICTS).read_text())) == 3


def test_only_the_newest_verdicts_are_kept(cache):
    """Keys change with each kernel build, torch release and thread count: the file keeps
    the newest ``MAX_VERDICTS`` (entries without a time count as oldest) and the new one."""
    key = dtype_probe.machine_key(64, 128)
    old = {f"old machine {i}": {"dtype": "float32", "measured_at": 1000 + i}
           for i in range(dtype_probe.MAX_VERDICTS)}
    old["from before the time stamps"] = {"dtype": "bfloat16"}
    (cache / dtype_probe.VERDICTS).write_text(json.dumps(old))
    select_dtype("auto", torch.device("cpu"), 64, 128)
    kept = json.loads((cache / dtype_probe.VERDICTS).read_text())
    assert len(kept) == dtype_probe.MAX_VERDICTS
    assert key in kept and kept[key]["measured_at"] >= time.time() - 60
    assert "from before the time stamps" not in kept and "old machine 0" not in kept
    assert f"old machine {dtype_probe.MAX_VERDICTS - 1}" in kept


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"%s": {"dtype": "int8"}}'])
def test_an_unreadable_verdict_is_measured_again(cache, content):
    key = dtype_probe.machine_key(64, 128)
    (cache / dtype_probe.VERDICTS).write_text(content.replace("%s", key))
    assert select_dtype("auto", torch.device("cpu"), 64, 128) in (torch.float32, torch.bfloat16)
    assert json.loads((cache / dtype_probe.VERDICTS).read_text())[key]["dtype"] in ("float32", "bfloat16")


def _probe_in_a_process(cache: str, out) -> None:
    import os

    os.environ[CACHE_ENV] = cache
    torch.set_num_threads(2)
    calls = []
    real = dtype_probe.time_linears

    def counted(*args):
        calls.append(1)
        return real(*args)

    dtype_probe.time_linears = counted
    out.put((str(dtype_probe.cpu_dtype(64, 128)), len(calls)))


def test_instances_loading_together_measure_once_and_agree(cache):
    """Two instances of one model load side by side: before the lock, each probe read the
    other's load (232 ms for both dtypes, against 17 quiet) and they chose differently."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_probe_in_a_process, args=(str(cache), out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len({dtype for dtype, _ in results}) == 1, results
    assert sum(measured for _, measured in results) == 1, results


def test_the_cache_lock_excludes_another_process(cache):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with cache_lock("probe"):
        p = ctx.Process(target=_take_lock, args=(str(cache), out))
        p.start()
        time.sleep(1.0)
        assert out.empty()  # still waiting for the lock
        held_until = time.time()
    taken_at = out.get(timeout=30)
    p.join(timeout=30)
    assert taken_at >= held_until


def _take_lock(cache: str, out) -> None:
    import os

    os.environ[CACHE_ENV] = cache
    with cache_lock("probe"):
        out.put(time.time())


def test_a_read_only_cache_still_gets_a_measured_dtype(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv(CACHE_ENV, str(blocked))
    assert select_dtype("auto", torch.device("cpu"), 64, 128) in (torch.float32, torch.bfloat16)


def test_the_probe_reads_its_weights_from_memory_as_the_model_does():
    """One weight called 30 times stays in cache: on a 2-core Xeon that timing chose fp32
    where the engine ran bf16 1.6x faster. The probe's fp32 weights now exceed a
    last-level cache, within bounds, and a verdict of the older probe is not reused."""
    smollm = dtype_probe.probe_weights(576, 1536)
    assert smollm * 576 * 1536 * 4 >= dtype_probe.PROBE_WEIGHT_BYTES >= 64 * 2**20
    assert dtype_probe.probe_weights(64, 128) == dtype_probe.PROBE_CALLS  # tiny shapes: one weight per call
    assert dtype_probe.probe_weights(4096, 11008) == 2  # big shapes: bounded memory
    assert dtype_probe.machine_key(576, 1536).endswith(f"| probe {dtype_probe.PROBE_VERSION}")


def test_the_probe_times_the_kernels_the_runner_will_use(monkeypatch):
    """bf16 on the fused kernels' Linear where the CPU has one (with ``fused``), fp32 on the
    faster of torch's two kernels; a verdict taken without the fused kernels is kept apart."""
    from llm_engine import cpu_ops
    from llm_engine.linear import Fp32Linear, PackedBf16Linear

    made = []
    real = dtype_probe.make_linear

    def recorded(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(dtype_probe, "make_linear", recorded)
    ops = cpu_ops.load(torch.bfloat16)
    timings = dtype_probe.time_linears(64, 128, ops)
    assert set(timings) == {torch.float32, torch.bfloat16} and all(0 < t < 10 for t in timings.values())
    packed = [lin for lin in made if isinstance(lin, PackedBf16Linear)]
    assert len(packed) == (dtype_probe.PROBE_CALLS if ops is not None and ops.bf16_kernel else 0)
    assert sum(isinstance(lin, Fp32Linear) for lin in made) == dtype_probe.PROBE_CALLS
    assert dtype_probe.machine_key(64, 128, fused=True) != dtype_probe.machine_key(64, 128)


def test_a_verdict_for_the_fused_kernels_names_their_build_and_needs_them_loaded(cache, monkeypatch):
    """A verdict keyed "fused kernels" was measured on the build that loaded (a change to the
    kernels measures again); where they fail to load, the verdict is the torch path's."""
    from llm_engine import cpu_ops

    if cpu_ops.load(torch.bfloat16) is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_ops.library_id().startswith("cpu_ops-")
    assert cpu_ops.library_id() in dtype_probe.machine_key(64, 128, fused=True)
    monkeypatch.setattr(cpu_ops, "load", lambda dtype: None)
    dtype_probe.cpu_dtype(64, 128, fused=True)
    assert list(json.loads((cache / dtype_probe.VERDICTS).read_text())) == [dtype_probe.machine_key(64, 128)]
