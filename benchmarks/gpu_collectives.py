"""GPU check of the collective tap (issue #18's GPU part): NCCL on CUDA, one process, one GPU.

    python benchmarks/gpu_collectives.py [--out DIR] [--device cuda|cpu]
    python benchmarks/gpu_collectives.py --out DIR --replay http://127.0.0.1:8000

1. Device-clock timing. A world-size-1 NCCL all-gather of N bytes is a copy of N bytes on
   NCCL's stream, so its duration is known from a reference measured with the tap off
   (events around issue + wait on an idle stream). Printed: the tap's busy time (start event
   on the compute stream at issue, end event when the work's future completes) beside the
   reference, and its exposed wait (events on the compute stream around `Work.wait`) in three
   cases: waited at once (wait ≈ busy), waited after a long matmul issued behind it (wait ≈
   0), and issued after a long matmul (busy must not include the matmul).
2. Host CPU per call of each layer, tap − off (the calling thread's CPU, interleaved rounds):
   synchronous all_reduce, async all_reduce + wait, all_gather_into_tensor,
   reduce_scatter_tensor, functional all_reduce + wait_tensor, and a compiled
   (`fullgraph=True`) all_reduce; the calls each records.
3. The whole profiler (stepscope.init with a loopback sink standing in for the collector) on
   an FSDP2 transformer and on a DDP MLP on the GPU: the collective rows per step, group and
   op (busy, exposed wait), the step rows' MFU and the GPU telemetry rows. Every body the
   profiler sent is written to DIR/ingest.jsonl; `--replay URL` sends them to a collector
   (jobs gpu-fsdp2 and gpu-ddp), where `stepscope show` and the dashboard read them.

Without CUDA (`--device cpu` runs the same checks on gloo, for the script's own sake) it
says so. It takes about two minutes on an H100, most of it the compile.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.collectives.tap import CollectiveTap
from stepscope.profiler.timer import Clock, build_clock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where ingest.jsonl goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--copy-mib", type=int, default=1024, help="all-gather payload, MiB")
    parser.add_argument("--calls", type=int, default=400, help="calls per timed round")
    parser.add_argument("--steps", type=int, default=30, help="training steps per job")
    parser.add_argument(
        "--replay", metavar="URL", help="send DIR/ingest.jsonl to this collector, and stop"
    )
    args = parser.parse_args()
    if args.replay:
        return replay(Path(args.out) / "ingest.jsonl", args.replay)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_collectives needs a CUDA GPU (torch.cuda.is_available() is False).")
        return 0
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's name
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else "-"
    print(f"device: {name}, torch {torch.__version__}, NCCL {nccl}, world size 1")
    try:
        device_clock_timing(device, args.copy_mib)
        host_cost_per_call(device, args.calls)
        whole_profiler(device, args.steps, Path(args.out))
    finally:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


# ---- 1. device-clock timing -------------------------------------------------------------


@contextmanager
def tapped(clock: Clock) -> Iterator[list[CollectiveCall]]:
    """A tap installed for the block; the calls it records."""
    calls: list[CollectiveCall] = []
    errors: list[BaseException] = []
    tap = CollectiveTap(clock=clock, calls=calls, groups=GroupRegistry(), on_error=errors.append)
    tap.install()
    try:
        yield calls
    finally:
        tap.remove()
        if errors:
            print(f"  !! the tap failed: {errors[0]!r}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_clock_timing(device: torch.device, copy_mib: int) -> None:
    numel = copy_mib * 2**20 // 4
    src = torch.ones(numel, device=device)
    out = torch.empty(numel, device=device)
    mat = torch.randn(8192, 8192, device=device) if device.type == "cuda" else None
    clock = build_clock(device.type)
    reps = 10

    def long_matmul() -> None:
        if mat is not None:
            for _ in range(4):
                mat @ mat  # tens of ms of fp32 matmul: far longer than the copy (printed)

    def gather(wait_after: Callable[[], None] | None = None) -> None:
        work = dist.all_gather_into_tensor(out, src, async_op=True)
        if wait_after is not None:
            wait_after()
        work.wait()

    for _ in range(3):
        gather()
    sync(device)
    reference_s = []
    for _ in range(reps):
        sync(device)
        start = clock.mark()
        gather()
        end = clock.mark()
        sync(device)
        reference_s.append(clock.seconds_between(start, end))

    print(f"== 1. device-clock timing: all_gather_into_tensor of {copy_mib} MiB (world 1: a copy)")
    print(
        f"  reference, tap off (events around issue + wait, idle stream): "
        f"median {statistics.median(reference_s) * 1e3:.3f} ms"
    )
    cases: list[tuple[str, Callable[[], None]]] = [
        ("waited at once", lambda: gather()),
        ("waited after a long matmul issued behind it", lambda: gather(long_matmul)),
        ("issued after a long matmul", lambda: (long_matmul(), gather())),
    ]
    with tapped(clock) as calls:
        for label, run in cases:
            calls.clear()
            for _ in range(reps):
                sync(device)
                run()
            sync(device)
            busy_s = [clock.seconds_between(c.start, c.end) for c in calls if c.end is not None]
            wait_s = [sum(clock.seconds_between(a, b) for a, b in c.waits or []) for c in calls]
            print(
                f"  {label + ':':<46} {len(calls)} calls; busy median "
                f"{statistics.median(busy_s) * 1e3:8.3f} ms, exposed wait median "
                f"{statistics.median(wait_s) * 1e3:8.3f} ms"
            )
    if mat is not None:
        sync(device)
        start = clock.mark()
        long_matmul()
        end = clock.mark()
        sync(device)
        print(f"  (the long matmul alone: {clock.seconds_between(start, end) * 1e3:.3f} ms)")


# ---- 2. host cost per call ----------------------------------------------------------------


def host_cost_per_call(device: torch.device, calls_per_round: int) -> None:
    group = dist.group.WORLD
    assert group is not None
    group_name = group.group_name
    small = torch.ones(256, device=device)
    gathered = torch.empty(256, device=device)
    funcol = torch.ops._c10d_functional

    def all_reduce_sync() -> None:
        dist.all_reduce(small)

    def all_reduce_async() -> None:
        dist.all_reduce(small, async_op=True).wait()

    def all_gather() -> None:
        dist.all_gather_into_tensor(gathered, small)

    def reduce_scatter() -> None:
        dist.reduce_scatter_tensor(gathered, small)

    def functional() -> None:
        funcol.wait_tensor(funcol.all_reduce(small, "sum", group_name))

    def reduced(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    compiled = torch.compile(reduced, fullgraph=True)
    compile_start = time.perf_counter()
    compiled(small)
    sync(device)
    print(f"== 2. host CPU per call, tap - off ({calls_per_round} calls a round, 5 rounds each)")
    compile_s = time.perf_counter() - compile_start
    print(f"  (compiling the fullgraph all_reduce took {compile_s:.1f} s)")
    explained = torch._dynamo.explain(reduced)(small)
    print(
        f"  torch._dynamo.explain of the all_reduce function: "
        f"{explained.graph_break_count} graph breaks, {explained.graph_count} graph"
    )

    def compiled_all_reduce() -> None:
        compiled(small)

    clock = build_clock(device.type)
    cases: list[tuple[str, Callable[[], None]]] = [
        ("synchronous all_reduce", all_reduce_sync),
        ("async all_reduce + Work.wait", all_reduce_async),
        ("all_gather_into_tensor", all_gather),
        ("reduce_scatter_tensor", reduce_scatter),
        ("functional all_reduce + wait_tensor", functional),
        ("compiled all_reduce (fullgraph)", compiled_all_reduce),
    ]
    for label, call in cases:
        for _ in range(20):
            call()
        off_us, on_us, recorded = [], [], []
        for _ in range(5):
            off_us.append(thread_cpu_per_call_us(call, calls_per_round, device))
            with tapped(clock) as calls:
                on_us.append(thread_cpu_per_call_us(call, calls_per_round, device))
                recorded.append(len(calls))
        ended = "every one ended" if device.type != "cuda" else "ends on the device clock"
        print(
            f"  {label + ':':<38} off {min(off_us):6.1f} µs, tap {min(on_us):6.1f} µs -> "
            f"{min(on_us) - min(off_us):+6.1f} µs (min of 5); recorded "
            f"{statistics.median(recorded) / calls_per_round:.2f} a call ({ended})"
        )


def thread_cpu_per_call_us(call: Callable[[], None], n: int, device: torch.device) -> float:
    sync(device)
    start = time.thread_time()
    for _ in range(n):
        call()
    spent = time.thread_time() - start
    sync(device)  # outside the timed loop: a spinning synchronize is CPU time too
    return spent / n * 1e6


# ---- 3. the whole profiler ------------------------------------------------------------------


@contextmanager
def capture_sink(path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback stand-in for the collector: answers 200 and keeps every body (and writes it,
    with its request path, to `path` as JSON lines)."""
    bodies: list[dict[str, Any]] = []
    lock = threading.Lock()
    path.parent.mkdir(parents=True, exist_ok=True)
    out = path.open("w", encoding="utf-8")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            body = json.loads(raw)
            with lock:
                if self.path == "/v1/ingest":
                    bodies.append(body)
                out.write(json.dumps({"path": self.path, "body": body}) + "\n")
            reply = b'{"duplicate": false}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        out.close()


def replay(path: Path, url: str) -> int:
    """POST every body a run sent (ingest.jsonl) to a collector, in the order it was sent."""
    import urllib.request

    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        sent = json.loads(line)
        request = urllib.request.Request(
            url.rstrip("/") + sent["path"],
            data=json.dumps(sent["body"]).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
    print(f"replayed {len(lines)} bodies from {path} to {url}")
    return 0


def rows_of(bodies: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rows of one kind (steps, collectives, gpu) in the bodies, columnar or not."""
    rows: list[dict[str, Any]] = []
    for body in bodies:
        section = body.get(kind)
        if isinstance(section, dict) and section:
            names = list(section)
            rows += [
                dict(zip(names, values, strict=True))
                for values in zip(*section.values(), strict=True)
            ]
        elif isinstance(section, list):
            rows += section
    return rows


def whole_profiler(device: torch.device, steps: int, out: Path) -> None:
    import stepscope

    print("== 3. the whole profiler (stepscope.init -> loopback sink)")
    with capture_sink(out / "ingest.jsonl") as (url, bodies):
        # At world size 1 FSDP2 skips its all-gathers and reduce-scatters: its job shows the
        # step rows (MFU under fully_shard), DDP's the collective rows.
        for job, train in (("gpu-fsdp2", train_fsdp2), ("gpu-ddp", train_ddp)):
            first = len(bodies)
            prof = stepscope.init(
                job_id=job,
                url=url,
                flush_interval_s=0.5,
                flops_per_step="auto",
                gpu_interval_s=0.5,
                attributes={"check": "gpu_collectives"},
            )
            print(f"  {job}: profiler {type(prof).__name__}")
            losses = train(device, prof, steps)
            prof.close()
            report(job, bodies[first:], steps, losses)


def report(job: str, bodies: list[dict[str, Any]], steps: int, losses: list[float]) -> None:
    step_rows = rows_of(bodies, "steps")
    coll_rows = rows_of(bodies, "collectives")
    gpu_rows = rows_of(bodies, "gpu")
    later = [r for r in step_rows if r.get("step", 0) >= 5]
    print(
        f"  {job}: {len(bodies)} bodies; {len(step_rows)} step rows (of {steps}); "
        f"{len(coll_rows)} collective rows; {len(gpu_rows)} gpu rows; "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    if later:
        for column in ("step_s", "comm_wait_s", "compute_s", "mfu", "flops"):
            values = [r[column] for r in later if r.get(column) is not None]
            if values:
                print(f"    steps >= 5, {column}: median {statistics.median(values):.6g}")
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in coll_rows:
        by_key.setdefault((row["group"], row["op"]), []).append(row)
    for (group, op), rows in sorted(by_key.items()):
        tail = [r for r in rows if r["step"] >= 5] or rows
        print(
            f"    group {group} ({rows[0].get('mesh_dim')}), {op}: {len(rows)} steps; a step: "
            f"count {statistics.median(r['count'] for r in tail):g}, "
            f"bytes {statistics.median(r['bytes'] for r in tail):.0f}, "
            f"busy {statistics.median(r['busy_s'] for r in tail) * 1e3:.3f} ms, "
            f"wait {statistics.median(r['wait_s'] for r in tail) * 1e3:.3f} ms"
        )
    if gpu_rows:
        keys = ("util", "sm_clock_mhz", "power_w", "mem_used_bytes", "sm_active", "tensor_active")
        last = gpu_rows[-1]
        print("    last gpu row: " + ", ".join(f"{k}={last.get(k)}" for k in keys))


def train_fsdp2(device: torch.device, prof: Any, steps: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformer import ModelConfig, build_model, lm_loss, token_batches

    if device.type == "cuda":
        cfg = ModelConfig(vocab_size=8192, dim=1024, num_heads=16, num_layers=8, seq_len=512)
    else:  # the script's own check, on CPU
        cfg = ModelConfig(vocab_size=256, dim=64, num_heads=4, num_layers=2, seq_len=32)
    model = build_model(cfg).to(device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prof.watch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for tokens, targets in token_batches(cfg, steps=steps, batch_size=8, seed=0):
        tokens, targets = tokens.to(device), targets.to(device)
        with prof.step():
            with prof.section("forward"):
                loss = lm_loss(model(tokens), targets)
            with prof.section("backward"):
                loss.backward()
            with prof.section("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            prof.record(samples=tokens.shape[0], tokens=tokens.numel())
        losses.append(loss.item())
    return losses


def train_ddp(device: torch.device, prof: Any, steps: int) -> list[float]:
    torch.manual_seed(0)
    dim = 4096 if device.type == "cuda" else 256
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(6)]).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    prof.watch(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(dim, dim, device=device)
    losses = []
    for _ in range(steps):
        with prof.step():
            loss = ddp(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.record(samples=x.shape[0])
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    sys.exit(main())
