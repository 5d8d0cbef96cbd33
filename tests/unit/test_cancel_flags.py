"""The cancel flags every ``llm`` instance reads: llm_unary's BLS cancels and stopInfer's stops."""

from __future__ import annotations

import os
import time

from cancel_flags import STOP_FLAG_SECONDS, CancelFlags, stop_flag_name


def test_a_stop_ends_the_requests_that_arrived_before_it(tmp_path):
    writer, reader = CancelFlags(str(tmp_path / "flags")), CancelFlags(str(tmp_path / "flags"))
    reader.refresh()  # no folder yet: nothing is cancelled
    before = time.time()
    assert not reader.cancelled("endpoint_common_3", before)
    writer.raise_stop("endpoint_common_3")
    after = time.time() + 1
    reader.refresh()
    assert reader.cancelled("endpoint_common_3", before)
    assert not reader.cancelled("endpoint_common_3", after)  # the same id, sent again after the stop
    assert not reader.cancelled("endpoint_common_4", before)


def test_ids_never_become_paths(tmp_path):
    flags = CancelFlags(str(tmp_path / "flags"))
    for rid in ("../../etc/passwd", "a/b", "x" * 5000, "\u4e2d\u6587", "\udcff"):
        flags.raise_stop(rid)
        name = stop_flag_name(rid)
        assert "/" not in name and len(name) == len("stop-") + 32
    assert sorted(os.listdir(tmp_path)) == ["flags"]
    assert len(os.listdir(tmp_path / "flags")) == 5


def test_llm_unary_flags_and_other_files(tmp_path):
    folder = tmp_path / "flags"
    folder.mkdir()
    bls = "llm_unary-" + "ab" * 16
    (folder / bls).write_text("")
    (folder / "unrelated").write_text("")
    (folder / (stop_flag_name("r") + ".123.tmp")).write_text("half")
    (folder / stop_flag_name("broken")).write_text("not a time")
    flags = CancelFlags(str(folder))
    flags.refresh()
    assert flags.cancelled(bls, time.time())
    assert not flags.cancelled("unrelated", 0.0) and not flags.cancelled("r", 0.0)
    assert not flags.cancelled("broken", 0.0)


def test_the_folder_is_read_again_only_when_it_changed(tmp_path, monkeypatch):
    flags = CancelFlags(str(tmp_path / "flags"))
    flags.raise_stop("a")
    old = time.time() - 10
    os.utime(flags.folder, (old, old))  # changed long ago
    reads = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: reads.append(p) or real(p))
    flags.refresh()
    flags.refresh()
    flags.refresh()
    assert len(reads) == 1
    flags.raise_stop("b")  # a change: read again
    reads.clear()
    flags.refresh()
    assert flags.cancelled("b", 0.0)


def test_a_flag_written_in_the_tick_of_the_last_read_is_not_missed(tmp_path):
    """File times are coarse: a write right after a read can leave the folder's time as it
    was; a recently changed folder is read at every poll until its time is a second old."""
    flags = CancelFlags(str(tmp_path / "flags"))
    flags.raise_stop("a")
    flags.refresh()
    stamp = os.stat(flags.folder).st_mtime_ns
    CancelFlags(flags.folder).raise_stop("b")
    os.utime(flags.folder, ns=(stamp, stamp))  # as if it landed in the same tick
    flags.refresh()
    assert flags.cancelled("b", 0.0)


def test_old_stop_flags_are_removed_by_the_next_stop(tmp_path):
    flags = CancelFlags(str(tmp_path / "flags"))
    flags.raise_stop("old")
    old = os.path.join(flags.folder, stop_flag_name("old"))
    past = time.time() - STOP_FLAG_SECONDS - 5
    os.utime(old, (past, past))
    flags.raise_stop("new")
    assert not os.path.exists(old)
    assert os.path.exists(os.path.join(flags.folder, stop_flag_name("new")))
