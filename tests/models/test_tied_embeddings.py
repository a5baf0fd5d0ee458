"""Tied embeddings (the 1B flavor's `tie_word_embeddings`): one (vocab, dim) parameter serves the
embedding and the output projection on every layout. Built on meta and initialized as the trainer
does, trained 3 AdamW steps on one process, FSDP(2), TP(2) and FSDP x TP(2, 2): the same losses and
weights as one process, the weight still shared, and fully_shard refusing to split it over groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.llama3 import Transformer, llama3_configs
from models.llama3.parallelize import parallelize_llama
from parallelisms.dtensor import DTensor
from parallelisms.fsdp import fully_shard
from parallelisms.parallel_dims import ParallelDims
from tests.world import run_world

ARGS = dataclasses.replace(
    llama3_configs["1B"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=38, max_seq_len=8
)  # the 1B flavor's options (tied, GQA, RoPE scaling) at a test's size; vocab 38 is uneven over 4
LAYOUTS = {"one": (1, 1, 1), "fsdp2": (2, 2, 1), "tp2": (2, 1, 2), "fsdp2_tp2": (4, 2, 2)}  # world, dp_shard, tp


def _train(layout: str) -> dict[str, object]:
    from trainer.build import init_model

    world, dp_shard, tp = LAYOUTS[layout]
    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=1, world_size=world)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize_llama(model, dims, dims.build_mesh("cpu"), loss_parallel=False)
    init_model(model, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, ARGS.vocab_size, (4, ARGS.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    rank, dp = (torch.distributed.get_rank() // tp, dp_shard) if world > 1 else (0, 1)
    x, y = tokens[:, :-1].chunk(dp)[rank], tokens[:, 1:].chunk(dp)[rank]
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    if dp > 1:  # the global mean loss, as one process computes it on the whole batch (tp ranks agree)
        torch.distributed.all_reduce(stacked := torch.stack(losses))
        losses = list(stacked / world)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return {
        "losses": [float(v) for v in losses],
        "weights": full,
        "tied": model.output.weight is model.tok_embeddings.weight,
        "placements": str(getattr(model.output.weight, "placements", None)),
    }


@pytest.fixture(scope="module")
def one_process() -> dict[str, object]:
    return run_world(_train, 1, "one")[0]


def test_the_1b_flavor_has_llama_3_2_1b_shapes() -> None:
    with torch.device("meta"):
        model = Transformer(llama3_configs["1B"])
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400  # Llama-3.2-1B, lm_head tied


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2_tp2"])
def test_tied_model_trains_like_one_process(layout: str, one_process: dict[str, object]) -> None:
    assert one_process["tied"] and "output.weight" not in one_process["weights"]  # type: ignore[operator]
    for rank, got in enumerate(run_world(_train, LAYOUTS[layout][0], layout)):
        assert got["tied"], (layout, rank)
        torch.testing.assert_close(got["losses"], one_process["losses"], rtol=1e-5, atol=1e-5)
        for name, want in one_process["weights"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(
                got["weights"][name], want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )


def _shard_the_tied_weight_twice() -> str:
    model = Transformer(ARGS)
    fully_shard(model.tok_embeddings)
    try:
        fully_shard([model.norm, model.output])
    except ValueError as e:
        return str(e)
    return "no error"


def test_fully_shard_refuses_to_split_a_shared_parameter_over_groups() -> None:
    message = run_world(_shard_the_tied_weight_twice, 2)[0]
    assert "'weight' is shared with a module that an earlier fully_shard call already sharded" in message
    assert "one fully_shard([...]) call" in message
