"""Locating and starting the real ``tritonserver`` (the binary shipped in the nvidia-pytriton wheel).

The wheel's layout has traps: the Python stub is not where Triton looks, it links
the bundled CUDA runtime by RPATH, it needs ``libpython`` on the library path, and
it ignores the virtualenv unless the model sets ``EXECUTION_ENV_PATH``. This
module builds a project-owned backend directory and the environment that make it
work, and assembles the command line with loopback binding and restricted APIs.

Models are loaded explicitly (``--model-control-mode=explicit``): ``llm_unary`` at
start, ``llm`` through the repository API with its ``config.pbtxt`` plus the settings
that belong to Triton's scheduler (``ScheduleConfig.maxQueueDelayMicroseconds`` is
its dynamic batcher's delay), so one settings file drives them too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace,statistics"
ADMIN_KEY_HEADER = "mindie-admin-key"  # the header that opens the restricted APIs
PYTHON_BACKEND_THREADS = 128


@dataclass
class TritonPaths:
    binary: Path
    backend_dir: Path
    lib_dirs: list[Path]


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed; it ships the tritonserver binary")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def prepare_backend(work_dir: Path | None = None) -> TritonPaths:
    """Build ``.triton/backends/python`` (links + the stub for this Python) and find libraries.

    ``$TRITONSERVER_BIN`` and ``$TRITON_BACKEND_DIR`` override everything (NVIDIA images).
    """
    if os.environ.get("TRITONSERVER_BIN"):
        backend = Path(os.environ.get("TRITON_BACKEND_DIR", "/opt/tritonserver/backends"))
        return TritonPaths(Path(os.environ["TRITONSERVER_BIN"]), backend, [])
    root = _pytriton_root()
    work_dir = work_dir or REPO_ROOT / ".triton"
    python_dir = work_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _link(python_dir / name, root / "backends" / "python" / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub_src = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub_src.is_file():
        raise FileNotFoundError(f"no Triton Python stub for Python {version} in {stub_src.parent.parent}")
    _copy_if_changed(stub_src, python_dir / "triton_python_backend_stub")
    libs = [root.parent.parent / "nvidia_pytriton.libs", Path(sysconfig.get_config_var("LIBDIR") or "")]
    return TritonPaths(root / "bin" / "tritonserver", work_dir / "backends", [p for p in libs if p.is_dir()])


# Another launcher from the same checkout may be running from these files (`make serve`
# beside the tests): each is left alone when it is already right, and replaced by a rename
# when not, so that no reader ever finds it missing or half-written.


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_file():
        a, b = src.stat(), dst.stat()
        if a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns:  # copy2 keeps the mtime
            return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)  # a running stub keeps its old file


def triton_env(paths: TritonPaths, config_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    extra = [str(p) for p in paths.lib_dirs]
    if env.get("LD_LIBRARY_PATH"):
        extra.append(env["LD_LIBRARY_PATH"])
    if extra:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(extra)
    env["MINDIE_TRITON_CONFIG"] = str(config_path)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def new_admin_key() -> str:
    return secrets.token_hex(16)


def triton_command(
    paths: TritonPaths, settings, model_repository: Path, admin_key: str | None = None,
    shm_prefix: str | None = None,
) -> list[str]:
    """The tritonserver command line: loopback by default, admin APIs behind a random key.

    Every model of the repository except ``llm`` loads at start; ``llm`` is loaded by
    :func:`load_llm` with the settings applied. ``shm_prefix`` names the Python backend's
    /dev/shm regions of this run, so that the supervisor can remove them when a stub or
    tritonserver dies without unlinking them.
    """
    t = settings.triton
    key = admin_key or new_admin_key()
    others = sorted(p.name for p in Path(model_repository).iterdir()
                    if (p / "config.pbtxt").is_file() and p.name != t.modelName)
    return [
        str(paths.binary),
        f"--model-repository={model_repository}",
        "--model-control-mode=explicit",
        *[f"--load-model={name}" for name in others],
        f"--backend-directory={paths.backend_dir}",
        f"--http-address={t.httpAddress}",
        f"--http-port={t.httpPort}",
        f"--grpc-address={t.grpcAddress}",
        f"--grpc-port={t.grpcPort}",
        f"--metrics-address={t.httpAddress}",
        f"--metrics-port={t.metricsPort}",
        f"--exit-timeout-secs={t.exitTimeoutSecs}",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=true",
        "--strict-readiness=true",
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_KEY_HEADER}={key}",
        f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_KEY_HEADER}={key}",
        # each running BLS call of llm_unary holds a backend thread until its generation ends
        f"--backend-config=python,thread-pool-size={PYTHON_BACKEND_THREADS}",
        *([f"--backend-config=python,shm-region-prefix-name={shm_prefix}"] if shm_prefix else []),
        "--log-info=true",
    ]


def llm_config(model_dir: Path, settings) -> dict:
    """``model_dir/config.pbtxt`` with the settings that Triton applies, as the load API's JSON."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    if not config.HasField("dynamic_batching"):
        raise ValueError(f"{model_dir / 'config.pbtxt'} has no dynamic_batching section")
    config.dynamic_batching.max_queue_delay_microseconds = settings.schedule.maxQueueDelayMicroseconds
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def load_llm(settings, model_repository: Path, admin_key: str, timeout: float) -> None:
    """Load the ``llm`` model through Triton's repository API with :func:`llm_config`.

    Returns when the model is loaded; raises ``RuntimeError`` with Triton's message otherwise.
    """
    import httpx

    t = settings.triton
    config = llm_config(Path(model_repository) / t.modelName, settings)
    r = httpx.post(f"{t.http_url}/v2/repository/models/{t.modelName}/load",
                   json={"parameters": {"config": json.dumps(config)}}, headers={ADMIN_KEY_HEADER: admin_key},
                   timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"Triton could not load {t.modelName}: {r.status_code} {r.text[:500]}")
