"""The dispatcher's cost model on a whole program: a hand-sharded tiny Llama (every weight a
DTensor, no TP styles) trained 2 AdamW steps issues no more collectives, and sends no more bytes,
than torch's DTensor running the same program, with the same losses and final weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.world import run_world


def train_both(world_size: int) -> dict[str, Any]:
    """Ours with math and with SDPA attention, planned with gloo's link prices (the run's) and with NCCL's
    (as the dry run plans a GPU job), and torch's."""
    import torch.distributed.tensor as tdt

    import parallelisms.dtensor as odt
    from parallelisms.dtensor.cost import CostModel, use_cost_model
    from parallelisms.dtensor.debug import CommDebugMode
    from tests.dtensor.hand_sharded_llama import train
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    mesh, tmesh = get_mesh((world_size,)), get_torch_mesh((world_size,))
    with use_cost_model(CostModel(backend="nccl")):
        priced_as_nccl = train(odt, mesh, CommDebugMode, sdpa=True)
    return {
        "math": train(odt, mesh, CommDebugMode, sdpa=False),
        "sdpa": train(odt, mesh, CommDebugMode, sdpa=True),
        "sdpa, NCCL prices": priced_as_nccl,
        # torch's DTensor has no rule for CPU flash attention, and its SDPA math fallback mixes in
        # a plain mask: its math attention is the peer of both of ours
        # our CommDebugMode counts torch's DTensor too (and bytes, which torch's does not)
        "torch": train(tdt, tmesh, CommDebugMode, sdpa=False),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_hand_sharded_llama_needs_no_more_collectives_or_bytes_than_torch(world_size: int) -> None:
    result = run_world(train_both, world_size, world_size)[0]
    theirs = result["torch"]
    for attention in ("math", "sdpa", "sdpa, NCCL prices"):
        ours = result[attention]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-5)
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, theirs["params"][name], rtol=1e-4, atol=1e-5, msg=name)
        summary = f"{attention}: ours {ours['last_step']} vs torch {theirs['last_step']}"
        assert ours["collectives"] <= theirs["collectives"], summary
        assert ours["bytes"] <= theirs["bytes"], f"{summary}: {ours['bytes']} vs {theirs['bytes']} bytes"
