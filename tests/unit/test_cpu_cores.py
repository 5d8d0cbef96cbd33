"""The engine's CPU cores: how they are chosen, and that pinning touches only the calling thread."""

from __future__ import annotations

import os
import threading

import pytest
from llm_engine.cpu_cores import (
    ENGINE_CPUS_ENV,
    CoreSplit,
    cpu_quota,
    fused_kernels_expected,
    instance_count,
    parse_cpus,
    pin_current_thread,
    plan_split,
    select_cpu_threads,
    split_cores,
)


@pytest.fixture
def cpus(monkeypatch):
    """Pretend this process may run on the given CPUs."""
    monkeypatch.delenv(ENGINE_CPUS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    monkeypatch.setattr("llm_engine.cpu_cores.cpu_quota", lambda: None)

    def set_cpus(ids):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(ids))
    return set_cpus


def test_the_engine_takes_the_last_cores_and_leaves_the_first():
    assert split_cores(1, [1, 0]) == CoreSplit(engine=(1,), rest=(0,))
    assert split_cores(3, list(range(8))) == CoreSplit(engine=(5, 6, 7), rest=(0, 1, 2, 3, 4))
    assert split_cores(2, [4, 9, 7]) == CoreSplit(engine=(7, 9), rest=(4,))


def test_nothing_is_pinned_when_the_engine_would_take_every_core():
    assert split_cores(2, [0, 1]) is None
    assert split_cores(4, [0, 1]) is None
    assert split_cores(1, [0]) is None
    assert split_cores(0, [0, 1]) is None


@pytest.mark.parametrize("text, expected", [
    ("1", (1,)), ("2,3", (2, 3)), ("4-6", (4, 5, 6)), (" 3 , 1 ", (1, 3)), ("0-1,5", (0, 1, 5)), ("", ()),
])
def test_cpu_lists_parse_like_the_kernel_writes_them(text, expected):
    assert parse_cpus(text) == expected


@pytest.mark.parametrize("text", ["x", "3-1", "-1", "1-"])
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_auto_pins_the_default_threads_to_the_last_cores(cpus):
    cpus(range(4))
    assert plan_split("auto", 0, 1) == CoreSplit(engine=(1, 2, 3), rest=(0,))
    assert plan_split("auto", 2, 1) == CoreSplit(engine=(2, 3), rest=(0, 1))


def test_with_the_fused_kernels_the_engine_takes_every_core_unpinned(cpus):
    cpus(range(2))
    assert select_cpu_threads(0, fused=True) == 2
    assert select_cpu_threads(0, fused=False) == 1
    assert plan_split("auto", 0, 1, fused=True) is None
    assert plan_split("auto", 0, 1, fused=False) == CoreSplit(engine=(1,), rest=(0,))
    assert select_cpu_threads(1, fused=True) == 1  # an explicit setting still wins
    assert plan_split("auto", 1, 1, fused=True) == CoreSplit(engine=(1,), rest=(0,))


def test_the_fused_kernels_are_expected_with_auto_and_a_compiler(monkeypatch):
    monkeypatch.setattr("llm_engine.cpu_cores.shutil.which", lambda name: f"/usr/bin/{name}")
    assert fused_kernels_expected("auto")
    assert not fused_kernels_expected("off")
    monkeypatch.setattr("llm_engine.cpu_cores.shutil.which", lambda name: None)
    assert not fused_kernels_expected("auto")


def test_off_several_instances_or_no_spare_core_pin_nothing(cpus):
    cpus(range(4))
    assert plan_split("off", 0, 1) is None
    assert plan_split("auto", 0, 2) is None  # two engines would share the same cores
    assert plan_split("auto", 4, 1) is None
    cpus([0])
    assert plan_split("auto", 0, 1) is None


def test_the_launchers_choice_reaches_the_stub_through_the_environment(cpus, monkeypatch):
    cpus([0])  # the launcher started tritonserver (and so the stub) on the rest
    monkeypatch.setenv(ENGINE_CPUS_ENV, "1")
    assert plan_split("auto", 0, 1) == CoreSplit(engine=(1,), rest=(0,))
    assert select_cpu_threads(0) == 1
    monkeypatch.setenv(ENGINE_CPUS_ENV, "2-3")
    assert select_cpu_threads(0) == 2
    assert select_cpu_threads(1) == 1  # an explicit setting still wins


def test_a_bad_environment_value_is_ignored(cpus, monkeypatch):
    cpus([0, 1])
    monkeypatch.setenv(ENGINE_CPUS_ENV, "one")
    assert plan_split("auto", 0, 1) == CoreSplit(engine=(1,), rest=(0,))
    monkeypatch.setenv(ENGINE_CPUS_ENV, "0-1")  # every CPU: nothing left for the rest
    assert plan_split("auto", 0, 1) is None


def test_the_cgroup_quota_is_read_from_cgroup_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2) is None
    (v2 / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(v2) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert cpu_quota(v1) == 4.0
    assert cpu_quota(tmp_path / "none") is None
    (v2 / "cpu.max").write_text("garbage")
    assert cpu_quota(v2) is None


def test_a_container_cpu_limit_caps_the_default_threads(cpus, monkeypatch):
    cpus(range(64))  # a big node: the affinity mask shows every CPU
    assert select_cpu_threads(0) == 63
    monkeypatch.setattr("llm_engine.cpu_cores.cpu_quota", lambda: 3.5)  # limits: cpu: 3500m
    assert select_cpu_threads(0) == 3
    assert plan_split("auto", 0, 1) == CoreSplit(engine=(61, 62, 63), rest=tuple(range(61)))
    assert select_cpu_threads(0, fused=True) == 4
    monkeypatch.setattr("llm_engine.cpu_cores.cpu_quota", lambda: 0.5)
    assert select_cpu_threads(0) == 1
    assert select_cpu_threads(0, fused=True) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the environment still wins over the default
    assert select_cpu_threads(0) == 3


def _affinity_of(tid: int) -> tuple[int, ...]:
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    return parse_cpus(line.split(":", 1)[1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_pinning_moves_only_the_calling_thread():
    mine = os.sched_getaffinity(0)
    target = (max(mine),)
    seen = {}

    def worker():
        seen["pinned"] = pin_current_thread(target, "a test thread")
        seen["inside"] = tuple(sorted(os.sched_getaffinity(0)))
        seen["proc"] = _affinity_of(threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"pinned": True, "inside": target, "proc": target}
    assert os.sched_getaffinity(0) == mine


def test_a_cpu_that_does_not_exist_is_a_warning_not_a_failure(caplog):
    before = os.sched_getaffinity(0)
    assert pin_current_thread((100_000,), "a test thread") is False
    assert "could not pin a test thread" in caplog.text
    assert os.sched_getaffinity(0) == before


def test_instances_are_counted_over_every_group():
    assert instance_count({}) == 1
    assert instance_count({"instance_group": []}) == 1
    assert instance_count({"instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"kind": "KIND_CPU"}]}) == 3
