"""Per-block torch.compile (apply_compile): the same loss and gradients as eager on one process, with and without
activation checkpointing; in every layout (TP, CP with both rotate methods, FSDP x TP, DDP x TP, memory-budget
AC), bit for bit, with one graph for the identical blocks; TP(2) with loss parallelism trains through the trainer.

The backend is "aot_eager" (dynamo + AOT autograd, eager kernels): it traces exactly what inductor
would, in seconds on CPU, without a C++ toolchain.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.llama3 import Transformer, TransformerModelArgs
from models.llama3.parallelize import apply_compile, parallelize_llama
from parallelisms.activation_checkpoint import apply_ac
from tests.trainer.test_train import _SHORT_DEBUG_JOB, _losses, _train_rank, destroy_groups_since
from tests.world import run_world

TINY = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32)
BACKEND = "aot_eager"


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list]:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1))  # (B*T, V) vs (B*T,)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_compiled_blocks_match_eager(ac_mode: str) -> None:
    torch.manual_seed(0)
    eager = Transformer(TINY)
    compiled = copy.deepcopy(eager)
    apply_ac(compiled, ac_mode)  # type: ignore[arg-type]
    apply_compile(compiled, BACKEND)
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, TINY.vocab_size, (2, 2, TINY.max_seq_len), generator=g)  # 2 x (B, T)
    want_loss, want_grads = _loss_and_grads(eager, tokens, labels)
    got_loss, got_grads = _loss_and_grads(compiled, tokens, labels)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    names = [n for n, _ in compiled.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]  # compile keeps FQNs (checkpoints, plans)
    with torch.no_grad():  # eval forward (another grad mode: recompiled, same values)
        torch.testing.assert_close(compiled(tokens), eager(tokens), rtol=1e-6, atol=1e-6)


def test_compile_in_any_layout_passes_the_preflight_without_a_word() -> None:
    """torchtitan's 405B config compiles under TP 8: no warning any more; memory_budget AC needs the compiled blocks."""
    from trainer.config import load_config
    from trainer.preflight import check_config

    for flags in (["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.context_parallel_degree", "2"]):
        assert not [w for w in check_config(load_config(["--compile.enable", *flags]), world_size=2) if "compile" in w]
    budget = ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.3"]
    check_config(load_config(["--compile.enable", *budget]), world_size=1)
    with pytest.raises(ValueError, match=r"activation_checkpoint.mode='memory_budget' needs the blocks compiled"):
        check_config(load_config(budget), world_size=1)
    with pytest.raises(ValueError, match=r"activation_checkpoint.memory_budget=1.5: expected a fraction"):
        check_config(load_config(["--compile.enable", *budget[:3], "1.5"]), world_size=1)


# name: (ranks, ParallelDims degrees, AC mode, CP rotate method)
LAYOUTS = {
    "tp2": (2, dict(tp=2), "none", "allgather"),
    "cp2_allgather": (2, dict(cp=2), "none", "allgather"),
    "cp2_alltoall": (2, dict(cp=2), "selective", "alltoall"),  # and AC inside the compiled blocks
    "fsdp2_tp2": (4, dict(dp_shard=2, tp=2), "memory_budget", "allgather"),  # the min-cut partitioner under FSDP x TP
    "ddp2_tp2": (4, dict(dp_replicate=2, tp=2), "full", "allgather"),
}


def compiled_layouts_match_eager(names: list[str]) -> dict[str, tuple[float, float, float, int]]:
    """Each layout's tiny Llama, eager and compiled from the same weights: two steps' losses and the worst
    gradient difference, and the graphs the compiled blocks made."""
    import torch.distributed as dist

    from parallelisms.context_parallel import SequenceSharding
    from parallelisms.parallel_dims import ParallelDims

    results = {}
    for name in names:
        _, degrees, ac_mode, rotate = LAYOUTS[name]
        dims = ParallelDims(**{"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, **degrees},
                            world_size=dist.get_world_size())  # fmt: skip
        groups_before = set(dist.distributed_c10d._world.pg_map)
        mesh = dims.build_mesh("cpu")
        torch.manual_seed(0)
        base = Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                                                max_seq_len=32))  # fmt: skip
        runs = []
        for backend in (None, BACKEND):
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            model = parallelize_llama(copy.deepcopy(base), dims, mesh, loss_parallel=False, compile_backend=backend,
                                      ac_mode="none" if backend is None and ac_mode == "memory_budget" else ac_mode,
                                      cp_rotate_method=rotate)  # fmt: skip
            tokens, labels = torch.randint(0, 96, (2, 2, 32), generator=torch.Generator().manual_seed(1))
            if dims.cp_enabled:  # each rank holds its share of every sequence, as the trainer cuts it
                sharding = SequenceSharding.of(mesh["cp"])
                tokens, labels = sharding.shard(tokens, dim=-1), sharding.shard(labels, dim=-1)
            losses = []
            for _ in range(2):  # the second call reuses the graphs
                losses.append(F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1)))
                losses[-1].backward()
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()}  # fmt: skip
            runs.append(
                ([x.item() for x in losses], grads, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs)
            )
        (eager, eager_grads, _), (compiled, compiled_grads, graphs) = runs
        worst = max((compiled_grads[n] - g).abs().max().item() for n, g in eager_grads.items())
        results[name] = (*[c - e for c, e in zip(compiled, eager)], worst, graphs)
        del runs, base
        destroy_groups_since(groups_before)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_compiles_whole_blocks_with_eager_gradients(world: int) -> None:
    """fullgraph=True: a graph break would raise. Both blocks share one forward graph (the counter counts dynamo's
    graphs); the losses and every gradient are eager's within 1e-6, float32 rounding (aot_eager runs eager's
    kernels; traced ring attention and the min-cut partitioner's recomputation may sum in another order; a
    wrong or missing collective moves them by 1e-3 and more)."""
    names = [name for name, layout in LAYOUTS.items() if layout[0] == world]
    results = run_world(compiled_layouts_match_eager, world, names, timeout=600.0)[0]
    for name, (first, second, worst, graphs) in results.items():
        tol = 1e-6
        assert abs(first) <= tol and abs(second) <= tol and worst <= tol, (name, first, second, worst)
        assert graphs == 1, (name, graphs)


def test_tp2_trains_compiled_with_loss_parallel_like_eager(tmp_path: Path) -> None:
    """The trainer on TP(2), blocks and loss compiled (the loss on vocabulary-sharded DTensor logits): eager's
    losses. fully_shard's hooks around compiled blocks are covered by FSDP(2) x TP(2) above."""
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    compiled = _losses(run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, *tp2, "--job.dump_folder", str(tmp_path / "c"),
                                                  "--compile.enable", "--compile.backend", BACKEND])[0])  # fmt: skip
    eager = _losses(run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, *tp2, "--job.dump_folder", str(tmp_path / "e")])[0])
    assert len(compiled) == 3 and all(math.isfinite(x) for x in compiled) and compiled[-1] < compiled[0]
    assert compiled == eager, (compiled, eager)
