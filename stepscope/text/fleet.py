"""Fleet health in words: a suspect node's sentence, and the scheduler lines that act on the
suspects (Slurm's `--exclude` list and `scontrol` drains, `kubectl` cordons and taints).
The lines are for a person to read and run; stepscope never runs them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from stepscope.text.numbers import share, signed_share, when

TAINT_KEY = "stepscope.io/slow-node"
"""The taint `kubectl` lines put on a suspect (NoSchedule: running pods stay)."""
SLURM_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
"""Host names Slurm's hostlists and `scontrol` take without quoting."""
K8S_NODE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""Kubernetes node names: DNS subdomains."""


def node_sentence(node: Mapping[str, Any]) -> str:
    """One line: the node, its effect, over how many jobs, how sure, since when."""
    since = f", since {when(node['since'], short=True)}" if node.get("since") else ""
    return (
        f"{node['node']}: {signed_share(node.get('effect'))} step time over "
        f"{node['num_jobs']} job(s) (confidence {share(node['confidence'], 0)}){since}"
    )


def drain_reason(node: Mapping[str, Any]) -> str:
    """A short reason for a drain or a taint's comment (no quotes, no newlines)."""
    return f"stepscope: {signed_share(node.get('effect'))} slow over {node['num_jobs']} jobs"


def unusable_hosts(nodes: Sequence[Mapping[str, Any]], pattern: re.Pattern[str]) -> list[str]:
    """The node names the scheduler's syntax cannot take as they are."""
    return [n["node"] for n in nodes if not pattern.match(n["node"])]


def slurm_lines(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """`--exclude=HOST,…` for new jobs, then one `scontrol update` drain per node; comments
    say what they are. Nodes whose names Slurm cannot take are left out (see unusable_hosts)."""
    usable = [n for n in nodes if SLURM_HOST.match(n["node"])]
    if not usable:
        return ["# no suspect nodes"]
    lines = [
        f"# {len(usable)} suspect node(s) by stepscope fleet health",
        "# keep new jobs off them (sbatch/srun option):",
        "--exclude=" + ",".join(n["node"] for n in usable),
        "# drain them (as a Slurm administrator; running jobs finish):",
    ]
    lines += [
        f'scontrol update NodeName={n["node"]} State=DRAIN Reason="{drain_reason(n)}"'
        for n in usable
    ]
    return lines


def kubectl_lines(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """One `kubectl cordon` and one NoSchedule taint per node (running pods stay)."""
    usable = [n for n in nodes if K8S_NODE.match(n["node"])]
    if not usable:
        return ["# no suspect nodes"]
    lines = [f"# {len(usable)} suspect node(s) by stepscope fleet health"]
    for n in usable:
        lines.append(f"# {node_sentence(n)}")
        lines.append(f"kubectl cordon {n['node']}")
        lines.append(f"kubectl taint nodes {n['node']} {TAINT_KEY}={_taint_value(n)}:NoSchedule")
    return lines


def _taint_value(node: Mapping[str, Any]) -> str:
    """The effect as a taint value ([A-Za-z0-9._-], alphanumeric at both ends)."""
    effect = node.get("effect")
    if effect is None:
        return "unknown"
    return f"{100 * effect:.1f}pct"
