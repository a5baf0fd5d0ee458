"""Gradient accumulation and the loss normalization: one step is the same whatever the split.

A global batch of 8 sequences with unevenly ignored targets (so a mean of micro-batch means would
differ) runs as one batch on one process, as 4 accumulated micro-batches of 2 on one process, and
as FSDP(2) with 2 micro-batches of 2 per rank; the loss and the weights after the AdamW step agree.
The trainer's loader gives every split the same sequences; the non-finite guard names the step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.llama3 import Transformer, llama3_configs
from models.llama3.parallelize import parallelize_llama
from parallelisms.dtensor import DTensor
from parallelisms.parallel_dims import ParallelDims
from tests.world import run_world
from trainer.build import init_model
from trainer.data import TokenBatches, accumulation_steps
from trainer.step import NonfiniteWatch, global_target_count, reduce_loss, train_step
from trainer.token_loss import IGNORE_INDEX

ARGS = dataclasses.replace(llama3_configs["debugmodel"], dim=32, n_layers=2, n_heads=4, vocab_size=37, max_seq_len=8)
GLOBAL, SEQ = 8, 8


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, ARGS.vocab_size, (GLOBAL, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (GLOBAL, SEQ), generator=g)
    labels[0, :7] = IGNORE_INDEX  # uneven: micro-batch 0 keeps 9 targets, the others 16
    labels[5, 2:] = IGNORE_INDEX
    return inputs, labels


def _step(micro: int, lr: float = 1.0) -> dict[str, object]:
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize_llama(model, dims, mesh, loss_parallel=False)
    init_model(model, torch.device("cpu"))
    # SGD: the update is linear in the gradient, so the weights compare the gradients themselves
    # (AdamW's g / sqrt(g^2) amplifies last-bit differences of tiny gradients from the summation order)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    inputs, labels = _global_batch()
    per_rank = GLOBAL // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    batches = [(inputs[mine][i : i + micro], labels[mine][i : i + micro]) for i in range(0, per_rank, micro)]
    dp_cp_mesh = mesh["dp_cp"] if dims.dp_cp_enabled else None
    targets = global_target_count([lab for _, lab in batches], dp_cp_mesh)
    result = train_step(
        model, opt, batches, targets=targets, grad_average_size=world, max_norm=1.0, use_loss_parallel=False,
        skip_nonfinite=False,
    )  # fmt: skip
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    return {"loss": reduce_loss(result.loss, dp_cp_mesh), "norm": float(result.grad_norm), "params": params}


def _reference_loss() -> float:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    init_model(model, torch.device("cpu"))
    inputs, labels = _global_batch()
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1)).item()


def test_one_step_is_the_same_for_every_accumulation_and_dp_split() -> None:
    whole = run_world(_step, 1, GLOBAL)[0]
    assert whole["loss"] == pytest.approx(_reference_loss(), rel=1e-6)  # the global token mean
    for world, micro in ((1, 2), (2, 2), (2, 4)):
        for r in run_world(_step, world, micro):
            assert r["loss"] == pytest.approx(whole["loss"], rel=1e-5), (world, micro)
            assert r["norm"] == pytest.approx(whole["norm"], rel=1e-5), (world, micro)
            for name, p in r["params"].items():
                torch.testing.assert_close(p, whole["params"][name], rtol=1e-5, atol=1e-6)


def test_nonfinite_step_stops_naming_the_step_without_a_sync_per_step() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    init_model(model, torch.device("cpu"))
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, labels = _global_batch()
    batch = [(inputs, labels)]
    targets = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    kwargs = dict(targets=targets, grad_average_size=1, max_norm=1.0, use_loss_parallel=False)
    watch = NonfiniteWatch(torch.device("cpu"))
    watch.check()  # nothing noted: fine
    watch.note(6, torch.tensor(1.5))
    result = train_step(model, opt, batch, skip_nonfinite=False, **kwargs)  # type: ignore[arg-type]
    assert not result.skipped and not torch.isfinite(result.grad_norm)  # decided later, on the device
    watch.note(7, result.grad_norm)
    watch.note(8, result.grad_norm)
    with pytest.raises(FloatingPointError, match="step 7: the gradient norm is not finite.*skip_nonfinite_steps"):
        watch.check()  # names the first bad step
    model.load_state_dict(Transformer(ARGS).state_dict())  # finite weights again, but for the output
    with torch.no_grad():
        model.output.weight.fill_(float("nan"))
    before = model.tok_embeddings.weight.detach().clone()
    result = train_step(model, opt, batch, skip_nonfinite=True, **kwargs)  # type: ignore[arg-type]
    assert result.skipped and torch.equal(model.tok_embeddings.weight, before)


def test_loader_gives_every_split_the_same_global_batch() -> None:
    tokens = torch.arange(10_000)
    whole = TokenBatches(tokens, local_batch_size=8, seq_len=15, dp_rank=0, dp_size=1, seed=1)
    it = iter(whole)
    steps = [next(it)[0] for _ in range(3)]  # (8, 15) per step
    for dp, local in ((1, 2), (2, 2), (4, 1), (2, 4)):
        got = [[] for _ in range(3)]
        for rank in range(dp):
            loader = TokenBatches(
                tokens, local_batch_size=local, seq_len=15, dp_rank=rank, dp_size=dp, seed=1, global_batch_size=8
            )
            it = iter(loader)
            for s in range(3):
                got[s].extend(next(it)[0] for _ in range(loader.accumulation_steps))
        for s in range(3):
            assert torch.equal(torch.cat(got[s]), steps[s]), (dp, local, s)


def test_global_batch_remainder_shows_the_arithmetic() -> None:
    with pytest.raises(
        ValueError, match=r"global_batch_size\(10\) must be a positive multiple of .* = 4; 10 / 4 = 2.5"
    ):
        accumulation_steps(10, 2, 2)


def test_autocast_step_computes_in_bfloat16_and_keeps_float32_weights() -> None:
    """Mixed precision without FSDP (one GPU): the forward under torch.autocast, here on the CPU."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ARGS)
    init_model(model, torch.device("cpu"))
    seen: list[torch.dtype] = []
    model.output.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    inputs, labels = _global_batch()
    targets = torch.tensor(float((labels != IGNORE_INDEX).sum()))
    kwargs = dict(targets=targets, grad_average_size=1, max_norm=1.0, use_loss_parallel=False, skip_nonfinite=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    fp32 = train_step(model, opt, [(inputs, labels)], **kwargs)  # type: ignore[arg-type]
    bf16 = train_step(model, opt, [(inputs, labels)], autocast=torch.bfloat16, **kwargs)  # type: ignore[arg-type]
    assert seen == [torch.float32, torch.bfloat16]
    assert float(bf16.loss) == pytest.approx(float(fp32.loss), rel=2e-2) and float(bf16.loss) != float(fp32.loss)
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters())  # fmt: skip
