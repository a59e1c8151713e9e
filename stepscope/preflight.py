"""`torchrun --nproc_per_node=N -m stepscope.preflight`: check ranks before a long job.

Measures all-reduce bus bandwidth over message sizes and matmul FLOP/s on every rank,
prints a table on rank 0 and names ranks far below the median. With STEPSCOPE_URL set,
the findings also go to the collector as events.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from typing import Any

from stepscope.profiler.telemetry.preflight import (
    DEFAULT_SIZES_BYTES,
    PreflightResult,
    run_preflight,
)

EXIT_SLOW_RANKS = 3


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stepscope.preflight", description=__doc__)
    parser.add_argument(
        "--sizes-bytes",
        type=int,
        nargs="+",
        default=list(DEFAULT_SIZES_BYTES),
        help="all-reduce message sizes in bytes",
    )
    parser.add_argument("--iters", type=int, default=5, help="all-reduces timed per size")
    parser.add_argument("--matmul-n", type=int, default=None, help="matmul size (n×n×n)")
    parser.add_argument("--matmul-iters", type=int, default=10, help="matmuls timed")
    parser.add_argument(
        "--slow-fraction",
        type=float,
        default=0.7,
        help="a rank below this fraction of the median is slow",
    )
    parser.add_argument("--json", dest="json_path", help="rank 0 writes the result here as JSON")
    parser.add_argument(
        "--fail-on-slow", action="store_true", help=f"exit {EXIT_SLOW_RANKS} when a rank is slow"
    )
    return parser.parse_args(argv)


def format_table(result: PreflightResult) -> str:
    """The result as a plain-text table."""
    lines = [f"stepscope preflight: {result.world_size} ranks, backend {result.backend}", ""]
    lines.append(f"{'all_reduce size':>16}  {'busbw GB/s (median)':>20}")
    for size, busbw in zip(result.sizes_bytes, result.busbw_bps, strict=True):
        lines.append(f"{_size(size):>16}  {busbw / 1e9:>20.4g}")
    largest = _size(result.sizes_bytes[-1])
    lines += [
        "",
        f"{'rank':>4}  {'node':<20} {'matmul TFLOP/s':>14}  {'busbw GB/s @' + largest:>20}",
    ]
    for rank, flops in enumerate(result.rank_matmul_flops):
        busbw = result.rank_busbw_bps[rank][-1]
        node = result.rank_nodes[rank][:20]
        lines.append(f"{rank:>4}  {node:<20} {flops / 1e12:>14.4f}  {busbw / 1e9:>20.4g}")
    lines.append("")
    if not result.slow_ranks:
        lines.append(f"no slow ranks (threshold {result.slow_fraction:.0%} of the median)")
    for slow in result.slow_ranks:
        lines.append(
            f"SLOW: rank {slow.rank} on {slow.node}: {slow.metric} {slow.observed:.3g} "
            f"is {slow.ratio:.2f}x the median {slow.expected:.3g}"
        )
    return "\n".join(lines)


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale} {unit}"
    return f"{num_bytes} B"


def _init_profiler() -> Any:
    """stepscope.init() from the environment when STEPSCOPE_URL is set; None otherwise."""
    if not os.environ.get("STEPSCOPE_URL"):
        return None
    import stepscope

    init = getattr(stepscope, "init", None)
    if init is None:
        logging.getLogger(__name__).warning("stepscope.init is not available; not reporting")
        return None
    try:
        return init()
    except Exception:
        logging.getLogger(__name__).warning("stepscope.init() failed; not reporting", exc_info=True)
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the preflight on this rank; the exit code every rank should exit with."""
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    prof = _init_profiler()
    result = run_preflight(
        prof=prof,
        sizes_bytes=tuple(args.sizes_bytes),
        iters=args.iters,
        matmul_n=args.matmul_n,
        matmul_iters=args.matmul_iters,
        slow_fraction=args.slow_fraction,
    )
    if dist.get_rank() == 0:
        print(format_table(result))  # noqa: T201 - the CLI's output
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(asdict(result), f, indent=2)
    close = getattr(prof, "close", None)
    if close is not None:
        close()
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_SLOW_RANKS if args.fail_on_slow and result.slow_ranks else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch's distributed backends can hang in atexit handlers.
    os._exit(code)
