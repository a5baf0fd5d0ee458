"""Meta-device build + layout_invariant_init: the same global weights on every layout, bitwise.

The trainer's path (trainer.train.build_model / parallelize_llama / init_model) on one process,
FSDP(2), FSDP(4), TP(2), HSDP(2,2) and FSDP x TP(2,2); every rank returns a digest of every full
parameter, and all layouts must agree with one process. Sizes are uneven for the shards (vocab 37,
FFN hidden 96 over 4 ranks is even, 37 over 2 x 2 is not).
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from models.llama3 import Transformer, llama3_configs
from models.llama3.parallelize import parallelize_llama
from parallelisms.dtensor import DTensor
from parallelisms.parallel_dims import ParallelDims
from tests.world import run_world

ARGS = dataclasses.replace(llama3_configs["debugmodel"], dim=32, n_layers=2, n_heads=4, vocab_size=37, max_seq_len=16)
LAYOUTS = {  # name: (world, dp_replicate, dp_shard, tp)
    "one": (1, 1, 1, 1),
    "fsdp2": (2, 1, 2, 1),
    "fsdp4": (4, 1, 4, 1),
    "tp2": (2, 1, 1, 2),
    "hsdp2x2": (4, 2, 2, 1),
    "fsdp2_tp2": (4, 1, 2, 2),
}


def _digests(layout: str) -> dict[str, object]:
    from trainer.build import init_model

    world, dp_replicate, dp_shard, tp = LAYOUTS[layout]
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, world_size=world)
    torch.manual_seed(42)
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize_llama(model, dims, dims.build_mesh("cpu"), loss_parallel=tp > 1)
    init_model(model, torch.device("cpu"))
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )
    out: dict[str, object] = {"_local_bytes": local_bytes}
    for name, p in model.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        out[name] = hashlib.sha256(full.contiguous().numpy().tobytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def one_process() -> dict[str, object]:
    return run_world(_digests, 1, "one")[0]


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "one"])
def test_every_layout_initializes_the_same_weights(layout: str, one_process: dict[str, object]) -> None:
    world, _, dp_shard, tp = LAYOUTS[layout]
    want = {k: v for k, v in one_process.items() if not k.startswith("_")}
    for rank, digests in enumerate(run_world(_digests, world, layout)):
        local = digests.pop("_local_bytes")
        assert digests == want, (layout, rank)
        # a rank allocates only its shards: about 1 / (dp_shard * tp) of the model
        assert local <= 1.3 * one_process["_local_bytes"] / (dp_shard * tp), (layout, rank, local)


def test_init_weights_differ_between_parameters(one_process: dict[str, object]) -> None:
    """A digest per parameter that repeats would mean fills reusing one stream."""
    values = [v for k, v in one_process.items() if not k.startswith("_") and "norm" not in k]
    assert len(set(values)) == len(values)
