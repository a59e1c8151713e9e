"""Rank script of tests/parallel/test_pipeline_stages.py: a small transformer trained as a
4-rank pipeline (torch.distributed.pipelining, gloo, CPU), one stage slowed in compute at a
time, profiled by stepscope. Several jobs run one after the other in one torchrun launch.

    torchrun --standalone --nproc_per_node=4 tests/parallel/pipeline_job.py PLAN.json

PLAN.json: {"url", "out", "jobs": [{"job_id", "schedule" (gpipe, 1f1b or interleaved: two
stages per rank, stage i on rank i % 4), "steps", "microbatches", "site" (where the slowed
rank sleeps: "step", before its schedule step; "forward" or "backward", spread over its
micro-batches), "slow": [[rank, first_step, last_step], ...], "slow_step_ratio"}, ...]}.

The slowed rank sleeps `slow_step_ratio` times the job's median step before its first slowed
step (measured by every rank, from step 5): at least as much more compute as the whole step
took, so that a busy machine cannot hide it. Each rank writes OUT/<job_id>/rank<r>.json
({"delay_s": ..., "steps": ...}) when the job is done.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

from pipeline_train import stage_module  # noqa: E402
from transformer import ModelConfig, build_model, lm_loss, token_batches  # noqa: E402

import stepscope  # noqa: E402

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
BATCH_SIZE = 8
MEASURED_FROM_STEP = 5
"""Steps before this one (start-up, shape inference) are left out of the median step."""


def run_job(plan: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = STAGES_PER_RANK[job["schedule"]]
    num_stages = per_rank * world
    cfg = ModelConfig(num_layers=num_stages)
    indices = [rank + k * world for k in range(per_rank)]
    models = [stage_module(build_model(cfg), i, num_stages) for i in indices]
    prof = stepscope.init(job_id=job["job_id"], url=plan["url"], flush_interval_s=0.5)
    stages: list[Any] = [
        PipelineStage(m, i, num_stages, torch.device("cpu"))
        for m, i in zip(models, indices, strict=True)
    ]
    for stage in stages:
        prof.watch(stage)
    microbatches = int(job["microbatches"])
    schedule: Any
    if job["schedule"] == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lm_loss)
    else:
        cls = Schedule1F1B if job["schedule"] == "1f1b" else ScheduleGPipe
        schedule = cls(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    params = [p for m in models for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    first, last = 0 in indices, num_stages - 1 in indices
    slow = [(r, a, b) for r, a, b in job["slow"]]
    measure_until = min(a for _, a, _ in slow)
    site = job["site"]
    starts_s: list[float] = []
    delay_s = 0.0
    batches = token_batches(cfg, steps=int(job["steps"]), batch_size=BATCH_SIZE, seed=0)
    for step, (tokens, targets) in enumerate(batches):
        if MEASURED_FROM_STEP <= step <= measure_until:
            starts_s.append(time.perf_counter())
        if step == measure_until:
            step_s = statistics.median(b - a for a, b in itertools.pairwise(starts_s))
            delay_s = float(job["slow_step_ratio"]) * step_s
        slowed = any(r == rank and a <= step <= b for r, a, b in slow)
        sleep_s = delay_s if slowed else 0.0
        for m in models:
            m.delay.arm(site, sleep_s / (microbatches * per_rank) if site != "step" else 0.0)
        with prof.step():
            if site == "step" and sleep_s:
                time.sleep(sleep_s)
            losses: list[torch.Tensor] = []
            if first:
                schedule.step(tokens, target=targets if last else None, losses=losses)
            elif last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.record(samples=tokens.shape[0], tokens=tokens.numel())
    prof.close()
    return {"delay_s": delay_s, "steps": int(job["steps"])}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for job in plan["jobs"]:
        result = run_job(plan, job)
        out = Path(plan["out"], job["job_id"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown


if __name__ == "__main__":
    main()
