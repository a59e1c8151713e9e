"""Preflight under real torchrun (gloo): busbw per size, FLOP/s per rank, the slow rank named."""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.telemetry.preflight import TEST_SLOW_RANK_ENV, run_preflight
from tests.live_server import RunningServer, read_rows
from tests.support import require_torchrun

REPO = Path(__file__).resolve().parents[2]
SIZES_BYTES = (1024, 64 * 1024, 1024 * 1024)


def _torchrun(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    torchrun = require_torchrun()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    child_env.update(OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", *args],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_cli_names_the_rank_with_a_slow_matmul(tmp_path: Path) -> None:
    out = tmp_path / "preflight.json"
    sizes = [str(s) for s in SIZES_BYTES]
    args = ["--iters", "3", "--matmul-n", "128", "--matmul-iters", "5", "--json", str(out)]
    proc = _torchrun(
        ["-m", "stepscope.preflight", "--sizes-bytes", *sizes, *args],
        tmp_path,
        **{TEST_SLOW_RANK_ENV: "1"},
    )
    result = json.loads(out.read_text())

    assert result["world_size"] == 2
    assert result["backend"] == "gloo"
    assert result["sizes_bytes"] == list(SIZES_BYTES)
    assert len(result["busbw_bps"]) == len(SIZES_BYTES)
    assert all(math.isfinite(b) and b > 0 for b in result["busbw_bps"])
    assert all(len(per_rank) == len(SIZES_BYTES) for per_rank in result["rank_busbw_bps"])
    flops_0, flops_1 = result["rank_matmul_flops"]
    assert flops_0 > 0
    assert flops_1 > 0
    # The hook makes rank 1's probe 10x slower; noise on a shared CPU is far smaller.
    assert flops_1 < 0.5 * flops_0
    slow = [s for s in result["slow_ranks"] if s["metric"] == "matmul_flops"]
    assert [s["rank"] for s in slow] == [1]
    assert slow[0]["observed"] == flops_1
    assert slow[0]["expected"] == pytest.approx((flops_0 + flops_1) / 2)
    assert "SLOW: rank 1" in proc.stdout
    assert "matmul_flops" in proc.stdout
    assert proc.stdout.count("stepscope preflight: 2 ranks, backend gloo") == 1


def test_cli_sends_the_finding_to_the_collector(tmp_path: Path, live_server: RunningServer) -> None:
    args = ["--sizes-bytes", "4096", "--iters", "2", "--matmul-n", "128"]
    _torchrun(
        ["-m", "stepscope.preflight", *args],
        tmp_path,
        STEPSCOPE_URL=live_server.url,
        STEPSCOPE_JOB_ID="preflight-e2e",
        **{TEST_SLOW_RANK_ENV: "1"},
    )
    events = read_rows(live_server.db_url, "events", "preflight-e2e")

    slow = [e for e in events if e["attributes"].get("metric") == "matmul_flops"]
    assert [(e["rank"], e["kind"]) for e in slow] == [(1, "custom")]
    assert slow[0]["message"].startswith("preflight: rank 1 on ")
    assert slow[0]["attributes"]["ratio"] < 0.7
    (summary,) = [e for e in events if "slow_ranks" in e["attributes"]]
    assert summary["rank"] == 0
    assert 1 in summary["attributes"]["slow_ranks"]
    assert summary["attributes"]["sizes_bytes"] == [4096]


SCRIPT = """
import json, os, sys
import torch.distributed as dist
from stepscope.profiler.telemetry.preflight import TEST_SLOW_RANK_ENV, run_preflight

MATMUL = "matmul_flops"

class Recorder:
    def __init__(self):
        self.events = []

    def event(self, kind, message, **attributes):
        self.events.append({"kind": kind, "message": message, "attributes": attributes})

dist.init_process_group("gloo")
rank = dist.get_rank()
kwargs = dict(sizes_bytes=(4096, 262144), iters=2, matmul_n=128, matmul_iters=5)
healthy = Recorder()
healthy_result = run_preflight(prof=healthy, slow_fraction=0.3, **kwargs)
os.environ[TEST_SLOW_RANK_ENV] = "0"
degraded = Recorder()
degraded_result = run_preflight(prof=degraded, **kwargs)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({
        "healthy_events": healthy.events,
        "healthy_slow": [s.rank for s in healthy_result.slow_ranks if s.metric == MATMUL],
        "events": degraded.events,
        "slow": [[s.rank, s.ratio] for s in degraded_result.slow_ranks if s.metric == MATMUL],
        "busbw_bps": degraded_result.busbw_bps,
    }, f)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_slow_rank_records_an_event_about_itself(tmp_path: Path) -> None:
    script = tmp_path / "preflight_events.py"
    script.write_text(textwrap.dedent(SCRIPT))
    _torchrun([str(script), str(tmp_path)], tmp_path)
    ranks: list[dict[str, Any]] = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)
    ]

    # Healthy run: same speed on both ranks, nothing slow; rank 0 records only the summary.
    # (Bus bandwidth of a 256 KiB all-reduce is noisy on a shared CPU: only matmul is asserted.)
    assert ranks[0]["healthy_slow"] == []
    assert not [e for e in ranks[0]["healthy_events"] if _metric(e) == "matmul_flops"]
    assert _summaries(ranks[0]["healthy_events"])[0]["attributes"]["world_size"] == 2
    assert _summaries(ranks[1]["healthy_events"]) == []

    # Degraded run: rank 0 is 10x slower and both ranks agree on that.
    assert [s[0] for s in ranks[0]["slow"]] == [0]
    assert ranks[0]["slow"] == ranks[1]["slow"]
    assert ranks[0]["slow"][0][1] < 0.7
    assert ranks[0]["busbw_bps"] == ranks[1]["busbw_bps"]
    assert all(b > 0 for b in ranks[0]["busbw_bps"])
    (slow_event,) = [e for e in ranks[0]["events"] if _metric(e) == "matmul_flops"]
    assert slow_event["kind"] == "custom"
    assert slow_event["message"].startswith("preflight: rank 0 on ")
    assert slow_event["attributes"]["observed"] < slow_event["attributes"]["expected"]
    assert slow_event["attributes"]["ratio"] == pytest.approx(ranks[0]["slow"][0][1])
    (summary,) = _summaries(ranks[0]["events"])
    assert 0 in summary["attributes"]["slow_ranks"]
    assert summary["attributes"]["sizes_bytes"] == [4096, 262144]
    assert summary["attributes"]["busbw_bps"] == ranks[0]["busbw_bps"]
    assert not [e for e in ranks[1]["events"] if _metric(e) == "matmul_flops"]


def _metric(event: dict[str, Any]) -> Any:
    return event["attributes"].get("metric")


def _summaries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if "slow_ranks" in e["attributes"]]


def test_preflight_needs_a_process_group() -> None:
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="init_process_group"):
        run_preflight()
