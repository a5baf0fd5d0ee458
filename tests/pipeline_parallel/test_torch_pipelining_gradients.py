"""Our pipeline runtime against torch.distributed.pipelining and one process, on 2 gloo ranks, every schedule both
have: the same stages (seed-fixed copies of one small model), the same 4 microbatches, targets and loss, one step
each. The last stage's outputs and per-microbatch losses, and every parameter's gradient, equal torch's bitwise (both
runtimes run the same per-microbatch autograd calls in the same order), and equal, to float32 rounding, one process
running the whole model on the full batch (the per-microbatch loss is a mean over the full batch's elements, so the
microbatches' losses add up to the full batch's mean loss, and both runtimes sum their gradients: torch's
``scale_grads=False``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelisms.pipeline_parallel import SCHEDULES, get_schedule, lower_schedule, rank_to_stages, stage_to_rank
from parallelisms.pipeline_parallel.interpreter import PipelineSchedule
from parallelisms.pipeline_parallel.stage import BoundaryMeta, PipelineStage
from tests.pipeline_parallel.test_runtime import DIM, MB, _stage_part, _whole_model  # the same small model
from tests.pipeline_parallel.torch_oracle import TORCH_CLASSES, torch_runtime
from tests.world import run_world

PP, MICROBATCHES = 2, 4
COMPARED = [name for name in SCHEDULES if name in TORCH_CLASSES]  # all of ours; the V one in its V placement
# The same float ops on the same tensors in the same order (the split backward's too): torch's and ours agree bit
# for bit (measured on CPU, torch 2.13).
BITWISE = {"rtol": 0.0, "atol": 0.0}
# One process: one (12, 8) matmul per layer where the pipelines do four (3, 8) ones and add up four weight gradients;
# float32 rounding only (measured: at most 3e-8 absolute, gradients' largest entries 1e-3 to 1e-1).
ONE_PROCESS = {"rtol": 1e-5, "atol": 1e-7}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch: (MICROBATCHES * MB, DIM) inputs and targets, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(MICROBATCHES * MB, DIM, generator=g), torch.randn(MICROBATCHES * MB, DIM, generator=g)


def _microbatch_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A microbatch's share of the full batch's mean squared error (divided by 4: exact in floating point)."""
    return (out - target).pow(2).mean() / MICROBATCHES


def _full_batch_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _grads(model: nn.Sequential, stages: list[int]) -> dict[str, torch.Tensor | None]:
    return {
        f"{s}.{name}": None if p.grad is None else p.grad.clone()
        for s in stages
        for name, p in _stage_part(model, s).named_parameters()
    }


def _last_outputs(module: nn.Module) -> list[torch.Tensor]:
    """Every output `module` returns from now on, in call order."""
    outputs: list[torch.Tensor] = []
    module.register_forward_hook(lambda mod, args, out: outputs.append(out.detach().clone()))
    return outputs


def _run_ours(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
    spec, rank = get_schedule(name), dist.get_rank()
    per_rank = 1 if spec.single_stage else 2
    num_stages = PP * per_rank
    mapping = stage_to_rank(PP, per_rank, spec.placement)
    mine = rank_to_stages(PP, per_rank, spec.placement)[rank]
    meta = BoundaryMeta((MB, DIM), torch.float32)
    parts = {s: _stage_part(model, s) for s in mine}
    stages = [
        PipelineStage(
            parts[s], s, num_stages, dist.group.WORLD, mapping, torch.device("cpu"),  # type: ignore[arg-type]
            input_meta=None if s == 0 else meta, output_meta=None if s == num_stages - 1 else meta,
        )
        for s in mine
    ]  # fmt: skip
    # every schedule runs the last stage's forwards in microbatch order: their outputs, concatenated, are the batch's
    outputs = _last_outputs(parts[num_stages - 1]) if num_stages - 1 in parts else []
    lowered = lower_schedule(spec.generate(PP, per_rank, MICROBATCHES), mapping, MICROBATCHES)[rank]
    runner = PipelineSchedule(stages, [a for a in lowered if a is not None], _microbatch_loss)
    first, last = 0 in mine, num_stages - 1 in mine
    result = runner.step(list(x.chunk(MICROBATCHES)) if first else None, list(y.chunk(MICROBATCHES)) if last else None)
    return result.losses, outputs


def _run_torch(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[list, torch.Tensor | None]:
    spec, rank = get_schedule(name), dist.get_rank()
    per_rank = 1 if spec.single_stage else 2
    num_stages = PP * per_rank
    mine = rank_to_stages(PP, per_rank, spec.placement)[rank]
    parts = {s: _stage_part(model, s) for s in mine}
    schedule = torch_runtime(name, parts, num_stages, MICROBATCHES, _microbatch_loss, dist.group.WORLD)
    first, last = 0 in mine, num_stages - 1 in mine
    losses: list[torch.Tensor] = []
    # torch's step returns the last stage's outputs, merged over the microbatches (its stages also run a forward
    # of their own the first time, to infer the boundary shapes: a hook would see 5 forwards)
    merged = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
    return [loss.detach() for loss in losses], merged


def _compare_all(names: list[str]) -> dict[str, dict]:
    """On each rank, per schedule: this rank's gradients under ours, torch's and one process, and where this rank
    holds the last stage, the per-microbatch losses and outputs of each."""
    out: dict[str, dict] = {}
    x, y = _batch()
    for name in names:
        spec = get_schedule(name)
        per_rank = 1 if spec.single_stage else 2
        num_stages = PP * per_rank
        mine = rank_to_stages(PP, per_rank, spec.placement)[dist.get_rank()]
        whole = _whole_model(num_stages)
        ours, theirs, reference = copy.deepcopy(whole), copy.deepcopy(whole), copy.deepcopy(whole)

        our_losses, our_outputs = _run_ours(name, ours, x, y)
        dist.barrier()
        torch_losses, torch_outputs = _run_torch(name, theirs, x, y)
        dist.barrier()
        ref_out = reference(x)
        ref_loss = _full_batch_loss(ref_out, y)
        ref_loss.backward()

        got: dict = {
            "stages": mine,
            "grads": {
                "ours": _grads(ours, mine),
                "torch": _grads(theirs, mine),
                "one process": _grads(reference, mine),
            },
            "last": num_stages - 1 in mine,
        }
        if got["last"]:
            got |= {
                "losses": {"ours": our_losses, "torch": torch_losses},
                "outputs": {"ours": torch.cat(our_outputs), "torch": torch_outputs.detach()},
                "one process": {"loss": ref_loss.detach(), "output": ref_out.detach()},
            }
        out[name] = got
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict]]:
    """Every compared schedule in one call of the 2-rank world (under a second): per rank, per schedule. A failure
    is raised once and reported by every test that uses it (pytest caches a fixture's error for its scope)."""
    return run_world(_compare_all, PP, COMPARED)


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict[str, float], what: str) -> None:
    torch.testing.assert_close(actual, expected, **tolerance, msg=lambda m: f"{what}: {m}")


def test_every_schedule_of_ours_is_compared() -> None:
    assert COMPARED == list(SCHEDULES), sorted(set(SCHEDULES) - set(TORCH_CLASSES))


@pytest.mark.parametrize("name", COMPARED)
def test_outputs_losses_and_gradients_equal_torch_pipelining_and_one_process(
    name: str, results: list[dict[str, dict]]
) -> None:
    per_rank = 1 if get_schedule(name).single_stage else 2
    whole, lasts = _whole_model(PP * per_rank), 0
    for rank, by_name in enumerate(results):
        got = by_name[name]
        grads = got["grads"]
        expected_keys = {f"{s}.{n}" for s in got["stages"] for n, _ in _stage_part(whole, s).named_parameters()}
        for runtime, g in grads.items():
            assert g.keys() == expected_keys, (rank, runtime)
            missing = sorted(k for k, v in g.items() if v is None)
            assert not missing, f"{name} rank {rank} {runtime}: no gradient for {missing}"
        for key, ours in grads["ours"].items():
            _close(ours, grads["torch"][key], BITWISE, f"{name} rank {rank} {key} gradient, ours vs torch")
            _close(
                ours, grads["one process"][key], ONE_PROCESS, f"{name} rank {rank} {key} gradient, ours vs one process"
            )
        if not got["last"]:
            continue
        lasts += 1
        losses, outputs, ref = got["losses"], got["outputs"], got["one process"]
        assert len(losses["ours"]) == len(losses["torch"]) == MICROBATCHES, name
        ours_losses = torch.stack(losses["ours"])
        _close(ours_losses, torch.stack(losses["torch"]), BITWISE, f"{name} microbatch losses, ours vs torch")
        _close(ours_losses.sum(), ref["loss"], ONE_PROCESS, f"{name} loss, ours (summed) vs one process")
        _close(outputs["ours"], outputs["torch"], BITWISE, f"{name} last stage's outputs, ours vs torch")
        _close(outputs["ours"], ref["output"], ONE_PROCESS, f"{name} last stage's outputs, ours vs one process")
    assert lasts == 1, f"{name}: {lasts} ranks hold the last stage (stages per rank {per_rank})"
