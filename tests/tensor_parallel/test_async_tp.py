"""Async TP (parallelisms/tensor_parallel/collective_matmul.py, async_styles.py): the collective matmuls against
one process in float64, forward and backward, at tp 2 and 4; a Llama under async TP against synchronous TP,
eager and compiled, and with linears that run a matmul of their own, as float8's do (synchronous, said once)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.world import run_world

B, S, D, OUT = 2, 8, 12, 8  # S divides by 2 and 4; D by 2 and 4 (the row-parallel contracted dim)


def _shard(t: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    return t.chunk(n, dim)[r].clone().requires_grad_()


def collective_matmuls_against_one_process() -> list[float]:
    """The worst difference, over outputs and gradients, of both collective matmuls from one process's."""
    from parallelisms.dtensor import init_device_mesh
    from parallelisms.ring_pass import RingGroup
    from parallelisms.tensor_parallel.collective_matmul import SequenceRing, all_gather_matmul, matmul_reduce_scatter

    n, r = dist.get_world_size(), dist.get_rank()
    seq = SequenceRing(RingGroup.of(init_device_mesh("cpu", (n,))), dim=1)
    g = torch.Generator().manual_seed(0)
    x, w1, w2, w3 = (torch.randn(*shape, generator=g, dtype=torch.float64)
                     for shape in ((B, S, D), (OUT, D), (2 * OUT, D), (OUT, D)))  # fmt: skip
    r1, r2, r3 = (torch.randn(B, S, o, generator=g, dtype=torch.float64) for o in (OUT, 2 * OUT, OUT))

    # column-parallel: x sharded on the sequence, w1 and w2 on their outputs
    x_seq, w1_col, w2_col = _shard(x, 1, n, r), _shard(w1, 0, n, r), _shard(w2, 0, n, r)
    y1, y2 = all_gather_matmul(seq, x_seq, w1_col, w2_col)
    ((y1 * r1.chunk(n, -1)[r]).sum() + (y2 * r2.chunk(n, -1)[r]).sum()).backward()
    col_x, col_w1, col_w2 = _grads(lambda x, a, b: (F.linear(x, a) * r1).sum() + (F.linear(x, b) * r2).sum(), x, w1, w2)
    # row-parallel: x and w3 sharded on the contracted dim, the output on the sequence
    x_row, w3_row = _shard(x, -1, n, r), _shard(w3, 1, n, r)
    y3 = matmul_reduce_scatter(seq, x_row, w3_row)
    (y3 * r3.chunk(n, 1)[r]).sum().backward()
    row_x, row_w3 = _grads(lambda x, w: (F.linear(x, w) * r3).sum(), x, w3)
    pairs = [
        (y1, F.linear(x, w1).chunk(n, -1)[r]), (y2, F.linear(x, w2).chunk(n, -1)[r]),
        (y3, F.linear(x, w3).chunk(n, 1)[r]),
        (x_seq.grad, col_x.chunk(n, 1)[r]), (w1_col.grad, col_w1.chunk(n, 0)[r]), (w2_col.grad, col_w2.chunk(n, 0)[r]),
        (x_row.grad, row_x.chunk(n, -1)[r]), (w3_row.grad, row_w3.chunk(n, 1)[r]),
    ]  # fmt: skip
    return [(got - want).abs().max().item() for got, want in pairs]  # type: ignore[operator]


def _grads(loss_of, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [t.clone().requires_grad_() for t in tensors]
    return torch.autograd.grad(loss_of(*leaves), leaves)


@pytest.mark.parametrize("world", [2, 4])
def test_collective_matmuls_equal_one_process(world: int) -> None:
    """float64, so that any difference beyond 1e-12 is a wrong or missing chunk, not rounding."""
    for rank, errors in enumerate(run_world(collective_matmuls_against_one_process, world)):
        assert max(errors) < 1e-12, (world, rank, errors)


TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, max_seq_len=32)


class OwnMatmulLinear(torch.nn.Linear):
    """A Linear subclass, as float8's Float8Linear is: the ring cannot run its matmul for it."""


def llama_async_against_sync(
    own_matmul: bool, backend: str | None
) -> tuple[list[float], list[float], float, list[str]]:
    """A tiny Llama under TP(world) with and without async TP, two steps each from the same weights: the
    losses, the worst gradient difference and the async TP log lines. `own_matmul`: its blocks' linears are
    OwnMatmulLinear."""
    from models.llama3 import Transformer, TransformerModelArgs
    from models.llama3.parallelize import parallelize_llama
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.tensor_parallel import async_styles

    n = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=n, pp=1, world_size=n)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    base = Transformer(TransformerModelArgs(**TINY))  # type: ignore[arg-type]
    for module in base.layers.modules() if own_matmul else ():
        if type(module) is torch.nn.Linear:
            module.__class__ = OwnMatmulLinear
    tokens, labels = torch.randint(0, 96, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    async_styles.logger.addHandler(handler)
    async_styles._said.clear()
    runs = []
    for async_tp in (False, True):
        model = parallelize_llama(copy.deepcopy(base), dims, mesh, loss_parallel=False, async_tp=async_tp,
                                  compile_backend=backend if async_tp else None)  # fmt: skip
        losses = []
        for _ in range(2):
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, {name: p.grad.full_tensor() for name, p in model.named_parameters()}))
    async_styles.logger.removeHandler(handler)
    (sync_losses, sync_grads), (async_losses, async_grads) = runs
    worst = max((async_grads[name] - g).abs().max().item() for name, g in sync_grads.items())
    return sync_losses, async_losses, worst, said


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_llama_under_async_tp_equals_sync_tp(backend: str | None) -> None:
    """TP(2): the ring sums two partials, in another order than the reduce-scatter, which at two is the same sum;
    the chunked matmuls may round differently from whole ones, so 1e-6 (a missing chunk moves them by 1e-2)."""
    sync_losses, async_losses, worst, said = run_world(llama_async_against_sync, 2, False, backend)[0]
    assert sync_losses == pytest.approx(async_losses, abs=1e-6) and worst < 1e-6, (sync_losses, async_losses, worst)
    assert not said


@pytest.mark.parametrize("backend", [None, "aot_eager"])  # compiled: said while dynamo traces
def test_linears_with_a_matmul_of_their_own_run_synchronously_and_say_so_once(backend: str | None) -> None:
    sync_losses, async_losses, worst, said = run_world(llama_async_against_sync, 2, True, backend)[0]
    assert sync_losses == async_losses and worst == 0.0  # the same synchronous collectives
    why = "OwnMatmulLinear runs a matmul of its own"
    assert sorted(said) == sorted([
        f"async TP: Attention's wq, wk, wv gather their input at once: {why}",
        f"async TP: FeedForward's w1, w3 gather their input at once: {why}",
        f"async TP: a row-parallel OwnMatmulLinear reduces, then scatters: {why}",
    ]), said  # fmt: skip


def test_the_preflight_says_where_async_tp_cannot_act() -> None:
    from trainer.config import load_config
    from trainer.preflight import check_config

    on = "--parallelism.enable_async_tensor_parallel"
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    assert [w for w in check_config(load_config([on]), world_size=1) if on[2:] in w] == [
        "parallelism.enable_async_tensor_parallel=true has no effect: tensor_parallel_degree is 1 (no TP collectives "
        "to overlap)"
    ]
    assert not [w for w in check_config(load_config([on, *tp2]), world_size=2) if on[2:] in w]
