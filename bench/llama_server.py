"""llama.cpp's own ``llama-server`` with parallel slots: the strongest CPU peer, on the same GGUF.

It is driven exactly like the stack: streaming ``/v1/completions`` clients in a closed
loop at each concurrency, greedy, EOS ignored, the same prompts and token counts. The
binary is not a project dependency; ``make bench-peers`` builds it (bench/README.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from bench.load import drive_completions
from bench.stack import REPO_ROOT, free_ports, wait_ready
from bench.stats import RunResult
from bench.workload import Workload

log = logging.getLogger(__name__)

SYSTEM = "llama-server"
# Where `make bench-peers` builds llama.cpp (the binary and the shared libraries beside it).
PEERS_BUILD = REPO_ROOT / ".bench-peers" / "build" / "bin"
CTX_PER_SLOT = 256  # prompt (~15-25 tokens) + 64 new tokens, with room to spare


def find_binary(explicit: str | None = None) -> Path | None:
    """``explicit`` (which must exist), else ``$LLAMA_SERVER``, else the ``make bench-peers`` build,
    else ``PATH``."""
    def executable(path) -> bool:
        return bool(path) and Path(path).is_file() and os.access(path, os.X_OK)

    if explicit is not None:
        if not executable(explicit):
            raise FileNotFoundError(f"--llama-server {explicit}: not an executable file")
        return Path(explicit)
    candidates = (os.environ.get("LLAMA_SERVER"), PEERS_BUILD / "llama-server", shutil.which("llama-server"))
    return next((Path(c) for c in candidates if executable(c)), None)


def has_amx() -> bool:
    """Whether this CPU has AMX, where llama.cpp's weight repacking crashes (bench/README.md)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_int8" in flags or "amx_bf16" in flags


def server_args(binary: Path, gguf: Path, port: int, slots: int, threads: int) -> list[str]:
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * CTX_PER_SLOT), "-t", str(threads), "-tb", str(threads)]
    if has_amx():
        args.append("--no-repack")
    return args


class LlamaServer:
    """One ``llama-server`` process on a free loopback port, stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, slots: int, log_path: Path):
        self.port = free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = server_args(binary, gguf, self.port, slots, os.cpu_count() or 1)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        log.info("starting %s (log: %s)", " ".join(self.args), self.log_path)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.proc, f"{self.base_url}/health", 120, SYSTEM, self.log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


def run_llama_server(workload: Workload, log_path: Path, binary: str | None = None) -> list[RunResult]:
    """The peer at every concurrency of ``workload``, or one skipped row saying why not."""
    from llm_engine.weights import default_gguf_path

    found = find_binary(binary)
    if found is None:
        why = "no llama-server binary (make bench-peers builds one; or set LLAMA_SERVER)"
        log.warning("skipping the llama-server peer: %s", why)
        return [RunResult(system=SYSTEM, concurrency=max(workload.concurrencies), dtype="Q4_1", note=why)]
    with LlamaServer(found, default_gguf_path(), max(workload.concurrencies), log_path) as server:
        # it closes each connection after a stream (while announcing keep-alive): see http_client
        return asyncio.run(drive_completions(server.base_url, SYSTEM, workload, SYSTEM, "Q4_1", keep_alive=False))
