"""The collectives each parallelism must issue per training step, worked out from the model's
parameter and activation sizes (never read back from a run).

Bytes follow the nccl-tests convention stepscope stores: all_gather = gathered output,
reduce_scatter = input, all_reduce = tensor, send/recv = tensor. A step's expectation maps
(group role, op) to (count, bytes); a role is "world" or a DeviceMesh dim name.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from ddp_train import MLP  # noqa: E402
from transformer import ModelConfig, Transformer  # noqa: E402

FLOAT_BYTES = 4
Expected = dict[tuple[str, str], tuple[int, int]]

COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1")
ROWWISE = ("attn.wo", "mlp.w2")
"""fsdp_tp_train.py's plan, by Linear within a block."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How many ranks shard the parameters (FSDP) and split the Linears (TP)."""

    dp_shard: int = 1
    tp: int = 1


def fsdp_units(model: Transformer) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters of each fully_shard / FSDP1 unit: one per block, then the root's own."""
    blocks = [list(block.named_parameters()) for block in model.blocks.values()]
    in_blocks = {id(p) for unit in blocks for _, p in unit}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
    return [*blocks, root]


def tp_local_numel(name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of a parameter on one TP rank: Colwise splits weight and bias by output rows,
    Rowwise splits the weight by input columns and replicates its bias."""
    if tp == 1 or not any(name.startswith(prefix + ".") for prefix in (*COLWISE, *ROWWISE)):
        return math.prod(shape)
    linear, _, kind = name.rpartition(".")
    if linear in COLWISE:
        assert shape[0] % tp == 0
        return math.prod(shape) // tp
    if kind == "weight":
        assert shape[1] % tp == 0
        return math.prod(shape) // tp
    return math.prod(shape)


def fsdp2_unit_bytes(unit: list[tuple[str, nn.Parameter]], layout: Layout) -> int:
    """Gathered bytes of a unit: each (TP-local) parameter's dim 0 padded to a multiple of the
    shard count, as fully_shard pads its shards."""
    total = 0
    for name, p in unit:
        numel = tp_local_numel(name, tuple(p.shape), layout.tp)
        rows = p.shape[0] // layout.tp if _is_colwise(name) else p.shape[0]
        per_row = numel // rows
        total += layout.dp_shard * math.ceil(rows / layout.dp_shard) * per_row
    return total * FLOAT_BYTES


def _is_colwise(name: str) -> bool:
    return any(name.startswith(prefix + ".") for prefix in COLWISE)


def fsdp1_unit_bytes(unit: list[tuple[str, nn.Parameter]], world: int) -> int:
    """Bytes of a unit's flat parameter, padded to a multiple of the world size."""
    numel = sum(p.numel() for _, p in unit)
    return math.ceil(numel / world) * world * FLOAT_BYTES


def fsdp_step(units_bytes: list[int], role: str) -> Expected:
    """Forward gathers every unit; backward re-gathers every block (the root is not resharded
    after forward) and reduce-scatters every unit."""
    *blocks, root = units_bytes
    return {
        (role, "all_gather"): (2 * len(blocks) + 1, 2 * sum(blocks) + root),
        (role, "reduce_scatter"): (len(units_bytes), sum(units_bytes)),
    }


def tp_step(cfg: ModelConfig, batch_size: int) -> Expected:
    """Per block: forward all-reduces each Rowwise output; backward all-reduces the input
    gradient of each Colwise Linear. Every one is a (batch, seq, dim) activation."""
    activation = batch_size * cfg.seq_len * cfg.dim * FLOAT_BYTES
    count = cfg.num_layers * (len(ROWWISE) + len(COLWISE))
    return {("tp", "all_reduce"): (count, count * activation)}


def fsdp2(cfg: ModelConfig, world: int) -> Expected:
    units = fsdp_units(Transformer(cfg))
    return fsdp_step([fsdp2_unit_bytes(u, Layout(dp_shard=world)) for u in units], "dp_shard")


def fsdp1(cfg: ModelConfig, world: int) -> Expected:
    units = fsdp_units(Transformer(cfg))
    return fsdp_step([fsdp1_unit_bytes(u, world) for u in units], "world")


def fsdp_tp(cfg: ModelConfig, layout: Layout, batch_size: int) -> Expected:
    expected = tp_step(cfg, batch_size)
    if layout.dp_shard > 1:
        units = fsdp_units(Transformer(cfg))
        expected |= fsdp_step([fsdp2_unit_bytes(u, layout) for u in units], "dp_shard")
    return expected


def pipeline(
    cfg: ModelConfig, *, stage: int, num_stages: int, batch_size: int, microbatches: int
) -> Expected:
    """Per microbatch a stage receives its input activation from the one before and sends its
    output to the one after; backward sends and receives their gradients the other way."""
    activation = (batch_size // microbatches) * cfg.seq_len * cfg.dim * FLOAT_BYTES
    neighbours = (stage > 0) + (stage < num_stages - 1)
    count = microbatches * neighbours
    return {
        ("world", "send"): (count, count * activation),
        ("world", "recv"): (count, count * activation),
    }


def data_parallel(width: int, mode: str) -> Expected:
    """ddp_train.py's MLP: DDP all-reduces its gradients in one bucket (they fit the 1 MiB first
    bucket); async all-reduces each gradient; compiled one concatenation of them all."""
    params = list(MLP(width, backward_delay_s=0.0).parameters())
    num_bytes = sum(p.numel() for p in params) * FLOAT_BYTES
    assert num_bytes < 1 << 20
    count = len(params) if mode == "async" else 1
    return {("world", "all_reduce"): (count, num_bytes)}


def mesh_members(role: str, rank: int, world: int, layout: Layout) -> list[int]:
    """Global ranks of `rank`'s group along `role` of a (dp_shard, tp) row-major mesh."""
    if role == "tp":
        first = rank // layout.tp * layout.tp
        return list(range(first, first + layout.tp))
    if role == "dp_shard":
        return list(range(rank % layout.tp, world, layout.tp))
    return list(range(world))
