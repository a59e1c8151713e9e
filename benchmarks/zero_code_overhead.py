"""Zero-code's CPU per step beside hand instrumentation, no profiler, and TraceML 0.5.

One training loop, one process per arm, 1 rank and no process group, pinned to core 0 with one
torch thread: profiler_cost.build_model's MLP (512 wide, 3 hidden layers), SGD, a torch
DataLoader of prebuilt batches. Each process runs two phases of the loop on the same model:
`full` (batch 420, ~20 ms of CPU a step) and `tiny` (batch 1, ~1.5 ms here: the same hooks
and records, so an instrument's cost per step stands out of the matrix work's swings). The arms:

    plain, plain-b  the loop alone (profiler_cost.plain_segment); plain-b is the A/A control
    hand            stepscope.init(model=...), wrap_dataloader, step(), sections, record()
                    (profiler_cost.profiled_segment)
    zero-code       the plain loop in `stepscope run`'s environment (launcher.child_env: the
                    bootstrap first on PYTHONPATH, STEPSCOPE_AUTO=1, STEPSCOPE_URL and _JOB_ID);
                    the launcher's node relay and dump watcher are not started
    traceml-run     the plain loop under `traceml run`, TraceML 0.5's zero-code command (it
                    launches torch.distributed.run, 1 process, and its runpy executor): on a
                    loop that is not a Hugging Face, Lightning or RF-DETR trainer it patches
                    nothing and times no step; only its runtime and samplers run
    traceml-step    the same with TraceML's two lines for a custom loop: traceml.init(mode=
                    "auto") (patches nn.Module.__call__, backward, the DataLoader, the
                    optimizer) and `with traceml.trace_step(model):` around each step

A round starts every arm in a fresh process at once; once all are set up they take turns, one
step each, in a new random order every cycle (a loopback socket to this process passes the
turn), so each arm's step i ran on the same machine as the others' step i: the load of a
shared machine, which moves a process's CPU per step by 20 % and more, hits all arms alike.
Every step thus starts after other processes' work on its core, with cold caches, as a real
step's hooks run after ~20 ms of matrix work. Per arm and phase: the training thread's CPU
per step (its clock across each step, the batch's fetch included), the instrument's threads'
(every Python thread but the training one: stepscope's shipper and watchdog, TraceML's
exporter and sampler) and the native ones' (the kernel's per-thread clocks,
overhead_lockstep.threads_cpu_s), and a step's wall time; the first `--warmup` steps of each
phase are left out. A round's cost of an arm is its mean less plain's; the figures are medians
over rounds with a bootstrap 95 % interval, plain-b's beside them. What runs outside the
training process is counted for neither tool: each stepscope arm's local collector (a sink
for POST /v1/ingest in this process), TraceML's aggregator.

Module calls, in the same rounds: a model of 75 Linear/ReLU pairs and a last Linear (152
module calls a forward, the root Sequential's included) trains 5 steps through a DataLoader,
so that zero-code has found its root and dropped its global module hooks (after step 3);
then, a block per turn, its forwards are timed (training thread CPU, grad on, train mode) in
a plain process and under zero-code: the difference over 152 is zero-code's cost per module
call after discovery. In each process the model is also timed against an identical twin
that was never a root (not timed at all), and the global module hooks left are counted.

TraceML has a venv of its own (traceml-ai 0.5, torch pinned to this one's version so that pip
takes the local CPU wheel; the same interpreter), made once under ~/.cache/stepscope-bench;
where it cannot be installed or run, the reason is printed and the other arms still are. Its
arms run torchrun, hence the second lock:

    flock /tmp/stepscope-bench.lock flock /tmp/stepscope-torchrun.lock \
        .venv/bin/python benchmarks/zero_code_overhead.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead_lockstep import threads_cpu_s  # noqa: E402
from profiler_cost import (  # noqa: E402
    _Sink,
    build_model,
    free_port,
    host_speed_text,
    median_ci,
    plain_segment,
    profiled_segment,
)

ARMS = ("plain", "plain-b", "hand", "zero-code", "traceml-run", "traceml-step")
TRACEML_ARMS = ("traceml-run", "traceml-step")
MODULE_ARMS = ("modules-plain", "modules-zero-code")
ZERO_CODE_ARMS = ("zero-code", "modules-zero-code")
PHASES = ("full", "tiny")
WIDTH, DEPTH = 512, 3
PHASE_BATCH = {"full": 420, "tiny": 1}
"""Rows per batch: `full` took ~20 ms of CPU a step on a host that runs 10^6 Python additions
in 21 ms."""
MODULES_WIDTH, MODULES_DEPTH, MODULES_BATCH = 16, 75, 8
NUM_MODULE_CALLS = 2 * MODULES_DEPTH + 2
MODULES_TRAIN_STEPS = 5
GOAL_OVER_HAND_US = 30.0
GOAL_PER_MODULE_CALL_US = 0.3
TRACEML_SPEC = "traceml-ai==0.5.*"
VENV_DIR = Path.home() / ".cache" / "stepscope-bench" / "traceml-venv"
REPO_DIR = Path(__file__).resolve().parent.parent
TOOL = "instrument's threads"
"""Key of the sum over every Python thread but the training one."""
TURN_TIMEOUT_S = 300.0

Mark = tuple[float, dict[str, float]]
"""The wall clock and every thread's CPU (seconds) at a point of the run."""


# ---- inside an arm's process ---------------------------------------------------------------


class _Turns:
    """This process's turns, passed over a loopback socket by the benchmark's parent."""

    def __init__(self, port: int, arm: str) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=TURN_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(arm.encode() + b"\n")  # set up: ready for turns

    def wait(self) -> None:
        if self._sock.recv(1) != b"g":
            raise RuntimeError("the benchmark ended the run")

    def done(self) -> None:
        self._sock.sendall(b"d")


class _Batches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Prebuilt (x, y) batches: `num_full` of `full_rows` rows, then `num_tiny` tiny ones."""

    def __init__(self, num_full: int, num_tiny: int, *, width: int, full_rows: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.num_full, self.num_tiny = num_full, num_tiny
        self.full = [torch.randn(full_rows, width, generator=gen) for _ in range(8)]
        self.tiny = [torch.randn(PHASE_BATCH["tiny"], width, generator=gen) for _ in range(8)]

    def __len__(self) -> int:
        return self.num_full + self.num_tiny

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = self.full if index < self.num_full else self.tiny
        x = xs[index % len(xs)]
        return x, x.sum(dim=1, keepdim=True)


def _mark() -> Mark:
    return time.perf_counter(), threads_cpu_s()


def _in_turns(
    loader: DataLoader[Any],
    turns: _Turns,
    marks_at: set[int],
    marks: list[Mark],
    steps_cpu_s: list[float],
    steps_wall_s: list[float],
) -> Iterator[Any]:
    """The loader's batches, each in a turn that ends when the next is asked for; per step its
    training-thread CPU and wall time, and `marks` before each step in `marks_at` and at the end."""
    batches = iter(loader)
    num_steps = len(loader)
    for index in range(num_steps):
        turns.wait()
        if index in marks_at:
            marks.append(_mark())
        start_cpu_s, start_wall_s = time.thread_time(), time.perf_counter()
        yield next(batches)
        steps_cpu_s.append(time.thread_time() - start_cpu_s)
        steps_wall_s.append(time.perf_counter() - start_wall_s)
        if index == num_steps - 1:
            marks.append(_mark())
        turns.done()


def _phase_figures(
    start: Mark, end: Mark, steps_cpu_s: list[float], steps_wall_s: list[float]
) -> dict[str, Any]:
    """Per step of a phase: the training thread's CPU and the wall (from each step's clocks),
    every other thread's CPU (from the marks), µs."""
    (_, start_threads), (_, end_threads) = start, end
    threads_us = {
        name: (seconds - start_threads.get(name, 0.0)) / len(steps_cpu_s) * 1e6
        for name, seconds in end_threads.items()
        if name != "training"
    }
    threads_us[TOOL] = sum(us for name, us in threads_us.items() if name != "native")
    threads_us["training"] = statistics.fmean(steps_cpu_s) * 1e6
    return {"wall_us": statistics.fmean(steps_wall_s) * 1e6, "threads_us": threads_us}


def _traceml_segment(
    model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, ...]]
) -> None:
    """plain_segment's loop with TraceML's documented lines for a custom loop."""
    import traceml_ai as traceml

    traceml.init(mode="auto")
    for x, y in batches:
        with traceml.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def train(arm: str, turns_port: int, steps: int, tiny_steps: int, warmup: int) -> dict[str, Any]:
    """Both phases of the loop under `arm`, a step a turn; per phase, its figures per step."""
    model = build_model(WIDTH, DEPTH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = DataLoader(
        _Batches(steps, tiny_steps, width=WIDTH, full_rows=PHASE_BATCH["full"]), batch_size=None
    )
    result: dict[str, Any] = {}
    prof = None
    if arm == "hand":
        import stepscope

        prof = stepscope.init(model=model)  # STEPSCOPE_URL and _JOB_ID from the environment
        result["enabled"] = prof.enabled
    marks: list[Mark] = []
    steps_cpu_s: list[float] = []
    steps_wall_s: list[float] = []
    turns = _Turns(turns_port, arm)
    batches = _in_turns(
        loader, turns, {warmup, steps, steps + warmup}, marks, steps_cpu_s, steps_wall_s
    )
    if prof is not None:
        profiled_segment(model, opt, batches, prof)
        prof.close()
    elif arm == "traceml-step":
        _traceml_segment(model, opt, batches)
    else:
        plain_segment(model, opt, batches)
    if arm in ZERO_CODE_ARMS:
        result.update(_zero_code_state())
    full_start, full_end, tiny_start, tiny_end = marks
    result["full"] = _phase_figures(
        full_start, full_end, steps_cpu_s[warmup:steps], steps_wall_s[warmup:steps]
    )
    result["tiny"] = _phase_figures(
        tiny_start, tiny_end, steps_cpu_s[steps + warmup :], steps_wall_s[steps + warmup :]
    )
    return result


def _zero_code_state() -> dict[str, Any]:
    """Whether zero-code profiled this process, the steps it inferred, the global hooks left."""
    from stepscope.profiler.auto import hooks

    zero_code = hooks._zero_code
    inference = zero_code.inference if zero_code is not None else None
    return {
        "enabled": inference is not None,
        "steps_inferred": inference.num_steps if inference is not None else 0,
        "global_hooks": num_global_module_hooks(),
    }


def num_global_module_hooks() -> int:
    """Forward and backward hooks registered for every module (each costs all their fast path)."""
    from torch.nn.modules import module

    return sum(
        len(hooks)
        for hooks in (
            module._global_forward_pre_hooks,
            module._global_forward_hooks,
            module._global_backward_pre_hooks,
            module._global_backward_hooks,
        )
    )


def module_calls(arm: str, turns_port: int, forwards: int, blocks: int) -> dict[str, Any]:
    """Train the many-module model past discovery, then time its forward and an unhooked
    twin's, a block of each per turn; medians over blocks, training thread CPU µs."""
    model = build_model(MODULES_WIDTH, MODULES_DEPTH)
    twin = build_model(MODULES_WIDTH, MODULES_DEPTH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    dataset = _Batches(MODULES_TRAIN_STEPS, 0, width=MODULES_WIDTH, full_rows=MODULES_BATCH)
    plain_segment(model, opt, DataLoader(dataset, batch_size=None))
    x = torch.randn(MODULES_BATCH, MODULES_WIDTH)
    times_us: dict[str, list[float]] = {"root": [], "twin": []}
    turns = _Turns(turns_port, arm)
    for block in range(blocks):
        turns.wait()
        for name in ("root", "twin") if block % 2 == 0 else ("twin", "root"):
            forward = model if name == "root" else twin
            start_s = time.thread_time()
            for _ in range(forwards):
                forward(x)
            times_us[name].append((time.thread_time() - start_s) / forwards * 1e6)
        turns.done()
    result = {
        "root_us": statistics.median(times_us["root"]),
        "twin_us": statistics.median(times_us["twin"]),
        "root_timing": _root_timing(model),
    }
    if arm in ZERO_CODE_ARMS:
        result.update(_zero_code_state())
    return result


def _root_timing(model: nn.Module) -> str:
    """How zero-code times the root's forward: through its call, or with its own hooks."""
    num_hooks = len(model._forward_pre_hooks) + len(model._forward_hooks)
    if vars(model).get("_compiled_call_impl") is not None:
        return f"its call wrapped, {num_hooks} hooks"
    return f"{num_hooks} hooks"


def arm_main(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    if args.arm in MODULE_ARMS:
        result = module_calls(args.arm, args.turns_port, args.forwards, args.blocks)
    else:
        result = train(args.arm, args.turns_port, args.steps, args.tiny_steps, args.warmup)
    Path(args.out).write_text(json.dumps(result))


# ---- the parent: launches, turns, figures --------------------------------------------------


class _SinkServer(ThreadingHTTPServer):
    """A local collector for one stepscope arm, counting its batches."""

    daemon_threads = True
    num_ingests = 0


class _CountingSink(_Sink):
    """profiler_cost's sink, counting the ingest requests on its server."""

    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/v1/ingest":
            server = cast(_SinkServer, self.server)
            with _CountingSink.lock:
                server.num_ingests += 1
        super().do_POST()


def start_sink() -> _SinkServer:
    server = _SinkServer(("127.0.0.1", 0), _CountingSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def traceml_venv() -> tuple[Path | None, str]:
    """TraceML's venv (made once), or None and why it cannot be had."""
    commands = []
    if not (VENV_DIR / "bin" / "traceml").exists():
        torch_pin = f"torch=={torch.__version__.split('+')[0]}"
        commands = [
            [sys.executable, "-m", "venv", "--clear", str(VENV_DIR)],
            [str(VENV_DIR / "bin" / "pip"), "install", "-q", TRACEML_SPEC, torch_pin],
        ]
    commands.append([str(VENV_DIR / "bin" / "python"), "-c", "import traceml_ai, torch"])
    for command in commands:
        try:
            subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
        except subprocess.CalledProcessError as exc:
            return None, f"`{' '.join(command)}` failed: {exc.stderr.strip()[-600:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"`{' '.join(command)}` failed: {exc}"
    return VENV_DIR, ""


def launch_arm(
    arm: str, args: argparse.Namespace, port: int, url: str | None, tmp: Path, log: IO[str]
) -> subprocess.Popen[str]:
    """Start one arm's process (a session of its own): the script alone, in stepscope's
    environments (`url`: the arm's collector), or under `traceml run`."""
    from stepscope.profiler.launch.launcher import child_env

    child_args = [
        "--arm", arm, "--out", str(tmp / f"{arm}.json"), "--turns-port", str(port),
        "--steps", str(args.steps), "--tiny-steps", str(args.tiny_steps),
        "--warmup", str(args.warmup),
        "--forwards", str(args.forwards), "--blocks", str(args.blocks),
    ]  # fmt: skip
    command = [sys.executable, __file__, *child_args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSCOPE_")}
    job_id = f"bench-{arm}-{os.getpid()}-{time.monotonic_ns()}"
    if arm in ZERO_CODE_ARMS:
        env = child_env(command, job_id=job_id, url=url, token=None)
    elif arm == "hand" and url is not None:
        env.update(STEPSCOPE_URL=url, STEPSCOPE_JOB_ID=job_id)
    elif arm in TRACEML_ARMS:
        env["PYTHONPATH"] = str(REPO_DIR)  # stepscope, which overhead_lockstep imports
        command = [
            str(VENV_DIR / "bin" / "traceml"), "run", __file__, "--nproc-per-node", "1",
            "--mode", "summary", "--logs-dir", str(tmp), "--run-name", arm,
            "--aggregator-port", str(free_port()), "--master-port", str(free_port()),
            "--no-save-training-output", "--finalize-timeout-sec", "30",
            "--args", *child_args,
        ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


class _Round:
    """One round's processes, their turn sockets, and the TraceML arms that failed."""

    def __init__(self, tmp: Path, procs: dict[str, subprocess.Popen[str]]) -> None:
        self.tmp = tmp
        self.procs = procs
        self.turns: dict[str, socket.socket] = {}
        self.failed: dict[str, str] = {}

    def fail(self, arm: str, why: str) -> None:
        """A TraceML arm is left out of the round (its processes ended); any other stops
        the benchmark."""
        why = f"{why}\n{self.log_tail(arm)}"
        if arm not in TRACEML_ARMS:
            raise RuntimeError(f"arm {arm} failed: {why}")
        self.failed[arm] = why
        self.end(arm)

    def end(self, arm: str) -> None:
        if self.procs[arm].poll() is None:
            os.killpg(self.procs[arm].pid, signal.SIGKILL)  # the session it was started in
            self.procs[arm].wait()

    def log_tail(self, arm: str) -> str:
        try:
            return (self.tmp / f"{arm}.log").read_text()[-1500:]
        except OSError:
            return "(no output)"

    def accept_all(self, server: socket.socket) -> None:
        """Each arm's turn socket, once its process is set up."""
        server.settimeout(1.0)
        deadline_s = time.monotonic() + TURN_TIMEOUT_S
        while len(self.turns) + len(self.failed) < len(self.procs):
            waiting = [arm for arm in self.procs if arm not in self.turns | self.failed.keys()]
            if time.monotonic() > deadline_s:
                for arm in waiting:
                    self.fail(arm, f"not set up in {TURN_TIMEOUT_S:.0f} s")
                continue
            try:
                conn, _ = server.accept()
            except TimeoutError:
                for arm in waiting:
                    if self.procs[arm].poll() is not None:
                        self.fail(arm, f"exit {self.procs[arm].returncode} before its first step")
                continue
            conn.settimeout(TURN_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            name = b""
            while not name.endswith(b"\n"):
                name += conn.recv(64)
            self.turns[name.decode().strip()] = conn

    def take_turns(self, turns_left: dict[str, int], rng: random.Random) -> None:
        """A turn for each arm with some left, in a new random order every cycle."""
        while turns_left:
            for arm in rng.sample(sorted(turns_left), len(turns_left)):
                try:
                    self.turns[arm].sendall(b"g")
                    if self.turns[arm].recv(1) != b"d":
                        raise OSError("its process closed its turns")
                except OSError as exc:
                    del turns_left[arm]
                    self.fail(arm, str(exc))
                    continue
                turns_left[arm] -= 1
                if turns_left[arm] == 0:
                    del turns_left[arm]

    def results(self) -> dict[str, dict[str, Any]]:
        """Each arm's result, once its process ended."""
        results = {}
        for arm, proc in self.procs.items():
            returncode = proc.wait(timeout=600)
            out = self.tmp / f"{arm}.json"
            if arm in self.failed:
                continue
            if returncode != 0 or not out.exists():
                self.fail(arm, f"exit {returncode}")
                continue
            results[arm] = json.loads(out.read_text())
            if arm in TRACEML_ARMS:
                summary = self.tmp / arm / "final_summary.json"
                results[arm]["steps_recorded"] = traceml_steps(summary)
        return results


def run_round(
    arms: list[str], args: argparse.Namespace, sinks: dict[str, _SinkServer], rng: random.Random
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every arm in a fresh process, in lock-step; their results, and why any TraceML arm
    failed."""
    with (
        tempfile.TemporaryDirectory(prefix="zero-code-bench-") as tmp_name,
        socket.create_server(("127.0.0.1", 0)) as server,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmp_name)
        port = server.getsockname()[1]
        ingests_before = {arm: sink.num_ingests for arm, sink in sinks.items()}
        procs = {}
        for arm in arms:
            log = stack.enter_context((tmp / f"{arm}.log").open("w"))
            url = f"http://127.0.0.1:{sinks[arm].server_address[1]}" if arm in sinks else None
            procs[arm] = launch_arm(arm, args, port, url, tmp, log)
        this_round = _Round(tmp, procs)
        try:
            this_round.accept_all(server)
            turns_s = time.monotonic()
            this_round.take_turns(
                {
                    arm: args.blocks if arm in MODULE_ARMS else args.steps + args.tiny_steps
                    for arm in this_round.turns
                },
                rng,
            )
            ends_s = time.monotonic()
            results = this_round.results()
        finally:
            for arm in procs:
                this_round.end(arm)
            for sock in this_round.turns.values():
                sock.close()
        print(
            f"  {len(procs)} processes set up; their turns took {ends_s - turns_s:.0f} s, "
            f"their ends {time.monotonic() - ends_s:.0f} s",
            flush=True,
        )
    for arm, sink in sinks.items():
        if arm in results:
            results[arm]["ingests"] = sink.num_ingests - ingests_before[arm]
    return results, this_round.failed


def traceml_steps(summary: Path) -> int:
    """The steps TraceML's final summary says it timed (0 without one)."""
    try:
        metadata = json.loads(summary.read_text())["step_time"]["metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return int(metadata.get("training_total_steps") or 0)


def verdict_us(median: float, high: float, goal: float) -> str:
    """The verdict on a cost in µs against a goal, by its 95 % interval's upper end."""
    if high <= goal:
        return "met"
    if median <= goal:
        return "met by the median, not by the interval's upper end"
    return "NOT met"


def _own_us(row: dict[str, Any]) -> float:
    """The training thread's and the instrument's threads' CPU per step, µs."""
    return float(row["threads_us"]["training"] + row["threads_us"][TOOL])


def _over(
    results: dict[str, list[dict[str, Any]]], arm: str, base: str, phase: str, key: str
) -> tuple[float, float, float]:
    """Median over rounds of `arm`'s figure less `base`'s, and its bootstrap 95 % interval;
    key "own": the training thread and the instrument's threads, else a thread's name."""

    def figure(row: dict[str, Any]) -> float:
        threads = row[phase]["threads_us"]
        return _own_us(row[phase]) if key == "own" else float(threads.get(key, 0.0))

    pairs = zip(results[arm], results[base], strict=True)
    return median_ci([figure(a) - figure(b) for a, b in pairs])


def _interval(median: float, low: float, high: float, digits: int = 1) -> str:
    return f"{median:+.{digits}f} [{low:+.{digits}f} .. {high:+.{digits}f}]"


def print_phase(phase: str, results: dict[str, list[dict[str, Any]]]) -> None:
    """One phase's table: medians over rounds, and each arm less plain with its interval."""
    arms = [arm for arm in ARMS if arm in results]
    print(
        f"{phase} (batch {PHASE_BATCH[phase]}), per step, medians over rounds; `over plain`: "
        "less plain's in the same round [95 % CI]"
    )
    print(
        f"  {'arm':<13} {'wall ms':>8} {'training µs':>12} {'over plain':>24} "
        f"{TOOL + ' µs':>22} {'native µs':>10} {'training + instrument over plain':>34}"
    )
    for arm in arms:
        rows = [row[phase] for row in results[arm]]
        training = _interval(*_over(results, arm, "plain", phase, "training"))
        own = _interval(*_over(results, arm, "plain", phase, "own"))
        print(
            f"  {arm:<13} {statistics.median(r['wall_us'] for r in rows) / 1e3:>8.2f} "
            f"{statistics.median(r['threads_us']['training'] for r in rows):>12.1f} "
            f"{training:>24} {statistics.median(r['threads_us'][TOOL] for r in rows):>22.1f} "
            f"{statistics.median(r['threads_us'].get('native', 0.0) for r in rows):>10.1f} "
            f"{own:>34}"
        )
    names = sorted(
        {name for arm in arms for row in results[arm] for name in row[phase]["threads_us"]}
        - {"training", "native", TOOL}
    )
    for name in names:
        figures = ", ".join(
            f"{arm} {statistics.median(r[phase]['threads_us'].get(name, 0.0) for r in rows):.1f}"
            for arm, rows in results.items()
            if arm in arms and any(name in r[phase]["threads_us"] for r in rows)
        )
        print(f"    thread {name}: {figures} µs per step")


def print_goals(results: dict[str, list[dict[str, Any]]]) -> None:
    for phase in PHASES:
        median, low, high = _over(results, "zero-code", "hand", phase, "own")
        aa = _interval(*_over(results, "plain-b", "plain", phase, "own"))
        print(
            f"{phase}: zero-code less hand, training + instrument's threads: "
            f"{_interval(median, low, high)} µs per step (A/A plain-b less plain {aa}); goal "
            f"<= +{GOAL_OVER_HAND_US:.0f} µs: {verdict_us(median, high, GOAL_OVER_HAND_US)}"
        )
        if "traceml-step" in results:
            median, low, high = _over(results, "zero-code", "traceml-step", phase, "own")
            print(
                f"{phase}: zero-code less traceml-step, the same: {_interval(median, low, high)} "
                f"µs per step; goal < 0 (zero-code below TraceML): {verdict_us(median, high, 0.0)}"
            )
    zero, hand = results["zero-code"], results["hand"]
    print(
        f"per round: zero-code inferred {_each(zero, 'steps_inferred')} steps and its collector "
        f"took {_each(zero, 'ingests')} batches (hand's: {_each(hand, 'ingests')}); global "
        f"module hooks left at its end: {_each(zero, 'global_hooks')}"
    )
    for arm in TRACEML_ARMS:
        if arm in results:
            print(
                f"per round: steps in TraceML's final summary, {arm}: "
                f"{_each(results[arm], 'steps_recorded')}"
            )


def _each(rows: list[dict[str, Any]], key: str) -> str:
    return "/".join(str(row[key]) for row in rows)


def print_module_calls(results: dict[str, list[dict[str, Any]]]) -> None:
    plain, zero = results["modules-plain"], results["modules-zero-code"]
    per_call = [
        (z["root_us"] - p["root_us"]) / NUM_MODULE_CALLS for z, p in zip(zero, plain, strict=True)
    ]
    median, low, high = median_ci(per_call)
    print(
        f"module calls after discovery ({NUM_MODULE_CALLS} a forward; training thread CPU, "
        f"medians over rounds): plain {statistics.median(p['root_us'] for p in plain):.1f} µs a "
        f"forward, zero-code {statistics.median(z['root_us'] for z in zero):.1f} µs: "
        f"{_interval(median, low, high, 3)} µs per module call; goal <= "
        f"{GOAL_PER_MODULE_CALL_US} µs: {verdict_us(median, high, GOAL_PER_MODULE_CALL_US)}"
    )
    root = _interval(*median_ci([z["root_us"] - z["twin_us"] for z in zero]), 2)
    control = _interval(*median_ci([p["root_us"] - p["twin_us"] for p in plain]), 2)
    print(
        f"  the model less its never-rooted twin, a forward: under zero-code {root} µs (the "
        f"root: {zero[0]['root_timing']}), plain {control} µs; global module hooks left: "
        f"{_each(zero, 'global_hooks')} (goal 0)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=150, help="steps of the full phase, per process")
    p.add_argument("--tiny-steps", type=int, default=1500, help="steps of the tiny phase")
    p.add_argument("--warmup", type=int, default=30, help="first steps of each phase left out")
    p.add_argument("--forwards", type=int, default=100, help="forwards per timed block")
    p.add_argument("--blocks", type=int, default=40, help="timed blocks per model")
    p.add_argument("--no-traceml", action="store_true", help="leave TraceML's arms out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arm", choices=ARMS + MODULE_ARMS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--turns-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm is not None:
        arm_main(args)
        return

    venv, why = (None, "left out (--no-traceml)") if args.no_traceml else traceml_venv()
    arms = [arm for arm in ARMS if venv is not None or arm not in TRACEML_ARMS]
    arms += MODULE_ARMS
    print(
        f"{len(arms)} arms, a process each per round, in lock-step (a step or a block of "
        f"forwards a turn); core 0, 1 torch thread, no process group; MLP {WIDTH} wide, {DEPTH} "
        f"hidden layers, DataLoader; {args.steps} full steps and {args.tiny_steps} tiny ones, the "
        f"first {args.warmup} of each left out; {args.rounds} rounds; stepscope from {REPO_DIR}; "
        f"{host_speed_text()}",
        flush=True,
    )
    if venv is None:
        print(f"TraceML's arms are not run: {why}", flush=True)
    else:
        print(f"TraceML: {TRACEML_SPEC} in {venv}", flush=True)
    sinks = {arm: start_sink() for arm in ("hand", *ZERO_CODE_ARMS)}
    rng = random.Random(args.seed)
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for round_index in range(args.rounds):
        start_s = time.monotonic()
        found, failed = run_round(arms, args, sinks, rng)
        for arm, why in failed.items():
            print(f"  TraceML's arm {arm} failed and is left out: {why}", flush=True)
            arms.remove(arm)
            results.pop(arm)  # its earlier rounds cannot be paired with the later ones
        for arm in arms:
            results[arm].append(found[arm])
        line = ", ".join(
            f"{arm} {_own_us(found[arm]['full']) - _own_us(found['plain']['full']):+.0f}"
            for arm in arms
            if arm not in MODULE_ARMS and arm != "plain"
        )
        print(
            f"  round {round_index + 1} ({time.monotonic() - start_s:.0f} s): full step, "
            f"training + instrument's threads over plain, µs: {line}",
            flush=True,
        )
    for phase in PHASES:
        print_phase(phase, results)
    print_goals(results)
    print_module_calls(results)


if __name__ == "__main__":
    main()
