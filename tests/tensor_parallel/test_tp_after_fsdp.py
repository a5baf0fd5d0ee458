"""Tensor parallelism after fully_shard is refused with an error naming the fix (TP -> AC -> FSDP);
the right order, and parameters already laid out as the style wants, still work.

Every case runs on a 2-rank world, over the meshes (1, 2) (tp = 2), (2, 1) (dp = 2) and, where FSDP
and TP share it, the 1-D mesh (2,).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.world import run_world

MESHES = {"dp1_tp2": (1, 2), "dp2_tp1": (2, 1), "shared": None}  # None: one 1-D mesh for both
ORDER_FIX = "Apply tensor parallelism first, then fully_shard (TP -> AC -> FSDP)"


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class Block(nn.Module):
    """A norm and an MLP: parallelize_module(block.feed_forward, ...) is the Llama block pattern."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.feed_forward = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.norm(x))


def _meshes(layout: str):
    """(dp mesh, tp mesh) on this rank."""
    from tests.dtensor.harness import get_mesh

    shape = MESHES[layout]
    if shape is None:
        mesh = get_mesh((2,))
        return mesh, mesh
    world = get_mesh(shape, ("dp", "tp"))
    return world["dp"], world["tp"]


def _mlp_plan() -> dict:
    from parallelisms.tensor_parallel import ColwiseParallel, RowwiseParallel

    return {"w1": ColwiseParallel(), "w2": RowwiseParallel()}


def _error_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


# ---------------------------------------------------------------------------------- rank functions
def _tp_on_fully_shard_module(layout: str, where: str) -> str:
    """fully_shard somewhere, then parallelize_module over it; returns the error message."""
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import SequenceParallel, parallelize_module

    dp_mesh, tp_mesh = _meshes(layout)
    torch.manual_seed(0)
    block = Block()
    if where == "root":  # the module passed to parallelize_module
        fully_shard(block, mesh=dp_mesh)
        plan = {"norm": SequenceParallel(), **{f"feed_forward.{k}": v for k, v in _mlp_plan().items()}}
    else:  # a submodule on the path to the plan's keys
        fully_shard(block.feed_forward, mesh=dp_mesh)
        plan = {f"feed_forward.{k}": v for k, v in _mlp_plan().items()}
    return _error_of(lambda: parallelize_module(block, tp_mesh, plan))


def _tp_on_submodule_of_fully_shard(layout: str) -> str:
    """fully_shard(block), then parallelize_module(block.feed_forward, ...): no FSDPModule on the way,
    only the FSDP-sharded parameters."""
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import parallelize_module

    dp_mesh, tp_mesh = _meshes(layout)
    torch.manual_seed(0)
    block = Block()
    fully_shard(block, mesh=dp_mesh)
    return _error_of(lambda: parallelize_module(block.feed_forward, tp_mesh, _mlp_plan()))


def _sequence_parallel_after_fully_shard(layout: str) -> str:
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import SequenceParallel, parallelize_module

    dp_mesh, tp_mesh = _meshes(layout)
    block = Block()
    fully_shard(block, mesh=dp_mesh)
    return _error_of(lambda: parallelize_module(block.norm, tp_mesh, SequenceParallel()))


def _relaid_on_tp_mesh() -> str:
    """A weight already sharded S(0) on the TP mesh, then RowwiseParallel (wants S(1))."""
    from parallelisms.dtensor import Shard, distribute_tensor
    from parallelisms.tensor_parallel import RowwiseParallel, parallelize_module
    from tests.dtensor.harness import get_mesh

    tp_mesh = get_mesh((2,))
    linear = nn.Linear(4, 6)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, [Shard(0)]))
    return _error_of(lambda: parallelize_module(linear, tp_mesh, RowwiseParallel()))


def _tied_weight_kept() -> bool:
    """An output Linear re-tied to the vocabulary-parallel embedding: ColwiseParallel wants the same
    S(0) and keeps the very parameter (distribute_tensor would return it unchanged)."""
    from parallelisms.dtensor import DTensor, Replicate, Shard
    from parallelisms.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from tests.dtensor.harness import get_mesh

    tp_mesh = get_mesh((2,))
    torch.manual_seed(0)
    tok, out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    parallelize_module(tok, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    out.weight = tok.weight
    parallelize_module(out, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    assert isinstance(out.weight, DTensor) and out.weight.placements == (Shard(0),)
    return out.weight is tok.weight


def _tp_then_fully_shard(layout: str) -> dict[str, object]:
    """The right order on a 2-layer MLP: loss and full gradients as on one device."""
    from parallelisms.dtensor import DTensor
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import parallelize_module

    dp_mesh, tp_mesh = _meshes(layout)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = MLP()
    torch.manual_seed(0)
    model = parallelize_module(MLP(), tp_mesh, _mlp_plan())
    fully_shard(model, mesh=dp_mesh)
    # every rank feeds the same batch, so the dp-averaged gradient is the single-device one
    loss = model(x).pow(2).sum()
    loss.backward()
    ref_loss = ref(x).pow(2).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    ref_grads = dict(ref.named_parameters())
    meshes = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name].grad, msg=name)
        torch.testing.assert_close(p.full_tensor(), ref_grads[name].detach(), msg=name)
        meshes[name] = p.device_mesh.mesh_dim_names
    return meshes


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("where", ["root", "submodule"])
@pytest.mark.parametrize("layout", list(MESHES))
def test_tp_after_fully_shard_names_the_fsdp_module_and_the_fix(layout: str, where: str) -> None:
    for message in run_world(_tp_on_fully_shard_module, 2, layout, where):
        assert "already an FSDPModule" in message and ORDER_FIX in message, message
        if where == "submodule":
            assert "submodule 'feed_forward' (FSDPMLP)" in message, message


@pytest.mark.parametrize("layout", ["dp1_tp2", "dp2_tp1"])
def test_tp_after_fully_shard_of_a_parent_names_the_parameter(layout: str) -> None:
    for message in run_world(_tp_on_submodule_of_fully_shard, 2, layout):
        assert message.startswith("parameter 'w1.weight' is already a DTensor on mesh DeviceMesh("), message
        assert "placements ('S(0)',)" in message or "Shard(dim=0)" in message, message
        assert "was fully_shard applied before parallelize_module?" in message and ORDER_FIX in message


def test_tp_after_fully_shard_on_the_same_mesh_with_other_placements_names_the_fix() -> None:
    """FSDP and TP on one 1-D mesh: w1's FSDP S(0) looks like ColwiseParallel's (an accepted
    re-tied weight), so the error comes from w2, whose RowwiseParallel wants S(1)."""
    for message in run_world(_tp_on_submodule_of_fully_shard, 2, "shared"):
        assert message.startswith("parameter 'w2.weight' is already a DTensor on the tensor-parallel mesh"), message
        assert ORDER_FIX in message, message


@pytest.mark.parametrize("layout", ["dp1_tp2", "dp2_tp1"])
def test_sequence_parallel_after_fully_shard_names_the_parameter(layout: str) -> None:
    for message in run_world(_sequence_parallel_after_fully_shard, 2, layout):
        assert message.startswith("parameter 'weight' is already a DTensor on mesh"), message
        assert ORDER_FIX in message, message


def test_style_on_a_weight_laid_out_otherwise_on_the_tp_mesh_names_both_layouts() -> None:
    for message in run_world(_relaid_on_tp_mesh, 2):
        assert "parameter 'weight' is already a DTensor on the tensor-parallel mesh" in message, message
        assert "shards it as" in message and "parallelized twice" in message, message


def test_weight_already_sharded_as_the_style_wants_is_kept() -> None:
    assert run_world(_tied_weight_kept, 2) == [True, True]


@pytest.mark.parametrize("layout", ["dp1_tp2", "dp2_tp1"])
def test_tp_then_fully_shard_matches_one_device(layout: str) -> None:
    for meshes in run_world(_tp_then_fully_shard, 2, layout):
        assert set(meshes) == {"w1.weight", "w1.bias", "w2.weight", "w2.bias"}
        assert all(names == ("dp", "tp") for names in meshes.values()), meshes
