"""replicate (DDP) against torch.nn.parallel.DistributedDataParallel on gloo: the same gradients and weights,
one all-reduce per bucket issued while backward still runs, no communication under no_sync, parameters
taken from rank 0, and the bucket assignment's pure math."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelisms.data_parallel import assign_buckets, replicate
from tests.world import run_world

MIB = 1024 * 1024


# --------------------------------------------------------------------------------- pure math
def test_buckets_close_at_their_cap_first_one_small_and_split_by_dtype() -> None:
    sizes = [MIB // 2, MIB // 2, MIB, 3 * MIB, MIB, MIB]
    assert assign_buckets(sizes, ["f32"] * 6, cap_bytes=2 * MIB) == [[0, 1], [2, 3], [4, 5]]
    kinds = ["f32", "bf16", "f32", "bf16", "f32", "bf16"]
    assert assign_buckets([MIB] * 6, kinds, cap_bytes=2 * MIB) == [[0], [1], [2, 4], [3, 5]]
    assert assign_buckets([10, 10], ["f32"] * 2, cap_bytes=25 * MIB) == [[0, 1]]  # one open bucket at the end
    with pytest.raises(ValueError, match="bucket caps must be positive"):
        assign_buckets([1], ["f32"], cap_bytes=0)


# ----------------------------------------------------------------------------- the programs
WIDTH, LAYERS = 256, 6  # 256 KiB per weight: a few buckets at a 0.5 MiB cap


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(nn.Embedding(50, WIDTH), *layers, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 50))
    if dist.get_rank() != 0:  # a different start everywhere else: both DDPs must take rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())  # each rank its own data
    return torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g)


def _train(backend: str, *, steps: int = 3, micro_batches: int = 1, bucket_cap_mb: float = 0.5) -> dict:
    model = _model()
    if backend == "torch":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: nn.Module = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        no_sync = wrapped.no_sync  # type: ignore[operator]
    else:
        wrapped = replicate(model, bucket_cap_mb=bucket_cap_mb)
        no_sync = wrapped.no_sync  # type: ignore[attr-defined]
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # AdamW would blow ulp-level differences of 4-rank sums up
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro_batches):
            x, y = _batch(step, m)
            context = no_sync() if m < micro_batches - 1 else torch.enable_grad()
            with context:
                logits = wrapped(x)  # (B, T, V)
                nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return {"start": start, "grads": grads, "final": [p.detach().clone() for p in model.parameters()]}


def _compare(world: int, **options: float) -> None:
    ours, torchs = run_world(_train, world, "ours", **options), run_world(_train, world, "torch", **options)
    for rank in range(world):
        exact = world == 2  # a sum of two is the same in any order; of four, gloo's order may differ
        for a, b in zip(ours[rank]["start"], torchs[rank]["start"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # rank 0's weights everywhere
        for step_ours, step_torch in zip(ours[rank]["grads"], torchs[rank]["grads"]):
            for a, b in zip(step_ours, step_torch):
                torch.testing.assert_close(a, b, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-6)
        for a, b in zip(ours[rank]["final"], torchs[rank]["final"]):
            torch.testing.assert_close(a, b, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_replicate_trains_like_torch_ddp(world: int) -> None:
    _compare(world)


def test_gradient_accumulation_under_no_sync_is_torch_ddps() -> None:
    _compare(2, micro_batches=3)


# ----------------------------------------------------------------------- the communication
def _observe(bucket_cap_mb: float) -> dict:
    """All-reduces per backward, how many had started when the first layer's gradient arrived (the last
    one backward computes), and the counts under no_sync."""
    from parallelisms.dtensor.debug import CommDebugMode

    model = _model()
    started_before_last: list[int] = []  # hooked before replicate's own: runs first
    model[0].weight.register_post_accumulate_grad_hook(lambda _: started_before_last.append(state.all_reduces))
    replicate(model, bucket_cap_mb=bucket_cap_mb)
    state = model._replicate_state  # type: ignore[attr-defined]
    counts = []
    for step in range(3):
        x, y = _batch(step)
        before = state.all_reduces
        with CommDebugMode() as comm:
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        counts.append((state.all_reduces - before, {str(k): n for k, n in comm.get_comm_counts().items()}))
    with model.no_sync(), CommDebugMode() as quiet:  # type: ignore[operator]
        x, y = _batch(9)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return {
        "buckets": len(state.buckets), "counts": counts, "started_before_last": started_before_last,
        "quiet": quiet.get_total_counts(),
    }  # fmt: skip


def test_one_all_reduce_per_bucket_started_during_backward_none_under_no_sync() -> None:
    seen = run_world(_observe, 2, 0.5)[0]
    buckets = seen["buckets"]
    assert buckets >= 3, seen  # a 1 MiB first bucket, then 0.5 MiB ones, over ~1.6 MiB of weights
    all_reduce = str(torch.ops.c10d_functional.all_reduce)
    for launched, counts in seen["counts"][1:]:  # after the rebuild of the first backward (one broadcast)
        assert launched == buckets and counts == {all_reduce: buckets}, seen
    # when backward reaches the embedding (its last gradient), every other bucket is already in flight
    started = seen["started_before_last"][:3]
    assert [b - a for a, b in zip([0, *started], started)] == [buckets - 1, buckets, buckets], seen
    assert seen["quiet"] == 0


def _meta_then_initialize() -> list[torch.Tensor]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    replicate(model)
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())  # a different init on every rank
    for m in model:
        m.reset_parameters()  # type: ignore[operator]
    model(torch.ones(1, 4))  # the first forward takes rank 0's weights
    return [p.detach().clone() for p in model.parameters()]


def test_a_meta_model_takes_rank_0s_weights_before_its_first_forward() -> None:
    per_rank = run_world(_meta_then_initialize, 2)
    for a, b in zip(*per_rank):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_replicate_refuses_a_2d_mesh_and_a_second_call() -> None:
    model = nn.Linear(2, 2)

    class TwoD:
        ndim, mesh_dim_names = 2, ("dp_replicate", "tp")

    with pytest.raises(ValueError, match=r"1-D data-parallel mesh, got a 2-D mesh \('dp_replicate', 'tp'\)"):
        replicate(model, TwoD())  # type: ignore[arg-type]
