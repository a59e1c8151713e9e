"""Analysis at scale (DESIGN §7): 1024 ranks × 10,000 steps in ≤ 3 s and ≤ 2 GB.

Generates a synthetic job (steps, collectives, GPU samples; a few stragglers, a slow node
and a busbw drop) into parquet files in a subprocess, then measures the whole analysis in
fresh subprocesses, wall time and peak RSS (ru_maxrss), reading included, against the goal:
A. the files read into DataFrames (the columns analysis uses, as a query layer returns
them), then `analyze`; B. `analyze` on LazyFrames over the files (what `stepscope analyze
--steps FILE` does).

    python benchmarks/analysis_scale.py [--ranks 1024] [--steps 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 3.0
GOAL_BYTES = 2 * 1024**3
GPU_COLUMNS = ("rank", "ts", "sm_clock_mhz", "power_w", "temp_c", "throttle_reasons")


def generate(directory: Path, num_ranks: int, num_steps: int) -> None:
    from stepscope.synthetic.generate import JobSpec, SlowNode, Straggler, generate, to_frames

    spec = JobSpec(
        job_id="scale",
        num_ranks=num_ranks,
        num_steps=num_steps,
        stragglers=(
            Straggler(ranks=(7,), factor=1.15, cause="compute", from_step=2000, until_step=6000),
            Straggler(ranks=(300,), factor=1.1, cause="data", from_step=5000),
            Straggler(ranks=(513,), factor=1.2, cause="gpu_throttling", from_step=7000),
            Straggler(ranks=(900,), factor=1.08, cause="communication", from_step=3000),
        ),
        slow_nodes=(
            SlowNode(node=min(40, num_ranks // 8 - 1), factor=1.1, cause="compute", from_step=8000),
        ),
        busbw_shifts=((9000, 0.6),),
    )
    frames = to_frames(generate(spec))
    for name, frame in frames.items():
        frame.write_parquet(directory / f"{name}.parquet")
    (directory / "job.json").write_text(json.dumps(frames["jobs"].row(0, named=True)))


def measure(directory: Path, mode: str) -> dict[str, object]:
    import polars as pl

    from stepscope.analysis import analyze

    job = json.loads((directory / "job.json").read_text())
    ranks = pl.read_parquet(directory / "ranks.parquet")
    frames = {
        name: pl.scan_parquet(directory / f"{name}.parquet")
        for name in ("steps", "collectives", "gpu")
    }
    t0 = time.perf_counter()
    if mode == "memory":
        # Frames already in memory with the columns analysis reads, as a query layer returns them.
        frames["steps"] = frames["steps"].drop(
            "h2d_s", "comm_s", "mem_peak_bytes", "node", strict=False
        )
        frames["collectives"] = frames["collectives"].drop("job_id")
        frames["gpu"] = frames["gpu"].select(GPU_COLUMNS)
        frames = {name: frame.collect() for name, frame in frames.items()}  # type: ignore[misc]
    t1 = time.perf_counter()
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    findings = analyze(
        frames["steps"], collectives=frames["collectives"], gpu=frames["gpu"], ranks=ranks, job=job
    )
    t2 = time.perf_counter()
    return {
        "load_s": t1 - t0,
        "analyze_s": t2 - t1,
        "rss_loaded_bytes": rss_loaded,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "findings": [
            f"{f.kind} ranks={f.ranks[:8]}{'…' if len(f.ranks) > 8 else ''} node={f.node} "
            f"cause={f.cause} steps={f.first_step}..{f.last_step} effect={f.effect:+.3f}"
            for f in findings
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("memory", "lazy"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        generate(args.generate, args.ranks, args.steps)
        return
    if args.measure:
        print(json.dumps(measure(args.measure, args.mode)))
        return

    me = [sys.executable, __file__, "--ranks", str(args.ranks), "--steps", str(args.steps)]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run([*me, "--generate", tmp], check=True)
        took = time.perf_counter() - t
        print(f"generated {args.ranks} ranks x {args.steps} steps into parquet in {took:.1f} s")
        rows = {
            name: pq_rows(Path(tmp) / f"{name}.parquet") for name in ("steps", "collectives", "gpu")
        }
        print("rows: " + "  ".join(f"{k} {v:,}" for k, v in rows.items()))
        results = {}
        for mode in ("memory", "lazy"):
            out = subprocess.run(
                [*me, "--measure", tmp, "--mode", mode], check=True, capture_output=True, text=True
            )
            results[mode] = json.loads(out.stdout)
    memory, lazy = results["memory"], results["lazy"]
    memory_s = memory["load_s"] + memory["analyze_s"]
    print("\nA. frames read into memory first (columns analysis uses), then analyze(DataFrames)")
    print(f"   read:            {memory['load_s']:.2f} s, RSS {gib(memory['rss_loaded_bytes'])}")
    print(f"   analyze():       {memory['analyze_s']:.2f} s")
    print(f"   read + analyze:  {memory_s:.2f} s   [goal <= 3 s: {verdict(memory_s <= GOAL_S)}]")
    ok_memory_rss = memory["peak_rss_bytes"] <= GOAL_BYTES
    print(
        f"   peak RSS:        {gib(memory['peak_rss_bytes'])} (frames included)"
        f" [goal <= 2 GiB: {verdict(ok_memory_rss)}]"
    )
    print("B. analyze(scan_parquet LazyFrames), reading only the columns it needs (CLI --steps)")
    ok_lazy_s = lazy["analyze_s"] <= GOAL_S
    print(f"   read + analyze:  {lazy['analyze_s']:.2f} s   [goal <= 3 s: {verdict(ok_lazy_s)}]")
    ok_lazy_rss = lazy["peak_rss_bytes"] <= GOAL_BYTES
    print(
        f"   peak RSS:        {gib(lazy['peak_rss_bytes'])} [goal <= 2 GiB: {verdict(ok_lazy_rss)}]"
    )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"findings ({len(lazy['findings'])}):")
    for line in lazy["findings"]:
        print("  " + line)


def pq_rows(path: Path) -> int:
    import polars as pl

    return int(pl.scan_parquet(path).select(pl.len()).collect().item())


def gib(num_bytes: object) -> str:
    return f"{float(num_bytes) / 1024**3:.2f} GiB"  # type: ignore[arg-type]


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


if __name__ == "__main__":
    main()
