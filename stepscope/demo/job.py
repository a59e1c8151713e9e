"""The demo's real job: what trouble it injects, and running it under torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stepscope.demo import PROGRESS_PREFIX

_CRASH = re.compile(r"injected failure on rank (\d+) at step (\d+)")


@dataclass(kw_only=True, slots=True)
class TrainPlan:
    """The job and the trouble injected into it (flags of stepscope.demo.train)."""

    num_ranks: int = 4
    num_steps: int = 100
    step_s: float = 0.05
    """Extra compute per step, seconds (the model itself is tiny)."""
    ckpt_every: int = 40
    data_rank: int = 1
    data_steps: tuple[int, int] = (20, 59)
    data_s: float = 0.1
    backward_rank: int = 2
    backward_from_step: int = 60
    backward_s: float = 0.1
    crash_rank: int = 3
    crash_step: int = 90

    def __post_init__(self) -> None:
        ranks = (self.data_rank, self.backward_rank, self.crash_rank)
        if self.num_ranks < 4 or any(not 0 <= r < self.num_ranks for r in ranks):
            raise ValueError("the demo needs >= 4 ranks and its trouble on ranks among them")
        if not self.ckpt_every < self.crash_step < self.num_steps:
            raise ValueError("the crash must come after the first checkpoint, before the end")

    @property
    def resume_step(self) -> int:
        """The checkpoint the restarted job resumes from: the last one before the crash."""
        return self.crash_step // self.ckpt_every * self.ckpt_every

    def story(self) -> list[str]:
        """The injected trouble, in words, as the demo announces it."""
        first, last = self.data_steps
        return [
            f"rank {self.data_rank}: slow data loader in steps {first}-{last} "
            f"(+{self.data_s:g} s per batch)",
            f"rank {self.backward_rank}: slow backward from step {self.backward_from_step} "
            f"(+{self.backward_s:g} s per step)",
            f"every rank: a checkpoint every {self.ckpt_every} steps",
            f"rank {self.crash_rank}: raises in step {self.crash_step}; torchrun restarts the "
            f"job from the checkpoint of step {self.resume_step}",
        ]

    def train_args(self, *, ckpt_dir: Path) -> list[str]:
        first, last = self.data_steps
        return [
            *("--ckpt-dir", str(ckpt_dir)),
            *("--steps", str(self.num_steps), "--step-s", str(self.step_s)),
            *("--ckpt-every", str(self.ckpt_every)),
            *("--data-rank", str(self.data_rank), "--data-steps", f"{first}-{last}"),
            *("--data-s", str(self.data_s)),
            *("--backward-rank", str(self.backward_rank)),
            *("--backward-from-step", str(self.backward_from_step)),
            *("--backward-s", str(self.backward_s)),
            *("--crash-rank", str(self.crash_rank), "--crash-step", str(self.crash_step)),
        ]


def torchrun_command(plan: TrainPlan, *, url: str, job_id: str, ckpt_dir: Path) -> list[str]:
    """`stepscope run` (zero-code) around torchrun (this interpreter's torch), one restart
    allowed, the packaged training module."""
    return [
        *(sys.executable, "-m", "stepscope.cli", "run", "--url", url, "--job-id", job_id, "--"),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={plan.num_ranks}",
        *("--max-restarts", "1", "--monitor-interval", "0.5"),
        *("-m", "stepscope.demo.train"),
        *plan.train_args(ckpt_dir=ckpt_dir),
    ]


@dataclass(frozen=True, slots=True)
class Progress:
    """One thing the job said: its step, a checkpoint, the crash, the restart."""

    kind: str
    """"step", "checkpoint", "crash", "restart" or "done"."""
    step: int | None = None
    rank: int | None = None


_SAID = re.compile(
    re.escape(PROGRESS_PREFIX)
    + r" (?:(?P<step>step)|(?P<checkpoint>checkpoint saved at step)|(?P<restart>restart \d+: "
    r"resumed from the checkpoint of step)|(?P<done>done)) ?(?P<number>\d+)?"
)


def parse_line(line: str) -> Progress | None:
    """What a line of torchrun's output says about the job's progress, if anything (the ranks
    share the pipe: a line may carry another process's output around it)."""
    said = _SAID.search(line)
    if said is not None:
        kind = next(k for k in ("step", "checkpoint", "restart", "done") if said[k])
        number = said["number"]
        if kind != "done" and number is None:
            return None
        return Progress(kind=kind, step=int(number) if number else None)
    crash = _CRASH.search(line)
    if crash and "RuntimeError" in line:
        return Progress(kind="crash", rank=int(crash[1]), step=int(crash[2]))
    return None


def run_training(
    command: list[str], log_path: Path, on_progress: Callable[[Progress], None]
) -> int:
    """Run the job, its output to `log_path`, telling `on_progress` as it goes; its exit code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPSCOPE_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"  # 4 ranks share a few cores
    env["STEPSCOPE_FLUSH_INTERVAL_S"] = "0.5"
    env["STEPSCOPE_CLOSE_TIMEOUT_S"] = "20"
    env["STEPSCOPE_ATTRIBUTES"] = json.dumps({"example": "stepscope demo", "parallelism": "fsdp2"})
    env["PYTHONUNBUFFERED"] = "1"
    with (
        log_path.open("w", encoding="utf-8") as log,
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
        ) as process,
    ):
        assert process.stdout is not None
        crashed = False
        for line in process.stdout:
            log.write(line)
            said = parse_line(line.rstrip("\n"))
            if said is None or (said.kind == "crash" and crashed):
                continue
            crashed = crashed or said.kind == "crash"
            on_progress(said)
        return process.wait()
