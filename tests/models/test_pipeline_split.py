"""Splitting the Llama into pipeline parts: torchtitan's split of the layers, parts that keep the global FQNs and
chain into the whole model's logits, an init that gives every part the whole model's weights bit for bit, and the
pipeline runtime over the parts giving one process's gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from models.common.pipeline_split import module_fqns_per_stage, split_model
from models.llama3 import Transformer, llama3_configs
from parallelisms.dtensor.layout_invariant_init import layout_invariant_init
from tests.world import run_world

ARGS = dataclasses.replace(llama3_configs["debugmodel"], dim=32, n_layers=6, n_heads=4, vocab_size=37, max_seq_len=8)


@pytest.mark.parametrize(
    "stages, first_less, last_less, expected",
    [  # torchtitan v0.2.0's generate_llm_fqn_per_model_part on the same arguments
        (2, 1, 1, [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                   ["layers.3", "layers.4", "layers.5", "norm", "output"]]),
        (4, 1, 1, [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"],
                   ["layers.5", "norm", "output"]]),
        (3, 0, 0, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"],
                   ["layers.4", "layers.5", "norm", "output"]]),
    ],
)  # fmt: skip
def test_layers_split_as_torchtitan(stages: int, first_less: int, last_less: int, expected: list) -> None:
    got = module_fqns_per_stage(stages, 6, first_stage_less_layers=first_less, last_stage_less_layers=last_less)
    assert got == expected


def test_an_impossible_split_names_the_arithmetic_and_the_keys() -> None:
    with pytest.raises(ValueError, match=r"9 pipeline stages over 6 layers \+ 1 \(embedding\) \+ 1 .* = 8 effective"):
        module_fqns_per_stage(9, 6)
    with pytest.raises(ValueError, match=r"names \['layers.9'\], which the model does not have"):
        split_model(Transformer(ARGS), ["layers.9"])


def _whole_and_parts(num_stages: int) -> tuple[Transformer, list[Transformer]]:
    with torch.device("meta"):
        whole = Transformer(ARGS)
    parts = [split_model(whole, fqns) for fqns in module_fqns_per_stage(num_stages, ARGS.n_layers)]
    for model in (whole, *parts):
        torch.manual_seed(0)  # as the trainer: the same seed on every rank, then each its own part
        model.to_empty(device="cpu")
        with layout_invariant_init():
            model.init_weights(buffer_device=torch.device("cpu"))
    return whole, parts


def test_parts_get_the_whole_models_weights_keep_its_names_and_chain_into_its_logits() -> None:
    whole, parts = _whole_and_parts(3)
    weights = dict(whole.named_parameters())
    seen = []
    for part in parts:
        for name, p in part.named_parameters():
            assert torch.equal(p, weights[name]), name  # global FQNs, the whole model's values
            seen.append(name)
    assert sorted(seen) == sorted(weights)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    h = tokens
    for part in parts:
        h = part(h)  # (B, T, D) between the parts, (B, T, V) out of the last
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)


def _pipeline_grads(schedule: str) -> dict:
    from parallelisms.pipeline_parallel import get_schedule, lower_schedule, stage_to_rank
    from parallelisms.pipeline_parallel.interpreter import PipelineSchedule
    from parallelisms.pipeline_parallel.stage import BoundaryMeta, PipelineStage

    pp, rank = dist.get_world_size(), dist.get_rank()
    whole, parts = _whole_and_parts(pp)
    spec, m = get_schedule(schedule), 4
    mapping = stage_to_rank(pp, 1, spec.placement)
    meta = BoundaryMeta((1, 8, ARGS.dim), torch.float32)
    stage = PipelineStage(parts[rank], rank, pp, dist.group.WORLD, mapping, torch.device("cpu"),  # type: ignore[arg-type]
                          None if rank == 0 else meta, None if rank == pp - 1 else meta)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, ARGS.vocab_size, (m, 1, 9), generator=g)
    inputs, targets = [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")

    actions = [a for a in lower_schedule(spec.generate(pp, 1, m), mapping, m)[rank] if a is not None]
    PipelineSchedule([stage], actions, loss_fn).step(inputs, targets)
    sum(loss_fn(whole(x), y) for x, y in zip(inputs, targets)).backward()  # type: ignore[union-attr]
    reference = dict(whole.named_parameters())
    return {n: (p.grad, reference[n].grad) for n, p in parts[rank].named_parameters()}


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_the_pipelined_llama_gives_one_process_gradients(schedule: str) -> None:
    for rank, grads in enumerate(run_world(_pipeline_grads, 2, schedule)):
        assert grads, rank
        for name, (got, want) in grads.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
