"""Start and supervise the whole stack: the real ``tritonserver`` plus the adapter.

``python -m adapter.launch [--config conf/config.json]`` (what ``make serve`` runs):

1. converts the default GGUF model once (progress is shown), so Triton's load is quick;
2. starts tritonserver on loopback with this repository, and waits until the model is ready;
3. starts the adapter (uvicorn) and prints where to send requests;
4. restarts either process if it dies, and restarts Triton when its model stops
   being ready (e.g. the Python stub was killed);
5. on Ctrl-C / SIGTERM drains the adapter first, then stops Triton, then exits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from llm_engine.config import CONFIG_ENV, default_config_path, load_settings
from llm_engine.contract import CANCEL_FLAG_DIR_PREFIX
from llm_engine.cpu_cores import (
    ENGINE_CPUS_ENV,
    CoreSplit,
    fused_kernels_expected,
    instance_count,
    plan_split,
)
from llm_engine.weights import resolve_model_dir

from adapter.planes import BUSINESS, MANAGEMENT, bind, listener_for, listeners
from adapter.tritonserver import (
    REPO_ROOT,
    llm_config,
    load_llm,
    new_admin_key,
    prepare_backend,
    triton_command,
    triton_env,
)

log = logging.getLogger("launch")
CPU_SPLIT_LOG = "engine on CPUs %s; tritonserver and the adapter on CPUs %s"  # bench.stack reads it
PR_SET_PDEATHSIG = 1


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent`` (Triton's Python stubs), read from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            kids.append(int(entry.name))
    return kids


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this child if the launcher dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup(cpus: tuple[int, ...] | None):
    """``preexec_fn`` for tritonserver and the adapter: die with us, and run on ``cpus`` if given."""
    def setup() -> None:
        die_with_parent()
        if cpus:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)
    return setup


def accelerator_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA GPU or an Ascend NPU device node: the engine may not run on the CPU."""
    return any(dev.glob("nvidia[0-9]*")) or any(dev.glob("davinci[0-9]*"))


def engine_cores(settings, model_repository: Path) -> CoreSplit | None:
    """The CPU split the engine will use (llm_engine.cpu_cores), or ``None`` off the CPU."""
    mc = settings.model
    if mc.device in ("cuda", "npu") or (mc.device == "auto" and accelerator_present()):
        return None
    config = llm_config(model_repository / settings.triton.modelName, settings)
    return plan_split(mc.cpuAffinity, mc.cpuThreads, instance_count(config), fused_kernels_expected(mc.cpuKernels))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


class Supervisor:
    def __init__(self, config_path: Path, model_repository: Path, health_interval: float = 2.0):
        self.config_path = config_path
        self.settings = load_settings(config_path)
        self.model_repository = model_repository
        self.health_interval = health_interval
        self.paths = prepare_backend()
        self.env = triton_env(self.paths, config_path)
        self.triton: subprocess.Popen | None = None
        self.adapter: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.restarts = 0
        self.stubs: list[int] = []
        self.shm_prefix = ""
        self.cores: CoreSplit | None = None
        # One client for every health check: a bare httpx.get() builds a new client and its
        # SSL context each time, ~55 ms of CPU (measured), taken every 2 s from the engine's cores.
        # No keep-alive: tritonserver waits out its whole exit timeout for an open HTTP
        # connection and then exits without unloading the model, orphaning the stubs.
        t = self.settings.triton
        self._http = httpx.Client(base_url=t.http_url, timeout=2,
                                  headers={"Connection": "close"})

    # -- processes ------------------------------------------------------------------
    def _triton_ready(self) -> bool:
        try:
            return self._http.get(f"/v2/models/{self.settings.triton.modelName}/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _check_ports(self) -> None:
        """Fail fast if another server holds a port: its readiness answer would fool us. The
        adapter's own port counts too until this launcher's adapter holds it."""
        t, srv = self.settings.triton, self.settings.server
        ports = [(t.httpAddress, t.httpPort), (t.grpcAddress, t.grpcPort), (t.httpAddress, t.metricsPort)]
        if self.adapter is None or self.adapter.poll() is not None:
            ports += [(listener.host, listener.port) for listener in listeners(srv)]
        for addr, port in ports:
            try:
                bind(addr, port).close()
            except OSError as exc:
                raise RuntimeError(f"port {addr}:{port} is already in use ({exc})") from None

    def _triton_live(self) -> bool:
        try:
            return self._http.get("/v2/health/live").status_code == 200
        except httpx.HTTPError:
            return False

    def start_triton(self, timeout: float = 600) -> None:
        self._check_ports()
        # unique per launch: several launchers in one process (the tests) must not remove each
        # other's regions when one stops
        self.shm_prefix = f"mindie_triton_{os.getpid()}_{self.restarts}_{secrets.token_hex(3)}_"
        key = new_admin_key()
        cmd = triton_command(self.paths, self.settings, self.model_repository, admin_key=key,
                             shm_prefix=self.shm_prefix)
        self.cores = engine_cores(self.settings, self.model_repository)
        env = dict(self.env)
        if self.cores:
            env[ENGINE_CPUS_ENV] = self.cores.env_value()
            log.info(CPU_SPLIT_LOG, list(self.cores.engine), list(self.cores.rest))
        log.info("starting tritonserver (model %s)", self.settings.triton.modelName)
        self.triton = subprocess.Popen(cmd, env=env, start_new_session=True,
                                       preexec_fn=_child_setup(self.cores.rest if self.cores else None))
        deadline = time.monotonic() + timeout
        loader: threading.Thread | None = None
        load_errors: list[Exception] = []

        def load() -> None:  # in a thread: the load call blocks until the model is loaded
            try:
                load_llm(self.settings, self.model_repository, key, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:
                load_errors.append(exc)

        while time.monotonic() < deadline and not self.stopping.is_set():
            if self.triton.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.triton.returncode} while loading")
            if load_errors:
                raise RuntimeError(f"loading the model failed: {load_errors[0]}") from load_errors[0]
            if loader is None and self._triton_live():
                loader = threading.Thread(target=load, name="triton-load", daemon=True)
                loader.start()
            if loader is not None and not loader.is_alive() and not load_errors and self._triton_ready():
                self.stubs = child_pids(self.triton.pid)
                log.info("Triton model ready (python stubs: %s)", self.stubs)
                return
            time.sleep(0.5)
        if not self.stopping.is_set():
            raise RuntimeError("Triton model did not become ready in time")

    def start_adapter(self) -> None:
        cmd = [sys.executable, "-m", "adapter", "--config", str(self.config_path)]
        env = dict(self.env)
        # the engine package lives in the model repository; make it importable without an install
        paths = [str(REPO_ROOT), str(self.model_repository / "llm" / "1"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.adapter = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, start_new_session=True,
                                        preexec_fn=_child_setup(self.cores.rest if self.cores else None))
        srv = self.settings.server
        scheme = "https" if srv.httpsEnabled else "http"
        business, management = listener_for(srv, BUSINESS), listener_for(srv, MANAGEMENT)
        base = f"{scheme}://{business.url_host}:{business.port}"
        log.info("adapter starting: send requests to %s/v1/completions and %s/infer", base, base)
        health = "" if management == business else \
            f"; health on {scheme}://{management.url_host}:{management.port}"
        print(f"\n  MindIE API ready at {base}  (POST /v1/completions, POST /infer{health}; Ctrl-C stops)\n",
              flush=True)

    @staticmethod
    def _stop(proc: subprocess.Popen | None, timeout: float, name: str) -> None:
        if proc is None or proc.poll() is not None:
            return
        log.info("stopping %s", name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", name, timeout)
            proc.kill()
            proc.wait()

    # -- supervision ------------------------------------------------------------------
    def run(self) -> int:
        resolve_model_dir(self.settings.model.modelWeightPath)  # one-time GGUF conversion, with progress
        self.start_triton()
        if self.stopping.is_set():
            return 0
        self.start_adapter()
        unready_since = None
        while not self.stopping.wait(self.health_interval):
            if self.triton.poll() is not None:
                log.error("tritonserver exited with %s; restarting it", self.triton.returncode)
                self._restart_triton()
                unready_since = None
                continue
            if self.adapter.poll() is not None:
                log.error("adapter exited with %s; restarting it", self.adapter.returncode)
                self.start_adapter()
            dead = [pid for pid in self.stubs if not alive(pid)]
            if dead:
                log.error("Triton python stub %s died; restarting Triton", dead)
                self._restart_triton(force=True)
                unready_since = None
                continue
            if self._triton_ready():
                unready_since = None
            elif unready_since is None:
                unready_since = time.monotonic()
            elif time.monotonic() - unready_since > 3 * self.health_interval:
                log.error("Triton model not ready for %.0fs (stub dead?); restarting Triton",
                          time.monotonic() - unready_since)
                self._restart_triton()
                unready_since = None
        return 0

    def _restart_triton(self, force: bool = False) -> None:
        """Restart Triton; ``force`` kills it at once (its model is dead, nothing to drain)."""
        self.restarts += 1
        if force and self.triton is not None and self.triton.poll() is None:
            self.triton.kill()
            self.triton.wait()
        self._stop_triton()
        try:
            self.start_triton()
        except RuntimeError:
            log.exception("Triton restart failed; will retry")

    def shutdown(self) -> None:
        self.stopping.set()
        self._stop(self.adapter, self.settings.server.drainTimeout + 10, "adapter")
        self._stop_triton()

    def _stop_triton(self) -> None:
        """Stop tritonserver and make sure no orphaned Python stub outlives it."""
        stubs = child_pids(self.triton.pid) if self.triton and self.triton.poll() is None else []
        self._stop(self.triton, self.settings.triton.exitTimeoutSecs + 5, "tritonserver")
        for pid in set(stubs + self.stubs):
            if alive(pid):
                log.warning("killing orphaned python stub %d", pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.stubs = []
        if self.triton is not None:
            remove_shm_leftovers(self.shm_prefix, self.triton.pid)


def remove_shm_leftovers(prefix: str, triton_pid: int, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove what a stopped tritonserver left in /dev/shm: Python backend regions that a
    killed stub or an exit-timeout could not unlink, and llm_unary's cancel-flag folder."""
    removed = []
    if not shm.is_dir():
        return removed
    for entry in shm.iterdir():
        if (prefix and entry.name.startswith(prefix)) or entry.name == f"{CANCEL_FLAG_DIR_PREFIX}{triton_pid}":
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    if removed:
        log.info("removed %d leftover /dev/shm entries of tritonserver %d", len(removed), triton_pid)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.environ.get(CONFIG_ENV) or str(default_config_path()))
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--tritonserver", help="tritonserver binary (default: the one in nvidia-pytriton)")
    parser.add_argument("--backend-dir", help="Triton backends directory (with --tritonserver)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [launch] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.tritonserver:
        os.environ["TRITONSERVER_BIN"] = args.tritonserver
    if args.backend_dir:
        os.environ["TRITON_BACKEND_DIR"] = args.backend_dir
    sup = Supervisor(Path(args.config).resolve(), Path(args.model_repository).resolve())

    def on_signal(signum, _frame):
        log.info("received %s; shutting down", signal.Signals(signum).name)
        sup.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        sup.run()
    except Exception:
        log.exception("launch failed")
        sup.shutdown()
        return 1
    sup.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
