"""analyze(): inputs, outputs, and what it delegates."""

from __future__ import annotations

import json

import polars as pl
import pytest

from stepscope.analysis import AnalysisConfig, analyze, findings_to_frame, mfu_per_step
from stepscope.schema import FINDINGS
from stepscope.synthetic.generate import JobSpec, Straggler, generate, to_frames


def _job(**kwargs: object) -> tuple[dict[str, pl.DataFrame], dict[str, object]]:
    job = generate(JobSpec(num_ranks=16, num_steps=400, seed=11, **kwargs))  # type: ignore[arg-type]
    return to_frames(job), job.job


def test_hand_made_steps_with_compute_s_given() -> None:
    rows = []
    for step in range(200):
        for rank in range(4):
            compute_s = 0.13 if rank == 2 and step >= 80 else 0.10 + 0.001 * ((step * 7 + rank) % 3)
            rows.append(
                {
                    "job_id": "hand",
                    "rank": rank,
                    "step": step,
                    "step_s": 0.2,
                    "data_s": 0.01,
                    "compute_s": compute_s,
                    "node": f"h{rank // 2}",
                }
            )
    findings = analyze(pl.DataFrame(rows))
    (f,) = [f for f in findings if f.kind == "straggler_rank"]
    assert (f.job_id, f.ranks, f.node, f.first_step, f.last_step) == ("hand", [2], "h1", 80, None)
    assert f.evidence["excess_s"]["compute_s"] == pytest.approx(0.029, abs=0.002)


def test_findings_frame_has_the_findings_columns() -> None:
    frames, job = _job(stragglers=(Straggler(ranks=(3,), factor=1.2, cause="data", from_step=100),))
    findings = analyze(frames["steps"], collectives=frames["collectives"], job=job)
    frame = findings_to_frame(findings)
    assert frame.columns == list(FINDINGS.names)
    row = frame.filter(pl.col("kind") == "straggler_rank").row(0, named=True)
    assert json.loads(row["ranks"]) == [3]
    assert json.loads(row["evidence"])["component"] == "data_s"
    assert row["detected_at"] > 1.7e9
    assert findings_to_frame([]).columns == list(FINDINGS.names)


def test_lazy_frames_give_the_same_findings() -> None:
    frames, job = _job(
        stragglers=(Straggler(ranks=(9,), factor=1.1, cause="compute", from_step=50),)
    )
    eager = analyze(frames["steps"], collectives=frames["collectives"], gpu=frames["gpu"], job=job)
    lazy = analyze(
        frames["steps"].lazy(),
        collectives=frames["collectives"].lazy(),
        gpu=frames["gpu"].lazy(),
        ranks=frames["ranks"].lazy(),
        job=job,
    )
    strip = [{**f.to_dict(), "detected_at": None} for f in eager]
    assert strip == [{**f.to_dict(), "detected_at": None} for f in lazy]
    assert any(f.kind == "straggler_rank" and f.node == "node-0001" for f in lazy)


def test_throughput_findings_are_included() -> None:
    frames, job = _job(throughput_shifts=((200, 1.25),))
    findings = analyze(frames["steps"], job=job)
    drops = [f for f in findings if f.kind == "throughput_drop"]
    assert drops
    assert min(abs((f.first_step or 0) - 200) for f in drops) <= 2
    no_peak = analyze(frames["steps"], job={**job, "peak_flops": None})
    assert any(f.kind == "peak_unknown" for f in no_peak)
    assert mfu_per_step(frames["steps"], peak_flops=9.89e14).height == 400


def test_one_job_at_a_time() -> None:
    frames, _ = _job()
    other = frames["steps"].with_columns(pl.lit("other").alias("job_id"))
    with pytest.raises(ValueError, match="one job at a time"):
        analyze(pl.concat([frames["steps"], other]))
    with pytest.raises(ValueError, match="job_id"):
        analyze(frames["steps"].drop("job_id"))
    assert analyze(frames["steps"].drop("job_id"), job={"job_id": "given"})[0].job_id == "given"


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_p_value"):
        AnalysisConfig(max_p_value=1.5)
    with pytest.raises(ValueError, match="min_effect"):
        AnalysisConfig(min_effect=0.0)
    with pytest.raises(ValueError, match="warning_impact <= critical_impact"):
        AnalysisConfig(warning_impact=0.2, critical_impact=0.1)
