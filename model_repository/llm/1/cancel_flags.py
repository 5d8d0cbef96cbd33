"""Cancel flags: files in one folder per tritonserver that every ``llm`` instance reads.

Two writers use them:

* ``llm_unary`` creates a file named after a running BLS call's id (``llm_unary-<hex>``)
  when its caller cancels; a BLS call cannot be cancelled any other way in this Triton.
* A ``stop_request_id`` request (MindIE's ``stopInfer``) creates ``stop-<hash of the id>``
  holding the stop's time: the requests with that id end as cancelled, on whichever
  instance runs them, also one that reaches its instance after the stop (it may still sit
  in Triton's queue), for :data:`STOP_FLAG_SECONDS`. Ids should therefore be unique; the
  adapter gives every generation its own.

The folder must belong to this user and be closed to others (0700): flags planted by
another local user would stop requests, so a folder that is not is ignored.

The sender thread of each instance reads the folder at its cancel poll, and only when its
modification time changed (or changed within the last second), so a poll costs one
``stat`` while no flag is raised.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time

from llm_engine.contract import CANCELLABLE_ID, cancel_flag_dir

log = logging.getLogger("llm_engine.model")

STOP_PREFIX = "stop-"
STOP_FLAG_SECONDS = 60.0  # a stop flag outlives every poll of every instance by far, then it goes
RACY_NS = 1_000_000_000


def stop_flag_name(request_id: str) -> str:
    """A file name for any request id (ids are client-chosen: no path may come from one)."""
    return STOP_PREFIX + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class CancelFlags:
    def __init__(self, folder: str | None = None):
        self.folder = folder or cancel_flag_dir()
        self._seen_mtime: int | None = None
        self._bls: set[str] = set()
        self._stops: dict[str, float] = {}  # flag name -> the stop's time.time()

    def raise_stop(self, request_id: str) -> None:
        """Stop the requests with ``request_id``, on every instance (raises ``OSError``)."""
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        if not self._trusted():
            raise PermissionError(f"{self.folder} is not this user's private folder")
        path = os.path.join(self.folder, stop_flag_name(request_id))
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(repr(time.time()))
        os.replace(tmp, path)  # a reader never sees a half-written time
        self._remove_old_stops()

    def refresh(self) -> None:
        """Read the folder again if it changed since the last read."""
        try:
            mtime = os.stat(self.folder).st_mtime_ns
        except OSError:
            self._seen_mtime, self._bls, self._stops = None, set(), {}
            return
        # File times come from a coarse clock (a few ms): a flag written in the same tick as
        # the last read leaves the time unchanged, so a folder changed within the last
        # second is read again at every poll (as git does with racily clean files).
        if mtime == self._seen_mtime and time.time_ns() - mtime > RACY_NS:
            return
        if not self._trusted():
            if mtime != self._seen_mtime:
                log.warning("ignoring the cancel flags in %s: not this user's private folder", self.folder)
            self._seen_mtime, self._bls, self._stops = mtime, set(), {}
            return
        bls, stops = set(), {}
        try:
            for name in os.listdir(self.folder):
                if name.startswith(STOP_PREFIX) and not name.endswith(".tmp"):
                    try:
                        with open(os.path.join(self.folder, name)) as fh:
                            stops[name] = float(fh.read())
                    except (FileNotFoundError, ValueError):  # removed meanwhile, or not a time
                        continue
                elif CANCELLABLE_ID.fullmatch(name):
                    bls.add(name)
        except OSError:  # out of descriptors, say: keep the last reading and read again next poll
            self._seen_mtime = None
            return
        self._seen_mtime, self._bls, self._stops = mtime, bls, stops

    def cancelled(self, request_id: str) -> bool:
        """Whether a flag (as of the last :meth:`refresh`) ends this request."""
        if request_id in self._bls:
            return True
        stopped_at = self._stops.get(stop_flag_name(request_id)) if self._stops else None
        return stopped_at is not None and time.time() - stopped_at <= STOP_FLAG_SECONDS

    def _trusted(self) -> bool:
        """The folder is this user's and closed to others (flags in it stop requests)."""
        try:
            st = os.lstat(self.folder)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077

    def _remove_old_stops(self) -> None:
        cutoff = time.time() - STOP_FLAG_SECONDS
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for name in names:
            if not name.startswith(STOP_PREFIX):
                continue
            path = os.path.join(self.folder, name)
            try:
                if os.stat(path).st_mtime < cutoff:
                    os.unlink(path)
            except OSError:
                pass
