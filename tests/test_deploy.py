"""The deployment files validate: Kubernetes manifests, the Prometheus scrape config, the
Grafana dashboard (over names /metrics really exposes), the Slurm example and compose's .env."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from stepscope.profiler.config import detect_env
from stepscope.profiler.scheduler import LABELS_FILE
from stepscope.server.metrics import build_metrics
from stepscope.store.engine import make_engine
from stepscope.store.migrate import upgrade
from tests.support import require_docker_compose, require_prometheus

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def _manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def test_every_manifest_names_its_api_kind_and_name() -> None:
    docs = _manifests()
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "Service",
        "StatefulSet",
        "Secret",
        "Job",
        "PyTorchJob",
    }
    for doc in docs:
        assert doc["apiVersion"], doc
        assert doc["kind"], doc
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


def test_workloads_select_their_pods_and_services_select_a_workload() -> None:
    docs = _manifests()
    pod_labels = []
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            labels = doc["spec"]["template"].get("metadata", {}).get("labels", {})
            if doc["kind"] != "Job":
                selector = doc["spec"]["selector"]["matchLabels"]
                assert selector.items() <= labels.items(), doc["metadata"]["name"]
            pod_labels.append(labels)
            for container in _pod_spec(doc)["containers"]:
                assert container["name"]
                assert container["image"]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), service
    server = next(d for d in docs if d["kind"] == "Deployment")
    assert server["spec"]["replicas"] >= 2  # stateless: scales out behind the Service


def test_secret_references_exist_in_the_example_secret() -> None:
    docs = _manifests()
    secret = next(d for d in docs if d["kind"] == "Secret")
    keys = set(secret["stringData"])
    text = "\n".join(p.read_text() for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    refs = re.findall(r"secretKeyRef: \{name: ([\w-]+), key: ([\w-]+)\}", text)
    assert refs
    for name, key in refs:
        assert name == secret["metadata"]["name"]
        assert key in keys


def test_the_pytorchjobs_downward_api_gives_the_profiler_its_node_pod_and_labels() -> None:
    job = next(d for d in _manifests() if d["kind"] == "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        [container] = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        field_paths = {
            name: e["valueFrom"]["fieldRef"]["fieldPath"]
            for name, e in env.items()
            if "fieldRef" in e.get("valueFrom", {})
        }
        assert field_paths["NODE_NAME"] == "spec.nodeName"
        assert field_paths["POD_NAME"] == "metadata.name"
        assert field_paths["POD_NAMESPACE"] == "metadata.namespace"
        assert "STEPSCOPE_URL" in env
        assert env["STEPSCOPE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "ingest-token"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "podinfo")
        [item] = next(v for v in pod["volumes"] if v["name"] == "podinfo")["downwardAPI"]["items"]
        assert f"{mount['mountPath']}/{item['path']}" == LABELS_FILE
        assert item["fieldRef"]["fieldPath"] == "metadata.labels"
    # What the kubelet would set, as the profiler reads it.
    seen = detect_env(
        {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "NODE_NAME": "gpu-7", "POD_NAME": "llm-8b-w-0"}
    )
    assert seen.node == "gpu-7"


def test_the_prometheus_config_is_valid_and_scrapes_metrics() -> None:
    require_prometheus()
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    path = DEPLOY / "prometheus" / "prometheus.yml"
    check = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(path)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load(path.read_text())
    assert {c["metrics_path"] for c in config["scrape_configs"]} == {"/metrics"}
    for scrape in config["scrape_configs"]:
        assert scrape["authorization"]["type"] == "Bearer"


def _exposed_names(tmp_path: Path) -> set[str]:
    """Every sample name the server's /metrics can carry, from its registry's exposition."""
    engine = make_engine(f"sqlite:///{tmp_path / 'metrics.db'}")
    upgrade(engine)
    text = build_metrics(engine, seen_within_s=600).exposition().decode()
    engine.dispose()
    suffixes = {"histogram": ("_bucket", "_count", "_sum")}
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE):
        names.update(name + s for s in suffixes.get(kind, ("",)))  # counters end in _total
    return names


def test_the_grafana_dashboard_queries_only_names_that_metrics_exposes(tmp_path: Path) -> None:
    doc = json.loads((DEPLOY / "grafana" / "stepscope-dashboard.json").read_text())
    assert doc["uid"]
    assert doc["title"]
    assert isinstance(doc["schemaVersion"], int)
    panels = doc["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels if p["type"] != "row" for t in p["targets"]]
    assert exprs
    used = {n for e in exprs for n in re.findall(r"\bstepscope_[a-z0-9_]+", e)}
    exposed = _exposed_names(tmp_path)
    assert used <= exposed, used - exposed
    for required in ("stepscope_job_step_p50_seconds", "stepscope_ingest_batches_total"):
        assert required in used
    variables = {v["name"] for v in doc["templating"]["list"]}
    for expr in exprs:
        for variable in re.findall(r"\$(\w+)", expr):
            assert variable in variables


def test_the_slurm_example_is_valid_bash_that_uses_stepscope_run() -> None:
    path = DEPLOY / "slurm" / "train.sbatch"
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = path.read_text()
    assert re.search(r"^srun stepscope run .* -- \\$", text, flags=re.MULTILINE)
    assert "#SBATCH --requeue" in text


def _env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_compose_reads_exactly_the_variables_of_env_example() -> None:
    compose_text = (ROOT / "docker-compose.yml").read_text()
    compose = yaml.safe_load(compose_text)
    assert set(compose["services"]) == {"postgres", "stepscope"}
    assert compose["services"]["stepscope"]["depends_on"]["postgres"]["condition"] == (
        "service_healthy"
    )
    used = set(re.findall(r"\$\{(\w+)(?::-[^}]*)?\}", compose_text))
    assert used == set(_env_example())


def test_docker_compose_config_validates_and_resolves_env_example() -> None:
    binary = require_docker_compose()
    result = subprocess.run(
        [binary, "-f", "docker-compose.yml", "--env-file", ".env.example", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    example = _env_example()
    server = resolved["services"]["stepscope"]
    password = example["POSTGRES_PASSWORD"]
    assert server["environment"] == {
        "STEPSCOPE_DATABASE_URL": f"postgresql://stepscope:{password}@postgres:5432/stepscope",
        "STEPSCOPE_ANALYZE_INTERVAL_S": example["STEPSCOPE_ANALYZE_INTERVAL_S"],
        "STEPSCOPE_WEBHOOK_URLS": example["STEPSCOPE_WEBHOOK_URLS"],
        "STEPSCOPE_OTLP_EXPORT_ENDPOINT": example["STEPSCOPE_OTLP_EXPORT_ENDPOINT"],
    }
    assert resolved["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == password
    assert [p["published"] for p in server["ports"]] == [int(example["STEPSCOPE_PORT"])]
    assert server["depends_on"] == {"postgres": {"condition": "service_healthy"}}
