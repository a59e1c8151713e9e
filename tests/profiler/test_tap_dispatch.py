"""The functional-collective kernels redispatch below BackendSelect to the keys the dispatcher
would: the same rule for every argument (plain, meta, fake, under an included key), and the
inline CPU keys for a plain CPU tensor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (the ops' Meta kernels)
from torch._subclasses.fake_tensor import FakeTensorMode

from stepscope.profiler.collectives.calls import CollectiveCall
from stepscope.profiler.collectives.groups import GroupRegistry
from stepscope.profiler.collectives.tap import CollectiveTap, keys_below_backend_select
from stepscope.profiler.timer import CpuClock

_AFTER = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)


@pytest.fixture
def probe() -> Iterator[list[tuple[Any, Any]]]:
    """An op whose BackendSelect kernel records (the dispatcher's keys below it, the rule's)."""
    seen: list[tuple[Any, Any]] = []
    library = torch.library.Library("stepscope_probe", "DEF")
    library.define("probe(Tensor x, Tensor[] ys) -> Tensor")
    library.impl("probe", lambda x, ys: x.clone(), "CompositeExplicitAutograd")
    library.impl("probe", lambda x, ys: torch.empty_like(x), "Meta")
    redispatch = torch.ops.stepscope_probe.probe.default._handle.redispatch_boxed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((keyset & _AFTER, keys_below_backend_select(args, kwargs)))
        return redispatch(keyset & _AFTER, *args, **kwargs)

    library.impl("probe", kernel, "BackendSelect", with_keyset=True)
    yield seen
    library._destroy()


def test_the_rule_gives_the_dispatchers_keys_for_every_kind_of_argument(
    probe: list[tuple[Any, Any]],
) -> None:
    op = torch.ops.stepscope_probe.probe
    cpu, meta = torch.ones(3), torch.ones(3, device="meta")
    op(cpu, [cpu])
    op(meta, [])
    op(cpu, [meta])  # a list's tensors count
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(cpu)
        op(fake, [fake])
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Meta):
        op(cpu, [])

    assert len(probe) == 5
    for dispatchers, rule in probe:
        assert rule == dispatchers
    cpu_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    assert probe[0][0] == cpu_keys  # what the kernels take inline for a plain CPU tensor
    assert [keys.has(torch._C.DispatchKey.Meta) for keys, _ in probe] == [
        False,
        True,
        True,
        True,
        True,
    ]


def test_the_tapped_ops_redispatch_as_the_dispatcher_would_and_record_only_real_tensors() -> None:
    calls: list[CollectiveCall] = []
    tap = CollectiveTap(clock=CpuClock(), calls=calls, groups=GroupRegistry())
    tap.install()
    try:
        wait = torch.ops._c10d_functional.wait_tensor
        cpu = torch.arange(3.0)
        assert wait(cpu) is cpu
        assert wait(torch.ones(2, device="meta")).device.type == "meta"
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(cpu)
            waited = wait(fake)
            assert type(waited) is type(fake)
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(fake, 2, "0")
            assert gathered.shape == (6,)
        with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Meta):
            # The Meta kernels: a new tensor, and a gather in a group that does not exist.
            assert wait(cpu) is not cpu
            assert torch.ops._c10d_functional.all_gather_into_tensor(cpu, 2, "0").shape == (6,)
        assert tap.enabled  # no error turned it off
        assert not tap._pending_tensors
    finally:
        tap.remove()
    assert calls == []
