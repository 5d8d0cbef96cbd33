"""The cancel flags every ``llm`` instance reads: llm_unary's BLS cancels and stopInfer's stops."""

from __future__ import annotations

import os
import time

import pytest
from cancel_flags import STOP_FLAG_SECONDS, CancelFlags, stop_flag_name


def test_a_stop_ends_the_requests_with_its_id_for_a_while(tmp_path, monkeypatch):
    writer, reader = CancelFlags(str(tmp_path / "flags")), CancelFlags(str(tmp_path / "flags"))
    reader.refresh()  # no folder yet: nothing is cancelled
    assert not reader.cancelled("endpoint_common_3#0")
    writer.raise_stop("endpoint_common_3#0")
    reader.refresh()
    # running now, or reaching its instance later (still in Triton's queue at the stop)
    assert reader.cancelled("endpoint_common_3#0")
    assert not reader.cancelled("endpoint_common_3#1") and not reader.cancelled("endpoint_common_4#0")
    later = time.time() + STOP_FLAG_SECONDS + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert not reader.cancelled("endpoint_common_3#0")  # the flag has expired


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
    folder.mkdir(mode=0o700)
    bls = "llm_unary-" + "ab" * 16
    (folder / bls).write_text("")
    (folder / "unrelated").write_text("")
    (folder / (stop_flag_name("r") + ".123.tmp")).write_text("half")
    (folder / stop_flag_name("broken")).write_text("not a time")
    flags = CancelFlags(str(folder))
    flags.refresh()
    assert flags.cancelled(bls)
    assert not flags.cancelled("unrelated") and not flags.cancelled("r") and not flags.cancelled("broken")


def test_a_folder_others_can_write_is_not_trusted(tmp_path):
    """Flags planted by another local user would stop requests."""
    folder = tmp_path / "flags"
    folder.mkdir(mode=0o700)
    CancelFlags(str(folder)).raise_stop("x")
    os.chmod(folder, 0o777)
    flags = CancelFlags(str(folder))
    flags.refresh()
    assert not flags.cancelled("x")
    with pytest.raises(PermissionError):
        flags.raise_stop("y")
    os.chmod(folder, 0o700)
    os.utime(folder)
    flags.refresh()
    assert flags.cancelled("x")


def _stopped_long_ago(tmp_path, request_id: str) -> CancelFlags:
    """A folder with a stop for ``request_id``, last changed 10 s ago (past the racy second)."""
    flags = CancelFlags(str(tmp_path / "flags"))
    flags.raise_stop(request_id)
    old = time.time() - 10
    os.utime(flags.folder, (old, old))
    return flags


def test_the_folder_is_read_again_only_when_it_changed(tmp_path, monkeypatch):
    flags = _stopped_long_ago(tmp_path, "a")
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
    assert flags.cancelled("b")


def test_a_failed_read_is_tried_again_at_the_next_poll(tmp_path, monkeypatch):
    flags = _stopped_long_ago(tmp_path, "a")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    flags.refresh()
    assert not flags.cancelled("a")
    monkeypatch.setattr(os, "listdir", real)
    flags.refresh()  # the folder's time did not change, but the last read failed
    assert flags.cancelled("a")


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
    assert flags.cancelled("b")


def test_old_stop_flags_are_removed_by_the_next_stop(tmp_path):
    flags = CancelFlags(str(tmp_path / "flags"))
    flags.raise_stop("old")
    old = os.path.join(flags.folder, stop_flag_name("old"))
    past = time.time() - STOP_FLAG_SECONDS - 5
    os.utime(old, (past, past))
    flags.raise_stop("new")
    assert not os.path.exists(old)
    assert os.path.exists(os.path.join(flags.folder, stop_flag_name("new")))
