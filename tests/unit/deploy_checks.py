"""What the static checks of docker/ and deploy/ share: paths, the image's contract
(paths, ports, routes) and a Dockerfile parser (see test_deploy_docker.py and
test_deploy_k8s.py)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

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
