"""`stepscope run [--job-id ID] -- CMD…`, with the standard library alone: it works on a
training node that installed `pip install stepscope`, without the server extra."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from stepscope.profiler.hangs.action import ON_HANG_ACTIONS
from stepscope.profiler.launch.launcher import launch

HELP = (
    "Run a training command (e.g. torchrun …) with the job's stepscope environment; "
    "its ranks are profiled with no code change."
)


def parser() -> argparse.ArgumentParser:
    """The options of `stepscope run`; what follows them (or `--`) is the command."""
    p = argparse.ArgumentParser(
        prog="stepscope run",
        usage="stepscope run [--job-id ID] [--url URL] [--token TOKEN] [--on-hang ACTION] "
        "[--no-node-relay] [--no-auto] -- CMD…",
        description=HELP,
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("STEPSCOPE_JOB_ID"),
        help="The job's id (default: $STEPSCOPE_JOB_ID, else one made from the script's name)",
    )
    p.add_argument("--url", help="The collector (default: $STEPSCOPE_URL)")
    p.add_argument("--token", help="A token with the ingest scope (default: $STEPSCOPE_TOKEN)")
    p.add_argument(
        "--on-hang",
        choices=ON_HANG_ACTIONS,
        default=None,
        help="On a hang the server confirms: dump-and-exit dumps the ranks' flight recorders, "
        "then ends the command with SIGTERM so that the scheduler restarts it (default: off; "
        "the token needs the read scope too)",
    )
    p.add_argument(
        "--no-node-relay",
        dest="node_relay",
        action="store_false",
        help="Let each rank post its batches to the collector itself (default: the node's ranks "
        "send theirs through one relay in this process, one request per node and flush)",
    )
    p.add_argument(
        "--no-auto",
        dest="auto",
        action="store_false",
        help="Profile only what the script instruments itself (default: zero-code profiles a "
        "script that never imports stepscope, and attaches the framework adapters; "
        "STEPSCOPE_AUTO=0 does the same)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="The command to run, after --")
    return p


def main(argv: Sequence[str]) -> int:
    """Run the command with the job's environment; its exit code (2 for a usage error)."""
    args = parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.stderr.write("error: no command given; usage: stepscope run [--job-id ID] -- CMD…\n")
        return 2
    try:
        return launch(
            command,
            job_id=args.job_id,
            url=args.url,
            token=args.token,
            on_hang=args.on_hang,
            node_relay=args.node_relay,
            auto=args.auto,
        )
    except OSError as exc:
        sys.stderr.write(f"error: cannot run {command[0]!r}: {exc.strerror or exc}\n")
        return 127
