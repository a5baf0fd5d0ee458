"""fully_shard against single-process training and against torch's own fully_shard (the oracle).

Every rank builds the same tiny transformer (same seed), trains on its own slice of a global batch,
and compares losses, final full parameters and collective counts. Dims are chosen so several dim-0
sizes (vocab 37, d 18, qkv 54) do not divide by 2 or 4: uneven and empty shards are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from parallelisms.dtensor import DTensor, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from tests.dtensor.harness import get_mesh, get_torch_mesh
from tests.world import run_world

VOCAB, D, HEADS, SEQ, BATCH = 37, 18, 3, 8, 2  # BATCH is per rank


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)  # (3, B, nh, T, hs)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))  # (B, T, D)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Tiny(nn.Module):
    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        self.side = nn.Linear(D, 5) if with_unused else None  # runs in forward, never reaches the loss

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, D)
        for blk in self.blocks:
            x = blk(x)
        if self.side is not None:
            self.side(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def _build(shard, mesh, *, with_unused: bool = False, **kwargs) -> Tiny:
    torch.manual_seed(0)
    model = Tiny(with_unused)
    if shard is None:
        return model
    for blk in model.blocks:
        shard(blk, mesh=mesh, **kwargs)
    if model.side is not None:
        shard(model.side, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


def _global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g)
    return idx, torch.randint(0, VOCAB, (world * BATCH, SEQ), generator=g)


def _rank_batch(step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = _global_batch(step, world)
    return idx[rank * BATCH : (rank + 1) * BATCH], tgt[rank * BATCH : (rank + 1) * BATCH]


def _loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).float().reshape(-1, VOCAB), tgt.reshape(-1))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps well above roundoff: the key bias's exact gradient is zero (softmax ignores a per-row
    # constant), and with eps=1e-8 Adam turns its ~1e-10 roundoff noise into lr-sized steps whose
    # signs differ between any two summation orders (sharded vs single-process).
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


def _train(model: nn.Module, batches, steps: int = 3) -> list[float]:
    opt = _adamw(model)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, *batches(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    # ours or torch's DTensor (the oracle's parameters are not our class)
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n: t.detach().clone() for n, t in full.items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"{sorted(a)} != {sorted(b)}"
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def _fwd_bwd_counts(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, int]:
    model.zero_grad(set_to_none=True)
    with CommDebugMode() as comm:
        _loss(model, idx, tgt).backward()
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


# ------------------------------------------------------------------------------ rank functions
def _compare_training(
    reshard_after_forward: bool | None, param_dtype: torch.dtype | None, mesh_shape: tuple[int, ...] | None = None
) -> dict:
    """Ours and torch's fully_shard (FSDP on a 1-D mesh, HSDP on a 2-D (replicate, shard) one) train
    on every rank's slice of one global batch; the reference trains on the whole batch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh_shape = mesh_shape or (world,)
    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else None  # torch's HSDP needs names
    mesh, torch_mesh = get_mesh(mesh_shape, names), get_torch_mesh(mesh_shape, names)
    shards = mesh_shape[-1]
    shard_rank = rank % shards
    mp = dict(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    ours = _build(fully_shard, mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy(**mp))
    theirs = _build(torch_fully_shard, torch_mesh, reshard_after_forward=reshard_after_forward, mp_policy=TorchMP(**mp))
    local_batches = lambda step: _rank_batch(step, world, rank)  # noqa: E731
    assert isinstance(ours, FSDPModule) and isinstance(ours.blocks[0], FSDPModule) and isinstance(ours, Tiny)
    w = ours.blocks[0].qkv.weight
    assert isinstance(w, DTensor) and w.placements == (Replicate(),) * (len(mesh_shape) - 1) + (Shard(0),)
    assert torch.equal(w.to_local(), _build(None, None).blocks[0].qkv.weight.detach().chunk(shards)[shard_rank])
    out = {
        "ours_losses": _train(ours, local_batches),
        "torch_losses": _train(theirs, local_batches),
        "ours_counts": _fwd_bwd_counts(ours, *local_batches(9)),
        "torch_counts": _fwd_bwd_counts(theirs, *local_batches(9)),
    }
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    ours_params, torch_params = _full_params(ours), _full_params(theirs)
    out["vs_torch"] = _max_diff(ours_params, torch_params)
    if param_dtype is None:
        reference = _build(None, None)
        out["ref_losses"] = _train(reference, lambda step: _global_batch(step, world))
        out["vs_reference"] = _max_diff(ours_params, _full_params(reference))
    out["all_sharded"] = all(isinstance(p, DTensor) for p in ours.parameters())
    return out


def _unused_module_is_resharded() -> dict:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = _build(fully_shard, get_mesh((world,)), with_unused=True)
    reference = _build(None, None, with_unused=True)
    losses = _train(model, lambda step: _rank_batch(step, world, rank), steps=2)
    ref_losses = _train(reference, lambda step: _global_batch(step, world), steps=2)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "side_grads": [p.grad is None for p in model.side.parameters()],
        "all_sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "unsharded_groups": [m._fsdp_state.group.is_unsharded for m in model.modules() if isinstance(m, FSDPModule)],
        "vs_reference": _max_diff(_full_params(model), _full_params(reference)),
    }


def _grad_accumulation_without_sync() -> dict:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = _build(fully_shard, get_mesh((world,)))
    reference = _build(None, None)
    counts = []
    for micro, sync in ((0, False), (1, True)):
        model.set_requires_gradient_sync(sync)
        with CommDebugMode() as comm:
            _loss(model, *_rank_batch(micro, world, rank)).backward()
        counts.append(comm.get_comm_counts().get(torch.ops.c10d_functional.reduce_scatter_tensor, 0))
        _loss(reference, *_global_batch(micro, world)).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    return {"reduce_scatters": counts, "grad_diff": _max_diff(grads, ref_grads)}


def _unshard_and_reshard_by_hand() -> float:
    world = torch.distributed.get_world_size()
    model = _build(fully_shard, get_mesh((world,)))
    blk = model.blocks[1]
    full = blk.fc1.weight.full_tensor()
    blk.unshard()
    unsharded = blk.fc1.weight
    assert not isinstance(unsharded, DTensor) and unsharded.shape == (4 * D, D)
    diff = (unsharded - full).abs().max().item()
    blk.reshard()
    assert isinstance(blk.fc1.weight, DTensor)
    return diff


def _empty_shards_train() -> dict:
    """dim 0 of 5 and 3 over 4 ranks: torch.chunk gives (2, 2, 1, 0) and (1, 1, 1, 0) rows."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    model, reference = fully_shard(build(), mesh=get_mesh((world,))), build()
    x = torch.randn(world * 2, 4, generator=torch.Generator().manual_seed(7))
    batches = lambda step: (x[rank * 2 : rank * 2 + 2],)  # noqa: E731
    opt, ref_opt = (_adamw(m) for m in (model, reference))
    for _ in range(2):
        for m, o, inp in ((model, opt, batches(0)[0]), (reference, ref_opt, x)):
            o.zero_grad()
            m(inp).square().mean().backward()
            o.step()
    return {
        "local_rows": [p.to_local().shape[0] for p in model.parameters()],
        "vs_reference": _max_diff(_full_params(model), _full_params(reference)),
    }


class Recomputed(nn.Module):
    """Activation checkpointing around a fully_shard block: its forward runs again in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no early stop: the recompute runs to the end, so the inner post-forward hook fires in backward
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _activation_checkpointing_train() -> dict:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model, reference = _build(None, None), _build(None, None)
    for blk in model.blocks:
        fully_shard(blk, mesh=get_mesh((world,)))
    model.blocks = nn.ModuleList(Recomputed(blk) for blk in model.blocks)
    fully_shard(model, mesh=get_mesh((world,)))
    losses = _train(model, lambda step: _rank_batch(step, world, rank), steps=2)
    _train(reference, lambda step: _global_batch(step, world), steps=2)
    params = {n.replace(".inner.", "."): t for n, t in _full_params(model).items()}
    return {"losses": losses, "vs_reference": _max_diff(params, _full_params(reference))}


def _errors() -> list[str]:
    world = torch.distributed.get_world_size()
    messages = []
    with pytest.raises(ValueError, match="2-D") as e:
        fully_shard(nn.Linear(4, 4), mesh=get_mesh((world, 1, 1), ("dp_replicate", "dp_shard", "tp")))
    messages.append(str(e.value))
    tp_mesh = get_mesh((world, 1), ("dp", "tp"))["tp"]
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), tp_mesh, [Replicate()]))
    with pytest.raises(ValueError, match="not a named slice of the fully_shard mesh's root") as e:
        fully_shard(lin, mesh=get_mesh((world,)))  # a TP mesh of another root
    messages.append(str(e.value))
    twice = fully_shard(nn.Linear(4, 4), mesh=get_mesh((world,)))
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(twice, mesh=get_mesh((world,)))
    with pytest.raises(ValueError, match="ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=get_mesh((world,)))
    return messages


# ------------------------------------------------------------------------------ tests
def _check_counts(result: dict) -> None:
    ours, theirs = result["ours_counts"], result["torch_counts"]
    assert sum(ours.values()) <= sum(theirs.values()), (ours, theirs)
    for key, n in ours.items():
        assert n <= theirs.get(key, 0), (ours, theirs)


def _check_training(results: list[dict]) -> None:
    """Every rank's losses and final weights equal torch's and the one-process reference's."""
    mean_losses = [sum(r["ours_losses"][s] for r in results) / len(results) for s in range(3)]
    torch.testing.assert_close(mean_losses, results[0]["ref_losses"], atol=1e-5, rtol=1e-5)
    for r in results:
        assert r["all_sharded"]
        torch.testing.assert_close(r["ours_losses"], r["torch_losses"], atol=1e-5, rtol=1e-5)
        assert r["vs_torch"] < 1e-5 and r["vs_reference"] < 1e-5, r
        _check_counts(r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reshard_after_forward", [None, False])
def test_fully_shard_matches_reference_and_torch(world: int, reshard_after_forward: bool | None) -> None:
    _check_training(run_world(_compare_training, world, reshard_after_forward, None))


def test_hsdp_on_a_2d_mesh_matches_reference_and_torch() -> None:
    # (2, 2): replicate over dim 0, shard over dim 1; one all-gather / reduce-scatter over the shard
    # dim and one all-reduce over the replicate dim per group, as torch's
    results = run_world(_compare_training, 4, None, None, (2, 2))
    _check_training(results)
    for r in results:
        assert r["ours_counts"].get("all_reduce", 0) > 0, r["ours_counts"]


def test_mixed_precision_matches_torch() -> None:
    for r in run_world(_compare_training, 2, None, torch.bfloat16):
        torch.testing.assert_close(r["ours_losses"], r["torch_losses"], atol=1e-2, rtol=1e-2)
        assert r["vs_torch"] < 1e-2, r
        _check_counts(r)


def test_unused_nested_module_gets_no_grad_and_reshards() -> None:
    results = run_world(_unused_module_is_resharded, 2)
    for r in results:
        assert r["side_grads"] == [True, True] and r["all_sharded"], r
        assert not any(r["unsharded_groups"]), r
        assert r["vs_reference"] < 1e-5, r
    mean_losses = [sum(r["losses"][s] for r in results) / 2 for s in range(2)]
    torch.testing.assert_close(mean_losses, results[0]["ref_losses"], atol=1e-5, rtol=1e-5)


def test_grad_accumulation_without_sync_matches_reference() -> None:
    for r in run_world(_grad_accumulation_without_sync, 2):
        assert r["reduce_scatters"] == [0, 3], r  # one per group (2 blocks + root), only when syncing
        assert r["grad_diff"] < 1e-5, r


def test_uneven_and_empty_shards_train_like_reference() -> None:
    results = run_world(_empty_shards_train, 4)
    assert [r["local_rows"] for r in results] == [[2, 2, 1, 1], [2, 2, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert all(r["vs_reference"] < 1e-5 for r in results), results


def test_activation_checkpointed_blocks_train_like_reference() -> None:
    assert all(r["vs_reference"] < 1e-5 for r in run_world(_activation_checkpointing_train, 2))


def test_unshard_reshard_by_hand() -> None:
    assert max(run_world(_unshard_and_reshard_by_hand, 2)) == 0.0


def test_errors_say_what_to_do() -> None:
    messages = run_world(_errors, 2)[0]
    assert "1-D mesh" in messages[0] and "init_device_mesh" in messages[1]
