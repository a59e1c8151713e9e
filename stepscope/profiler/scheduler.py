"""The scheduler's view of a rank: Kubernetes and Slurm conventions as job and rank attributes.

Kubernetes passes what a pod knows of itself through the downward API: `NODE_NAME`
(spec.nodeName), `POD_NAME`, `POD_NAMESPACE`, `POD_UID` as variables, and the pod's labels as
a file (`/etc/podinfo/labels`, or STEPSCOPE_K8S_LABELS_FILE). Slurm sets SLURM_* variables in
every task. The physical node (the Kubernetes node, Slurm's node name) is the rank's `node`
when known: a pod's hostname is the pod, not the machine.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LABELS_FILE = "/etc/podinfo/labels"
K8S_JOB_LABELS = ("training.kubeflow.org/job-name", "job-name", "batch.kubernetes.io/job-name")
"""Pod labels that name the job the pod belongs to (PyTorchJob, then a batch Job)."""
_LABEL_LINE = re.compile(r'^([^=]+)="(.*)"$')
_SLURM_JOB = {
    "SLURM_JOB_ID": "slurm.job_id",
    "SLURM_JOB_NAME": "slurm.job_name",
    "SLURM_ARRAY_JOB_ID": "slurm.array_job_id",
    "SLURM_ARRAY_TASK_ID": "slurm.array_task_id",
    "SLURM_JOB_NODELIST": "slurm.nodelist",
    "SLURM_JOB_NUM_NODES": "slurm.num_nodes",
    "SLURM_JOB_PARTITION": "slurm.partition",
    "SLURM_JOB_ACCOUNT": "slurm.account",
    "SLURM_RESTART_COUNT": "slurm.requeue_count",
    "SLURM_JOB_START_TIME": "slurm.start_time",
}
"""Slurm variables of the whole job → job attribute names."""
_INT_ATTRIBUTES = frozenset(
    {"slurm.array_task_id", "slurm.num_nodes", "slurm.requeue_count", "slurm.start_time"}
)


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """What the scheduler says about this rank: its node, its job, and attributes of each."""

    node: str | None = None
    """The physical node, when the scheduler names it."""
    job_name: str | None = None
    """A job id the scheduler gives every rank alike (a Kubernetes job label)."""
    job_attributes: dict[str, Any] = field(default_factory=dict)
    rank_attributes: dict[str, Any] = field(default_factory=dict)


def parse_labels(text: str) -> dict[str, str]:
    """The downward API's labels file: one `key="value"` per line (values escaped as Go %q)."""
    labels: dict[str, str] = {}
    for line in text.splitlines():
        match = _LABEL_LINE.match(line.strip())
        if match:
            labels[match.group(1)] = match.group(2).replace('\\"', '"').replace("\\\\", "\\")
    return labels


def _read_labels(path: str) -> dict[str, str]:
    try:
        return parse_labels(Path(path).read_text())
    except OSError:
        return {}


def kubernetes_view(env: Mapping[str, str]) -> SchedulerView:
    """The pod, namespace, node and labels a Kubernetes pod knows of itself."""
    if not (env.get("KUBERNETES_SERVICE_HOST") or env.get("POD_NAME") or env.get("NODE_NAME")):
        return SchedulerView()
    namespace = env.get("POD_NAMESPACE")
    labels = _read_labels(env.get("STEPSCOPE_K8S_LABELS_FILE", LABELS_FILE))
    job_label = next((labels[k] for k in K8S_JOB_LABELS if labels.get(k)), None)
    rank_attributes = {
        "k8s.pod.name": env.get("POD_NAME") or env.get("HOSTNAME"),
        "k8s.pod.uid": env.get("POD_UID"),
        "k8s.node.name": env.get("NODE_NAME"),
    }
    job_attributes: dict[str, Any] = {"k8s.namespace.name": namespace}
    job_attributes.update({f"k8s.pod.label.{k}": v for k, v in sorted(labels.items())})
    return SchedulerView(
        node=env.get("NODE_NAME") or None,
        job_name=f"{namespace}/{job_label}" if job_label and namespace else job_label,
        job_attributes={k: v for k, v in job_attributes.items() if v},
        rank_attributes={k: v for k, v in rank_attributes.items() if v},
    )


def _as_int(text: str) -> int | str:
    return int(text) if text.strip().lstrip("-").isdigit() else text


def slurm_view(env: Mapping[str, str], *, submit_time: bool = False) -> SchedulerView:
    """The Slurm job, array task, node list and requeue count of a Slurm task; with
    `submit_time`, the job's submit time from `scontrol` (Slurm exports no variable for it)."""
    if not env.get("SLURM_JOB_ID"):
        return SchedulerView()
    job_attributes: dict[str, Any] = {
        name: _as_int(env[var]) if name in _INT_ATTRIBUTES else env[var]
        for var, name in _SLURM_JOB.items()
        if env.get(var)
    }
    job_attributes.setdefault("slurm.requeue_count", 0)
    if submit_time:
        submitted = scontrol_submit_time(env["SLURM_JOB_ID"])
        if submitted is not None:
            job_attributes["slurm.submit_time"] = submitted
    rank_attributes = {
        "slurm.node_name": env.get("SLURMD_NODENAME"),
        "slurm.procid": env.get("SLURM_PROCID"),
        "slurm.localid": env.get("SLURM_LOCALID"),
    }
    return SchedulerView(
        node=env.get("SLURMD_NODENAME") or None,
        job_attributes=job_attributes,
        rank_attributes={k: _as_int(v) for k, v in rank_attributes.items() if v},
    )


def scontrol_submit_time(job_id: str, timeout_s: float = 2.0) -> float | None:
    """The job's SubmitTime (epoch seconds, read as the node's local time), or None."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        out = subprocess.run(
            [scontrol, "show", "job", job_id, "--oneliner"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        log.debug("scontrol show job %s failed", job_id, exc_info=True)
        return None
    match = re.search(r"\bSubmitTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", out)
    if match is None:
        return None
    local = datetime.fromisoformat(match.group(1)).astimezone()  # scontrol prints local time
    return local.astimezone(UTC).timestamp()


def scheduler_view(env: Mapping[str, str], *, rank: int) -> SchedulerView:
    """Kubernetes' and Slurm's view together (a Slurm cluster on Kubernetes gives both)."""
    k8s = kubernetes_view(env)
    slurm = slurm_view(env, submit_time=rank == 0)
    return SchedulerView(
        node=k8s.node or slurm.node,
        job_name=k8s.job_name,
        job_attributes={**slurm.job_attributes, **k8s.job_attributes},
        rank_attributes={**slurm.rank_attributes, **k8s.rank_attributes},
    )
