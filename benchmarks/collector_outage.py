"""The collector unreachable for 30 s in the middle of a real job (#22).

A DDP job (torchrun, gloo, CPU, one torch thread per rank; an MLP step of a few ms of compute
plus a sleep standing for device time, ~65 ms in all) streams through stepscope with its
defaults to a real `stepscope serve` (SQLite in a temp dir). The benchmark takes the collector
away OUTAGE_S into the job, in one of two ways, and brings it back on the same database:

    hung      SIGSTOP, then SIGCONT: connections are accepted and never answered (a hung node)
    refused   SIGKILL, then a new server on the same port: connections are refused

Runs, one after the other: hung, refused, and refused again with buffers far smaller than
the outage. Each runs beside a control job, started with it, whose own server stays up: both
share whatever else the machine is doing. Each rank records its own step times (and the time
spent inside stepscope's step()), RSS, the rows it handed to the profiler and what its shipper
holds, twice a second. Printed: step time during the outage vs the control's same window and
vs the run's own time before it; RSS growth and rows held vs the configured bound; rows stored
vs produced; with small buffers, stored + dropped = produced per rank and kind, and the
summary's num_records_dropped = what is missing.

    flock /tmp/stepscope-bench.lock python benchmarks/collector_outage.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepscope.schema import DROP_REPORT_PREFIX  # noqa: E402

SMALL_BUFFERS = {"max_buffer_rows": 60, "max_batch_rows": 30, "max_pending_batches": 2}
"""Room for 120 rows of a kind: about 8 s of this job's steps, against a 30-s outage."""
DEFAULT_BUFFERS = {"max_buffer_rows": 100_000, "max_batch_rows": 5_000, "max_pending_batches": 16}
WARMUP_S = 3.0
"""Steps of the first seconds (process groups, first allocations) are left out."""
SAMPLE_S = 0.5
GOAL_STEP_PCT = 5.0
GOAL_BLOCK_MS = 10.0
"""No step waits on the collector: a blocked send would hold the step for a connect or HTTP
timeout (seconds), and a busy 2-core machine's scheduling delays stay below this."""
"""The outage moves neither the median nor the p95 step time by more than this (vs control)."""


# ---- the training job (one torchrun rank) --------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Train, profiled; write this rank's step times, samples and counts to args.out."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import stepscope
    from stepscope.profiler.shipping.shipper import Shipper

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(args.width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    produced: Counter[str] = Counter()
    add = Shipper.add

    def counting_add(self: Shipper, kind: str, row: Any) -> None:
        produced[kind] += 1
        add(self, kind, row)

    Shipper.add = counting_add  # type: ignore[method-assign]  # the job counts what it hands over
    buffers = {k: getattr(args, k) for k in DEFAULT_BUFFERS}
    prof = stepscope.init(job_id=args.job_id, url=args.url, **buffers)
    prof.watch(model)
    shipper = prof.shipper  # type: ignore[attr-defined]
    samples: list[tuple[float, int, int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            held = shipper.num_held_rows()
            samples.append((time.time(), rss_bytes(), held["steps"], sum(held.values())))

    sampler = threading.Thread(target=sample, daemon=True)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    dist.barrier()
    start_ts = time.time()
    if rank == 0:
        Path(args.out, "started").write_text(json.dumps(start_ts))
    sampler.start()
    steps: list[tuple[float, float, float]] = []
    for _ in range(args.steps):
        ts, t0 = time.time(), time.perf_counter()
        step = prof.step()
        step.__enter__()
        t1 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        prof.record(samples=args.batch)
        time.sleep(args.device_s)
        t2 = time.perf_counter()
        step.__exit__(None, None, None)
        t3 = time.perf_counter()
        # (start, step time, time inside stepscope's step() enter and exit), seconds
        steps.append((ts, t3 - t0, (t1 - t0) + (t3 - t2)))
    done.set()
    sampler.join()
    prof.close()
    stats = shipper.stats
    result = {
        "rank": rank,
        "start_ts": start_ts,
        "steps": steps,
        "samples": samples,
        "produced": dict(produced),
        "rows_sent": stats.num_rows_sent,
        "dropped": stats.num_dropped,
        "retries": stats.num_retries,
        "idle": shipper.idle,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown


def rss_bytes() -> int:
    """This process's resident memory now (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---- the benchmark ---------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Run:
    """One job and what became of it."""

    name: str
    outage: str
    """"none", "hung" or "refused"."""
    buffers: dict[str, int]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    start_ts: float = 0.0
    down_ts: float = 0.0
    up_ts: float = 0.0
    stored: dict[str, Counter[int]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def window(self, lo_s: float, hi_s: float) -> list[float]:
        """Step times (all ranks) of steps that started lo_s..hi_s after the job's start."""
        lo, hi = self.start_ts + lo_s, self.start_ts + hi_s
        return [d for r in self.ranks for ts, d, _ in r["steps"] if lo <= ts < hi]

    def in_profiler(self, lo_s: float, hi_s: float) -> list[float]:
        """Time each of those steps spent inside stepscope's step() enter and exit, seconds."""
        lo, hi = self.start_ts + lo_s, self.start_ts + hi_s
        return [p for r in self.ranks for ts, _, p in r["steps"] if lo <= ts < hi]

    def bound_rows(self) -> int:
        b = self.buffers
        return b["max_buffer_rows"] + b["max_pending_batches"] * b["max_batch_rows"]


@dataclass(kw_only=True, slots=True)
class Launched:
    """A job running against its own server."""

    run: Run
    server: Any
    """The tests' ServerProcess."""
    job: subprocess.Popen[bytes]
    out: Path
    db_url: str
    job_id: str


def launch(
    name: str, outage: str, buffers: dict[str, int], args: argparse.Namespace, stack: ExitStack
) -> Launched:
    """Start a server (SQLite in a temp dir) and a torchrun job streaming to it."""
    from tests.live_server import ServerProcess

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="stepscope-outage-"))
    db_url = f"sqlite:///{Path(tmp) / 'stepscope.db'}"
    job_id = f"outage-{name}-{int(time.time())}"
    out = Path(tmp, "out")
    out.mkdir()
    server = stack.enter_context(ServerProcess(db_url, log_path=Path(tmp, "server.log")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={args.ranks}", __file__]
    cmd += ["--worker", "--url", server.url, "--job-id", job_id, "--out", str(out)]
    cmd += ["--steps", str(args.steps), "--device-s", str(args.device_s)]
    cmd += ["--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    for key, value in buffers.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    stack.callback(lambda: job.poll() is None and job.kill())
    run = Run(name=name, outage=outage, buffers=buffers)
    return Launched(run=run, server=server, job=job, out=out, db_url=db_url, job_id=job_id)


def collect(launched: Launched, args: argparse.Namespace) -> Run:
    """Wait for the job; what its ranks counted, what was stored, its summary."""
    from tests.live_server import read_rows

    run, db_url, job_id = launched.run, launched.db_url, launched.job_id
    if launched.job.wait(timeout=600) != 0:
        raise SystemExit(f"{run.name}: the job exited with {launched.job.returncode}")
    run.ranks = [
        json.loads((launched.out / f"rank{r}.json").read_text()) for r in range(args.ranks)
    ]
    for kind in ("steps", "collectives"):  # no GPU on CPU: `dropped_gpu` stays 0
        run.stored[kind] = Counter(r["rank"] for r in read_rows(db_url, kind, job_id))
    events = read_rows(db_url, "events", job_id)
    own = [e for e in events if not e["message"].startswith(DROP_REPORT_PREFIX)]
    run.stored["events"] = Counter(e["rank"] for e in own)
    with urllib.request.urlopen(f"{launched.server.url}/api/v1/jobs/{job_id}", timeout=30) as r:
        run.summary = json.loads(r.read())
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        times = {"start_ts": run.start_ts, "down_ts": run.down_ts, "up_ts": run.up_ts}
        Path(args.keep, f"{run.name}.json").write_text(json.dumps({**times, "ranks": run.ranks}))
    return run


def run_pair(
    name: str, outage: str, buffers: dict[str, int], args: argparse.Namespace
) -> tuple[Run, Run]:
    """The job whose collector goes away as `outage` says, and at the same time a control job
    with its own server that stays: both see the same load from the rest of the machine."""
    with ExitStack() as stack:
        tested = launch(name, outage, buffers, args, stack)
        control = launch(f"{name}-control", "none", DEFAULT_BUFFERS, args, stack)
        for launched in (tested, control):
            launched.run.start_ts = wait_for_start(launched.out / "started", launched.job)
        run, server = tested.run, tested.server
        time.sleep(max(run.start_ts + args.outage_at_s - time.time(), 0.0))
        run.down_ts = time.time()
        if outage == "hung":
            server.pause()
        else:
            server.kill()
        time.sleep(args.outage_s)
        if outage == "hung":
            server.resume()
        else:
            server.start()
        run.up_ts = time.time()
        runs = collect(tested, args), collect(control, args)
    print(f"  {name}: done", file=sys.stderr)
    return runs


def wait_for_start(path: Path, job: subprocess.Popen[bytes], timeout_s: float = 180.0) -> float:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the job did not start (exit {job.poll()})")
        time.sleep(0.05)
    time.sleep(0.05)  # the file is written whole before the next poll
    return float(json.loads(path.read_text()))


# ---- figures -----------------------------------------------------------------------------------


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f} %"


def step_figures(run: Run, control: Run) -> list[tuple[str, str, str]]:
    """Median and p95 step time while the collector was away, vs the control and vs before."""
    lo_s, hi_s = run.down_ts - run.start_ts, run.up_ts - run.start_ts
    during, same = run.window(lo_s, hi_s), control.window(lo_s, hi_s)
    before = run.window(WARMUP_S, lo_s)
    control_before = control.window(WARMUP_S, lo_s)
    rows = []
    for stat_name, stat in (("median", statistics.median), ("p95", p95)):
        d, c, b = stat(during), stat(same), stat(before)
        aa = stat(same) / stat(control_before)
        verdict = "met" if abs(d / c - 1) * 100 <= GOAL_STEP_PCT else "NOT met"
        rows.append(
            (
                f"{run.name}: {stat_name} step during the outage (n={len(during)})",
                f"{d * 1e3:.1f} ms vs control {c * 1e3:.1f} ms ({pct(d / c)}); vs before "
                f"{b * 1e3:.1f} ms ({pct(d / b)}); control's own later/before {pct(aa)}",
                f"within ±{GOAL_STEP_PCT:.0f} % of control: {verdict}",
            )
        )
    inside, inside_control = run.in_profiler(lo_s, hi_s), control.in_profiler(lo_s, hi_s)
    # After its return the backlog is encoded and sent: that is when a GIL stall would show.
    after_ms = max(run.in_profiler(hi_s, float("inf")), default=0.0) * 1e3
    worst_ms = max(max(inside) * 1e3, after_ms)
    rows.append(
        (
            f"{run.name}: time in stepscope's step() per step",
            f"during the outage: median {statistics.median(inside) * 1e6:.0f} us, p99 "
            f"{statistics.quantiles(inside, n=100)[-1] * 1e6:.0f} us, max "
            f"{max(inside) * 1e3:.1f} ms (control, same window: median "
            f"{statistics.median(inside_control) * 1e6:.0f} us, max "
            f"{max(inside_control) * 1e3:.1f} ms); after it: max {after_ms:.1f} ms",
            f"never blocks (max < {GOAL_BLOCK_MS:.0f} ms): "
            f"{'met' if worst_ms < GOAL_BLOCK_MS else 'NOT met'}",
        )
    )
    return rows


def memory_figures(run: Run, control: Run) -> list[tuple[str, str, str]]:
    """RSS growth over the outage window (vs the control's) and peak rows held vs the bound."""

    def growth_mib(r: Run, lo_ts: float, hi_ts: float) -> float:
        """The largest growth of a rank's RSS from lo_ts to its peak before hi_ts, in MiB."""
        growths = []
        for rank in r.ranks:
            before = [rss for ts, rss, _, _ in rank["samples"] if ts < lo_ts] or [0]
            inside = [rss for ts, rss, _, _ in rank["samples"] if lo_ts <= ts <= hi_ts] or [0]
            growths.append((max(inside) - before[-1]) / 2**20)
        return max(growths)

    lo_s, hi_s = run.down_ts - run.start_ts, run.up_ts - run.start_ts
    rss = growth_mib(run, run.down_ts, run.up_ts)
    rss_late = growth_mib(run, (run.down_ts + run.up_ts) / 2, run.up_ts)
    rss_control = growth_mib(control, control.start_ts + lo_s, control.start_ts + hi_s)
    held_steps = max(s[2] for rank in run.ranks for s in rank["samples"])
    held_all = max(s[3] for rank in run.ranks for s in rank["samples"])
    bound = run.bound_rows()
    verdict = "met" if held_steps <= bound else "NOT met"
    return [
        (
            f"{run.name}: profiler memory during the outage",
            f"RSS +{rss:.1f} MiB, +{rss_late:.1f} of it in its second half (control, same "
            f"window: +{rss_control:.1f} MiB); peak rows held "
            f"{held_steps} steps / {held_all} all kinds, per rank",
            f"≤ bound {bound:,} rows per kind: {verdict}",
        )
    ]


def catch_up_s(run: Run) -> float | None:
    """Seconds from the collector's return until every rank held no more step rows than
    before the outage; None when some rank still held more at its last sample."""
    worst = 0.0
    for rank in run.ranks:
        normal = max([s[2] for s in rank["samples"] if s[0] < run.down_ts] or [0])
        after = [s for s in rank["samples"] if s[0] >= run.up_ts]
        drained = next((ts for ts, _, held, _ in after if held <= normal), None)
        if drained is None:
            return None
        worst = max(worst, drained - run.up_ts)
    return worst


def arrival_figures(run: Run) -> list[tuple[str, str, str]]:
    """Rows stored vs rows the job handed to the profiler, after the outage."""
    made = {k: sum(r["produced"].get(k, 0) for r in run.ranks) for k in ("steps", "collectives")}
    stored = {k: sum(run.stored[k].values()) for k in made}
    dropped = sum(sum(r["dropped"].values()) for r in run.ranks)
    ok = stored == made and dropped == 0
    caught = catch_up_s(run)
    catch = "after the job (at close)" if caught is None else f"{caught:.1f} s after its return"
    return [
        (
            f"{run.name}: rows after recovery",
            f"steps {stored['steps']}/{made['steps']}, collectives "
            f"{stored['collectives']}/{made['collectives']} stored/produced, {dropped} dropped; "
            f"backlog drained {catch}",
            f"everything arrived: {'met' if ok else 'NOT met'}",
        )
    ]


def drop_figures(run: Run) -> list[tuple[str, str, str]]:
    """With buffers smaller than the outage: stored + dropped = produced, per rank and kind
    (events: the job's, not the profiler's drop reports); the summary's num_records_dropped
    = produced − stored."""
    exact = True
    missing = 0
    dropped_steps = 0
    for r in run.ranks:
        for kind in ("steps", "collectives", "events"):
            made, stored = r["produced"].get(kind, 0), run.stored[kind][r["rank"]]
            exact &= stored + r["dropped"][kind] == made
            print(
                f"  {run.name} rank {r['rank']} {kind}: stored {stored} + dropped "
                f"{r['dropped'][kind]} vs produced {made}",
                file=sys.stderr,
            )
            missing += made - stored
        exact &= r["dropped"]["gpu"] == 0
        dropped_steps += r["dropped"]["steps"]
    reported = run.summary["num_records_dropped"]
    made_steps = sum(r["produced"].get("steps", 0) for r in run.ranks)
    return [
        (
            f"{run.name}: stored + dropped = produced, per rank and kind",
            f"{'exact' if exact else 'NOT exact'} ({dropped_steps} of {made_steps} step rows "
            f"dropped; bound {run.bound_rows()} rows per kind)",
            f"exact: {'met' if exact and dropped_steps else 'NOT met'}",
        ),
        (
            f"{run.name}: summary num_records_dropped",
            f"{reported} (missing from the store: {missing})",
            f"= missing: {'met' if reported == missing else 'NOT met'}",
        ),
    ]


def print_table(rows: list[tuple[str, str, str]]) -> None:
    print("\n| figure | measured | goal |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=850, help="steps per job (~55 s)")
    p.add_argument("--device-s", type=float, default=0.055, help="sleep per step, seconds")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--outage-at-s", type=float, default=12.0, help="into the job, seconds")
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--runs", default="hung,refused,small", help="which of hung,refused,small")
    p.add_argument("--keep", default=None, help="directory for each run's raw per-rank data")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--job-id", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    for key, value in DEFAULT_BUFFERS.items():
        p.add_argument(
            f"--{key.replace('_', '-')}", type=int, default=value, help=argparse.SUPPRESS
        )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    wanted = args.runs.split(",")
    plan = {
        "hung": ("hung", DEFAULT_BUFFERS),
        "refused": ("refused", DEFAULT_BUFFERS),
        "small": ("refused", SMALL_BUFFERS),
    }
    began = time.monotonic()
    pairs = {name: run_pair(name, *plan[name], args) for name in plan if name in wanted}
    print(
        f"{args.ranks} ranks x {args.steps} steps (DDP MLP {args.width}x{args.depth}, batch "
        f"{args.batch}, + {args.device_s * 1e3:.0f} ms sleep per step); collector away "
        f"{args.outage_s:.0f} s from {args.outage_at_s:.0f} s into the job; "
        f"{time.monotonic() - began:.0f} s in all"
    )
    for run in (run for pair in pairs.values() for run in pair):
        made = sum(len(r["steps"]) for r in run.ranks)
        outage = ""
        if run.outage != "none":
            outage = f", collector away {run.up_ts - run.down_ts:.1f} s ({run.outage})"
        print(f"  {run.name}: {made} rank-steps{outage}")
    rows: list[tuple[str, str, str]] = []
    for name in ("hung", "refused"):
        if name in pairs:
            run, control = pairs[name]
            rows += step_figures(run, control) + memory_figures(run, control)
            rows += arrival_figures(run)
    if "small" in pairs:
        run, control = pairs["small"]
        rows += memory_figures(run, control) + drop_figures(run)
    print_table(rows)


if __name__ == "__main__":
    main()
