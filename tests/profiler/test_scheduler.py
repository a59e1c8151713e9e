"""The scheduler's view: Kubernetes and Slurm variables give the job id, the physical node and
the job's and rank's attributes; a live run stores them, and OTLP relays find the rank by them."""

from __future__ import annotations

import os
import socket
import stat
import time
from datetime import datetime
from pathlib import Path

import httpx
import orjson
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint

import stepscope
from stepscope.profiler.config import detect_env
from stepscope.profiler.scheduler import parse_labels
from tests.live_server import RunningServer, read_rows

LABELS = (
    'app="llm"\n'
    'training.kubeflow.org/job-name="llm-8b"\n'
    'training.kubeflow.org/replica-type="worker"\n'
    'note="say \\"hi\\""\n'
)


def _k8s_env(tmp_path: Path) -> dict[str, str]:
    labels = tmp_path / "labels"
    labels.write_text(LABELS)
    return {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "POD_NAME": "llm-8b-worker-3",
        "POD_NAMESPACE": "research",
        "POD_UID": "5f0c-uid",
        "NODE_NAME": "gpu-node-17",
        "HOSTNAME": "llm-8b-worker-3",
        "STEPSCOPE_K8S_LABELS_FILE": str(labels),
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "8",
    }


def test_the_downward_apis_labels_file_is_parsed_with_its_escapes() -> None:
    assert parse_labels(LABELS) == {
        "app": "llm",
        "training.kubeflow.org/job-name": "llm-8b",
        "training.kubeflow.org/replica-type": "worker",
        "note": 'say "hi"',
    }


def test_kubernetes_gives_the_node_the_job_and_the_pod(tmp_path: Path) -> None:
    env = detect_env(_k8s_env(tmp_path))
    assert env.node == "gpu-node-17"  # the machine, not the pod's hostname
    assert env.job_id == "k8s-research-llm-8b"
    assert (env.rank, env.local_rank, env.world_size) == (3, 3, 8)
    assert env.rank_attributes == {
        "k8s.pod.name": "llm-8b-worker-3",
        "k8s.pod.uid": "5f0c-uid",
        "k8s.node.name": "gpu-node-17",
        "host.name": socket.gethostname(),
    }
    assert env.job_attributes["k8s.namespace.name"] == "research"
    assert env.job_attributes["k8s.pod.label.training.kubeflow.org/job-name"] == "llm-8b"
    assert env.job_attributes["k8s.pod.label.app"] == "llm"


def test_without_a_scheduler_the_node_is_the_hostname() -> None:
    env = detect_env({})
    assert env.node == socket.gethostname()
    assert env.job_attributes == {}
    assert env.rank_attributes == {"host.name": socket.gethostname()}


def _slurm_env() -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "llm-sweep",
        "SLURM_ARRAY_JOB_ID": "4240",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_PARTITION": "h100",
        "SLURM_RESTART_COUNT": "1",
        "SLURMD_NODENAME": "gpu03",
        "SLURM_NTASKS": "32",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
    }


def test_slurm_gives_the_job_array_task_nodes_and_requeues() -> None:
    env = detect_env({**_slurm_env(), "SLURM_PROCID": "17"})
    assert env.job_id == "slurm-4242"
    assert env.node == "gpu03"
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (17, 1, 32, 2)
    assert env.job_attributes == {
        "slurm.job_id": "4242",
        "slurm.job_name": "llm-sweep",
        "slurm.array_job_id": "4240",
        "slurm.array_task_id": 2,
        "slurm.nodelist": "gpu[01-04]",
        "slurm.num_nodes": 4,
        "slurm.partition": "h100",
        "slurm.requeue_count": 1,
    }
    assert env.rank_attributes["slurm.node_name"] == "gpu03"
    assert env.rank_attributes["slurm.procid"] == 17


def test_rank_0_reads_the_submit_time_from_scontrol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scontrol = tmp_path / "scontrol"  # Slurm's client is outside the project: a stand-in
    scontrol.write_text(
        "#!/bin/sh\n"
        'echo "JobId=$3 JobName=llm-sweep SubmitTime=2026-12-03T06:30:00 '
        'EligibleTime=2026-12-03T06:30:00 StartTime=2026-12-03T06:31:10"\n'
    )
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = detect_env({**_slurm_env(), "SLURM_PROCID": "0"})
    expected = datetime.fromisoformat("2026-12-03T06:30:00").timestamp()  # local time
    assert env.job_attributes["slurm.submit_time"] == expected
    other = detect_env({**_slurm_env(), "SLURM_PROCID": "5"})
    assert "slurm.submit_time" not in other.job_attributes  # one query per job, not per rank


def _relay(pod: str) -> bytes:
    """One GPU gauge from an OpenTelemetry Collector that names the pod it scraped."""
    request = ExportMetricsServiceRequest()
    resource = request.resource_metrics.add()
    resource.resource.attributes.append(
        KeyValue(key="k8s.pod.name", value=AnyValue(string_value=pod))
    )
    metric = Metric(name="DCGM_FI_DEV_GPU_UTIL")
    point = NumberDataPoint(time_unix_nano=1_800_000_000 * 10**9, as_int=93)
    point.attributes.append(KeyValue(key="gpu", value=AnyValue(string_value="3")))
    metric.gauge.data_points.append(point)
    resource.scope_metrics.add().metrics.append(metric)
    return request.SerializeToString()


def test_a_kubernetes_run_stores_the_node_and_pod_and_relays_find_the_rank(
    live_server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _k8s_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    prof = stepscope.init(url=live_server.url, flush_interval_s=0.2, patch_collectives=False)
    assert prof.job_id == "k8s-research-llm-8b"
    for _ in prof.wrap_dataloader(range(3)):
        with prof.step():
            time.sleep(0.002)
    prof.close()
    [rank] = read_rows(live_server.db_url, "ranks", "k8s-research-llm-8b")
    assert (rank["rank"], rank["node"]) == (3, "gpu-node-17")
    attributes = rank["attributes"]
    attributes = orjson.loads(attributes) if isinstance(attributes, str) else attributes
    assert attributes["k8s.pod.name"] == "llm-8b-worker-3"
    [job] = read_rows(live_server.db_url, "jobs", "k8s-research-llm-8b")
    assert job["attributes"]["k8s.namespace.name"] == "research"

    response = httpx.post(
        f"{live_server.url}/v1/metrics",
        content=_relay("llm-8b-worker-3"),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 200
    assert not ExportMetricsServiceResponse.FromString(response.content).HasField("partial_success")
    [gpu] = read_rows(live_server.db_url, "gpu_samples", "k8s-research-llm-8b")
    assert (gpu["rank"], gpu["gpu_index"], gpu["util"]) == (3, 3, 93.0)
