"""Rank script of tests/parallel: runs several examples' training, case after case, in one
torchrun launch (one interpreter start-up per rank for all of them).

    torchrun --standalone --nproc_per_node=4 tests/parallel/ranks.py PLAN.json

PLAN.json: {"url", "prefix", "out", "cases": [{"name", "example", "argv", "delay": [flags...],
"broken_steps": n, "break_target": "module:attr", "break_after_calls": n}, ...]}.
Per case, on every rank: a profiled run with the delay flags (job `<prefix>-<name>`), a run
without stepscope (`--no-stepscope`), and a profiled run of `broken_steps` steps in which
`break_target` raises after `break_after_calls` calls (job `<prefix>-<name>-broken`). Each
run's summary goes to OUT/<name>/rank<r>.json as soon as the case is done.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import stepscope  # noqa: E402


class InjectedTapError(RuntimeError):
    """Raised from inside the collective tap by `broken()`."""


@contextmanager
def broken(target: str, after_calls: int) -> Iterator[None]:
    """`module:attr` (or `module:Class.attr`) raises after its first `after_calls` calls."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    fn = original.__func__ if isinstance(original, staticmethod | classmethod) else original
    calls = 0

    @functools.wraps(fn)
    def raising(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > after_calls:
            raise InjectedTapError(f"injected failure in {target}")
        return fn(*args, **kwargs)

    replacement: Any = raising
    if isinstance(original, staticmethod):
        replacement = staticmethod(raising)
    elif isinstance(original, classmethod):
        replacement = classmethod(raising)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def trainer(example: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(parse_args, train(args, prof)) of an example."""
    module = importlib.import_module(example)
    if example == "ddp_train":
        return module.parse_args, lambda args, prof: module.train_ddp(args, prof, dist.get_rank())
    return module.parse_args, module.train


def run_case(plan: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    parse_args, train = trainer(case["example"])
    job_id = f"{plan['prefix']}-{case['name']}"
    results: dict[str, Any] = {}
    # Profiled first: torch gives a later DeviceMesh of the same layout the first one's groups,
    # and the profiler learns the mesh from the parameters (see fsdp_tp_train.py).
    args = parse_args([*case["argv"], *case["delay"]])
    prof = stepscope.init(job_id=job_id, url=plan["url"], flush_interval_s=0.5)
    results["profiled"] = train(args, prof)
    prof.close()
    results["profiled"]["enabled"] = prof.enabled
    dist.barrier()
    results["plain"] = train(parse_args([*case["argv"], "--no-stepscope"]), stepscope.Profiler())
    dist.barrier()
    args = parse_args([*case["argv"], "--steps", str(case["broken_steps"])])
    prof = stepscope.init(job_id=f"{job_id}-broken", url=plan["url"], flush_interval_s=0.5)
    with broken(case["break_target"], case["break_after_calls"]):
        results["broken"] = train(args, prof)
    prof.close()
    dist.barrier()
    return results


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in plan["cases"]:
        results = run_case(plan, case)
        out = Path(plan["out"], case["name"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(results))
        sys.stdout.write(f"rank {rank}: case {case['name']} done\n")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo sometimes aborts in interpreter teardown


if __name__ == "__main__":
    main()
