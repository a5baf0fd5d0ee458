"""fully_shard's float8 all-gather (torchtitan's `enable_fsdp_float8_all_gather`, models.float8.Float8AllGather):
each shard cast to e4m3 with the whole weight's scale before the all-gather. Tensorwise casting is elementwise
once the scale is fixed, and the scale is the max of the shards' amaxes, so casting the shards and gathering
gives the bytes that gathering and then casting gives: training is bitwise the float8 run without it, on a
quarter of the float8 weights' all-gather bytes (fp32), with one amax all-reduce per group per forward, or one
per step with `precompute_all_gather_scales`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.world import run_world

DIM, HIDDEN, VOCAB, SEQ, BATCH = 32, 48, 40, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(DIM))  # stays fp32 in the gather: a group of mixed dtypes
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return x + self.w2(F.silu(self.w1(h)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(DIM, VOCAB, bias=False)  # left in high precision (filter_fqns)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _build(
    all_gather: bool, *, mesh_shape: tuple[int, ...], reshard: bool | int = True, recompute: bool = False,
    tp: bool = False,
):  # fmt: skip
    """The model in float8, fully_shard per block and at the root; with `tp` the mesh is (dp, tp) and each block
    is TP'd first (w1 Colwise, w2 Rowwise: FSDP x TP)."""
    from models.float8 import convert_to_float8_training
    from parallelisms.dtensor import init_device_mesh
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Tiny()
    converted = convert_to_float8_training(model, filter_fqns=["out"], fsdp_float8_all_gather=all_gather)
    assert converted == ["blocks.0.w1", "blocks.0.w2", "blocks.1.w1", "blocks.1.w2"]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp") if tp else None)
    dp = mesh["dp"] if tp else mesh
    for block in model.blocks:
        block.recompute = recompute
        if tp:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fully_shard(block, mesh=dp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp)
    return model


def _batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (default: this rank's) share of a global batch (every rank gets different tokens)."""
    g = torch.Generator().manual_seed(1000 * step + (dist.get_rank() if rank is None else rank))
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _one_device(world: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same float8 training on one device: each rank's batch a microbatch (so each activation is cast with
    its rank's amax, as there), their mean loss's gradient; rank 0's losses and the final parameters."""
    from models.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = Tiny()
    convert_to_float8_training(model, filter_fqns=["out"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        for rank in range(world):
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss / world).backward()
            losses += [loss.item()] if rank == 0 else []
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, steps: int, *, precompute: bool = False, microbatches: int = 1):
    """(losses, every parameter's full tensor, per-step collective counts and bytes) of AdamW steps."""
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.fsdp import precompute_all_gather_scales

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # per parameter: a 1-D and a 2-D mesh
    losses, counts, nbytes = [], [], []
    for step in range(steps):
        idx, tgt = _batch(step)
        with CommDebugMode() as comm:
            for i, (x, y) in enumerate(zip(idx.chunk(microbatches), tgt.chunk(microbatches))):
                if microbatches > 1:
                    model.set_requires_gradient_sync(i == microbatches - 1)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                precompute_all_gather_scales(model)
        losses.append(loss.item())
        counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
        nbytes.append({str(k): v for k, v in comm.get_comm_bytes().items()})
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    return losses, params, counts, nbytes


def _compare(mesh_shape: tuple[int, ...], microbatches: int = 1, **build):
    """The plain float8 run, and the float8 all-gather's with its scales precomputed after each step."""
    plain = _train(_build(False, mesh_shape=mesh_shape, **build), 3, microbatches=microbatches)
    precomputed = _train(_build(True, mesh_shape=mesh_shape, **build), 3, precompute=True, microbatches=microbatches)
    return plain, precomputed


def _bitwise(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])
    for name, value in a[1].items():
        assert torch.equal(value, b[1][name]), name


def _fsdp2() -> dict:
    plain, precomputed = _compare((2,))
    cast = _train(_build(True, mesh_shape=(2,)), 3)  # the scales computed at each forward's all-gather
    _bitwise(plain, cast)
    _bitwise(plain, precomputed)
    # and both follow one device: float32 sums in another order (FSDP's reduce-scatter) can tip a float8 rounding
    losses, params = _one_device(2, 3)
    if dist.get_rank() == 0:
        torch.testing.assert_close(cast[0], losses, rtol=0, atol=1e-3)
    for name, value in params.items():
        torch.testing.assert_close(cast[1][name], value, rtol=0, atol=1e-3, msg=name)
    return {"plain": plain[2:], "cast": cast[2:], "precomputed": precomputed[2:]}


def test_float8_all_gather_trains_bitwise_like_the_plain_float8_run_on_fewer_bytes() -> None:
    result = run_world(_fsdp2, 2)[0]
    (plain_counts, plain_bytes), (cast_counts, cast_bytes) = result["plain"], result["cast"]
    pre_counts = result["precomputed"][0]
    for step in range(3):
        # the same all-gathers (3 groups: forward, then the two blocks again in backward) and reduce-scatters
        for kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            key = next(k for k in plain_counts[step] if kind in k)
            assert cast_counts[step][key] == plain_counts[step][key] == pre_counts[step][key]
        ag = next(k for k in plain_counts[step] if "all_gather_into_tensor" in k)
        # the float8 weights (4 x 32 x 48, a quarter of the fp32 bytes) dominate what the blocks gather
        assert cast_bytes[step][ag] < 0.55 * plain_bytes[step][ag], (cast_bytes[step][ag], plain_bytes[step][ag])
        ar = next((k for k in cast_counts[step] if "all_reduce" in k), None)
        plain_ar = next((k for k in plain_counts[step] if "all_reduce" in k), None)
        plain_ars = plain_counts[step].get(plain_ar, 0) if plain_ar else 0
        # one amax all-reduce per block group per forward; precomputed: one per step, after the optimizer (and
        # the first step's forward computes its own, as nothing was precomputed before it)
        assert cast_counts[step][ar] == plain_ars + 2
        assert pre_counts[step][ar] == plain_ars + (3 if step == 0 else 1)


def _variants() -> list[str]:
    checked = []
    for name, kwargs in {
        "reshard_after_forward=2 on 4 ranks": {"mesh_shape": (4,), "reshard": 2},
        "HSDP (2, 2)": {"mesh_shape": (2, 2)},
        "activation checkpointing": {"mesh_shape": (2, 2), "recompute": True},
        "no reshard after forward, accumulation": {"mesh_shape": (4,), "reshard": False, "microbatches": 2},
        # the amax over the dp shards of each TP shard and the TP shards (FSDP's _StridedShard inside Colwise)
        "FSDP (2) x TP (2)": {"mesh_shape": (2, 2), "tp": True},
    }.items():
        _bitwise(*_compare(**kwargs))
        checked.append(name)
    return checked


def test_float8_all_gather_composes() -> None:
    """The post-forward shard kept in float8 bytes, replicas of the shards, recomputation reading the
    precast weight, gradient accumulation, TP: each bitwise the plain float8 run."""
    assert len(run_world(_variants, 4)[0]) == 5


def _leaves() -> dict:
    from parallelisms.fsdp import precompute_all_gather_scales

    model = _build(True, mesh_shape=(2,))
    w1 = model.blocks[0].w1
    model.blocks[0].unshard()
    weight = w1.weight
    data, inverse = weight.precast
    with torch.no_grad():
        full = model.blocks[0]._fsdp_state.group.params[1].sharded.full_tensor()
    scale = torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double()
    expected = torch.mul(full, scale.float().reshape(1)).to(torch.float8_e4m3fn)
    checks = {
        "no data": weight.untyped_storage().size() == 0 and weight.dtype == torch.float32,
        "bytes": torch.equal(data.view(torch.uint8), expected.view(torch.uint8)),
        "inverse": torch.equal(inverse, scale.float().reshape(1).reciprocal()),
    }
    model.blocks[0].reshard()  # frees `data` (reading it now would read freed memory)
    precompute_all_gather_scales(model)
    cast = [p for p in model.blocks[0]._fsdp_state.group.params if p.cast is not None]
    return checks | {"precomputed": len(cast) == 2 and all(p.precomputed for p in cast)}


def test_the_unsharded_weight_holds_no_data_and_its_module_reads_the_cast() -> None:
    assert run_world(_leaves, 2)[0] == {"no data": True, "bytes": True, "inverse": True, "precomputed": True}
