"""Zero-code in real processes: what `stepscope run` profiles, and what it must leave alone.

The scripts never import stepscope (but one); each runs under `stepscope run` against a real
collector, as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from stepscope.profiler.launch.launcher import BOOTSTRAP_DIR
from tests.live_server import RunningServer, read_rows
from tests.support import require_torchrun

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 8
BOOTSTRAP_FAILED = "stepscope: zero-code profiling is off in this process"

TRAIN = """
import json, os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
params = [v.hex() for p in model.parameters() for v in p.detach().flatten().tolist()]
print(json.dumps({"pid": os.getpid(), "params": params}))
"""
"""A deterministic tiny training of NUM_STEPS updates that prints its pid and final parameters
(as float hex)."""

TRAIN_WITH_INIT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import stepscope

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
prof = stepscope.init()
for x, y in DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8):
    with prof.step():
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
prof.close()
"""
"""The same loop, profiled by the script itself (its optimizer is built before init())."""

DDP_WITH_WORKERS = """
import functools, json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset


class Mixed(IterableDataset):
    \"\"\"Samples a worker reads through a loader of its own, as dataset-mixing pipelines do.\"\"\"

    def __iter__(self):
        for row in DataLoader(torch.randn(8, 8), batch_size=1):
            yield row[0], row[0, :1]


def note_worker(out, worker_id):
    open(os.path.join(out, f"worker-{os.getpid()}"), "w").close()


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for context in ("fork", "spawn"):
        loader = DataLoader(
            Mixed(), batch_size=4, num_workers=2, multiprocessing_context=context,
            worker_init_fn=functools.partial(note_worker, out),
        )
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    with open(os.path.join(out, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "agent_pid": os.getppid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
"""DDP on gloo whose batches come from two DataLoader workers, forked then spawned (4 + 4
steps); each rank writes its pid and its agent's, each worker its pid."""


def write_script(tmp_path: Path, source: str, name: str = "train.py") -> Path:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    return script


def job_env(**extra: str) -> dict[str, str]:
    """This environment without stepscope's settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def stepscope_run(server: RunningServer, job_id: str, *args: str) -> list[str]:
    """`stepscope run` for the collector and job id, with `args` before `--` and the command."""
    return [
        *(sys.executable, "-m", "stepscope.cli", "run"),
        *("--url", server.url, "--job-id", job_id),
        *args,
    ]


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `cmd` from the repository (as the launcher's own stepscope is imported from there);
    it must succeed."""
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """What TRAIN printed: its pid and final parameters."""
    printed: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return printed


def stored(server: RunningServer, table: str, job_id: str) -> list[dict[str, Any]]:
    return read_rows(server.db_url, table, job_id)


@pytest.mark.torchrun
def test_only_the_ranks_are_profiled_not_torchrun_nor_dataloader_workers(
    live_server: RunningServer, tmp_path: Path
) -> None:
    script = write_script(tmp_path, DDP_WITH_WORKERS)
    out = tmp_path / "out"
    out.mkdir()
    torchrun = [require_torchrun(), "--standalone", "--nproc_per_node=2", str(script), str(out)]
    run(stepscope_run(live_server, "ranks-only", "--", *torchrun), job_env())

    ranks = {r: json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)}
    worker_pids = {int(p.name.removeprefix("worker-")) for p in out.glob("worker-*")}
    assert len(worker_pids) == 2 * 2 * 2  # ranks x loaders x workers
    stored_ranks = {r["rank"]: r for r in stored(live_server, "ranks", "ranks-only")}
    assert {r: row["pid"] for r, row in stored_ranks.items()} == {
        r: ranks[r]["pid"] for r in (0, 1)
    }
    # One profiler a rank started: no worker's nor the agent's, even under a rank's number.
    starts = [e for e in stored(live_server, "events", "ranks-only") if e["kind"] == "start"]
    assert sorted(e["attributes"]["incarnation"] for e in starts) == sorted(
        row["incarnation"] for row in stored_ranks.values()
    )
    assert worker_pids.isdisjoint(row["pid"] for row in stored_ranks.values())
    assert {ranks[r]["agent_pid"] for r in (0, 1)}.isdisjoint(worker_pids)
    steps = stored(live_server, "steps", "ranks-only")
    for rank in (0, 1):
        rows = sorted((s for s in steps if s["rank"] == rank), key=lambda s: s["step"])
        assert [s["step"] for s in rows] == list(range(NUM_STEPS))
        assert {s["step_rule"] for s in rows} == {"optimizer"}


def test_the_users_own_sitecustomize_still_runs(live_server: RunningServer, tmp_path: Path) -> None:
    user_site, marker = tmp_path / "site", tmp_path / "sitecustomize-ran"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text(
        "import os\n"
        "with open(os.environ['SITECUSTOMIZE_MARKER'], 'a') as marker:\n"
        "    marker.write(f'{os.getpid()}\\n')\n"
    )
    script = write_script(tmp_path, TRAIN)
    env = job_env(PYTHONPATH=str(user_site), SITECUSTOMIZE_MARKER=str(marker))
    done = run(stepscope_run(live_server, "user-site", "--", sys.executable, str(script)), env)
    assert str(result(done)["pid"]) in marker.read_text().split()
    steps = stored(live_server, "steps", "user-site")
    assert sorted(s["step"] for s in steps) == list(range(NUM_STEPS))
    assert {s["step_rule"] for s in steps} == {"optimizer"}


def test_a_script_that_profiles_itself_is_counted_once(
    live_server: RunningServer, tmp_path: Path
) -> None:
    script = write_script(tmp_path, TRAIN_WITH_INIT)
    run(stepscope_run(live_server, "own-init", "--", sys.executable, str(script)), job_env())
    steps = stored(live_server, "steps", "own-init")
    assert sorted(s["step"] for s in steps) == list(range(NUM_STEPS))
    assert {s["step_rule"] for s in steps} == {None}
    starts = [e for e in stored(live_server, "events", "own-init") if e["kind"] == "start"]
    assert len(starts) == 1


def test_a_failing_bootstrap_leaves_training_bit_identical(
    live_server: RunningServer, tmp_path: Path
) -> None:
    """An older stepscope first on the training's PYTHONPATH, with framework adapters but not
    yet zero-code: the bootstrap cannot load it, says so once, and the training computes what
    it computes unprofiled."""
    script = write_script(tmp_path, TRAIN)
    old = tmp_path / "old" / "stepscope"
    (old / "integrations").mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (old / "integrations" / "__init__.py").write_text('"""Framework adapters."""\n')
    command = ["--", sys.executable, str(script)]

    plain = run([sys.executable, str(script)], job_env())
    profiled = run(stepscope_run(live_server, "bootstrap-ok", *command), job_env())
    failed = run(
        stepscope_run(live_server, "bootstrap-failed", *command),
        job_env(PYTHONPATH=str(old.parent)),
    )

    assert result(profiled)["params"] == result(plain)["params"]
    assert result(failed)["params"] == result(plain)["params"]
    assert len(stored(live_server, "steps", "bootstrap-ok")) == NUM_STEPS
    assert BOOTSTRAP_FAILED not in profiled.stderr
    assert stored(live_server, "steps", "bootstrap-failed") == []
    [said] = [line for line in failed.stderr.splitlines() if BOOTSTRAP_FAILED in line]
    assert "ModuleNotFoundError: No module named 'stepscope.integrations.auto'" in said


@pytest.mark.parametrize(
    ("launcher_args", "env"),
    [
        (["--no-auto"], {}),
        ([], {"STEPSCOPE_AUTO": "0"}),
        (None, {"STEPSCOPE_AUTO": "0", "PYTHONPATH": BOOTSTRAP_DIR}),
    ],
    ids=["no-auto", "auto-0", "bootstrap-with-auto-0"],
)
def test_zero_code_turned_off_records_nothing(
    live_server: RunningServer,
    tmp_path: Path,
    launcher_args: list[str] | None,
    env: dict[str, str],
) -> None:
    """`--no-auto`, STEPSCOPE_AUTO=0 to the launcher, or to the bootstrap itself (None: the
    script runs without the launcher, with the collector's settings)."""
    script = write_script(tmp_path, TRAIN)
    job_id = "auto-off"
    if launcher_args is None:
        cmd = [sys.executable, str(script)]
        env = {**env, "STEPSCOPE_URL": live_server.url, "STEPSCOPE_JOB_ID": job_id}
    else:
        cmd = stepscope_run(live_server, job_id, *launcher_args, "--", sys.executable, str(script))
    done = run(cmd, job_env(**env))
    assert len(result(done)["params"]) == 8 * 16 + 16 + 16 + 1
    for table in ("jobs", "ranks", "steps", "events"):
        assert stored(live_server, table, job_id) == [], table
