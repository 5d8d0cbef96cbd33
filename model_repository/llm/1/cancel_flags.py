"""Cancel flags: files in one folder per tritonserver that every ``llm`` instance reads.

Two writers use them:

* ``llm_unary`` creates a file named after a running BLS call's id (``llm_unary-<hex>``)
  when its caller cancels; a BLS call cannot be cancelled any other way in this Triton.
* A ``stop_request_id`` request (MindIE's ``stopInfer``) creates ``stop-<hash of the id>``
  holding the stop's time: the requests with that id that arrived before it end as
  cancelled, on whichever instance runs them.

The sender thread of each instance reads the folder at its cancel poll, and only when its
modification time changed (or changed within the last second), so a poll costs one
``stat`` while no flag is raised.
"""

from __future__ import annotations

import hashlib
import logging
import os
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
        """Stop the requests with ``request_id`` that arrived until now, on every instance."""
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        path = os.path.join(self.folder, stop_flag_name(request_id))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
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
        self._seen_mtime = mtime
        bls, stops = set(), {}
        try:
            names = os.listdir(self.folder)
        except OSError:
            names = []
        for name in names:
            if name.startswith(STOP_PREFIX) and not name.endswith(".tmp"):
                try:
                    with open(os.path.join(self.folder, name)) as fh:
                        stops[name] = float(fh.read())
                except (OSError, ValueError):
                    continue
            elif CANCELLABLE_ID.fullmatch(name):
                bls.add(name)
        self._bls, self._stops = bls, stops

    def cancelled(self, request_id: str, arrival: float) -> bool:
        """Whether a flag (as of the last :meth:`refresh`) ends this request; ``arrival`` is
        its ``time.time()`` at submission."""
        if request_id in self._bls:
            return True
        stopped_at = self._stops.get(stop_flag_name(request_id)) if self._stops else None
        return stopped_at is not None and arrival <= stopped_at

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
