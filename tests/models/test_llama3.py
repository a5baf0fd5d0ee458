"""Llama 3 on one device, and parallelized (TP+SP, FSDP, activation checkpointing) against it.

A debugmodel-shaped but tiny config: vocab 97 does not divide by 2 or 4, so the vocab-sharded
embedding and output (and FSDP's dim-0 shards) are uneven.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from models.llama3 import Transformer, TransformerModelArgs, llama3_configs
from models.llama3.parallelize import parallelize_llama
from parallelisms.activation_checkpoint import ACMode, apply_ac
from parallelisms.parallel_dims import ParallelDims
from tests.world import run_world

ARGS = TransformerModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=16, rope_theta=500000
)
SEQ, BATCH = 16, 2  # BATCH per rank for FSDP
GRAD_TOL: dict = dict(atol=1e-5, rtol=1e-4)
PARAM_TOL: dict = dict(atol=1e-4, rtol=1e-4)  # AdamW divides by sqrt(v): fp32 reduction-order noise grows


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS)


def _batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, ARGS.vocab_size, (batch, SEQ), generator=g)
    labels = torch.randint(0, ARGS.vocab_size, (batch, SEQ), generator=g)
    return tokens, labels


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))  # (B*T, V) vs (B*T,)


def _full(t: torch.Tensor) -> torch.Tensor:
    from parallelisms.dtensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, loss_parallel: bool = False):
    """One forward/backward/AdamW step: (logits, loss, {name: grad}) with every tensor made full."""
    from parallelisms.tensor_parallel import loss_parallel as loss_parallel_ctx

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    logits = model(tokens)
    if loss_parallel:
        with loss_parallel_ctx():
            loss = _loss(logits, labels)
            loss.backward()
    else:
        loss = _loss(logits, labels)
        loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return _full(logits).detach(), _full(loss).detach(), grads


def _prefix(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def _assert_params_match(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), want[name].detach(), **PARAM_TOL, msg=_prefix(name))


def _assert_grads_match(grads: dict, ref_grads: dict) -> None:
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **GRAD_TOL, msg=_prefix(f"grad {name}"))


# ------------------------------------------------------------------------------- single device
def test_configs_have_torchtitan_shapes():
    debug = llama3_configs["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.vocab_size, debug.rope_theta) == (256, 6, 16, 2048, 500000)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(llama3_configs["8B"]).parameters())
    assert n_params == 8_030_261_248  # Llama 3 8B
    assert set(llama3_configs) == {"debugmodel", "debugmodel_flex_attn", "1B", "8B", "70B", "405B"}
    flex = llama3_configs["debugmodel_flex_attn"]  # torchtitan's: the debug model, block-causal through flex
    assert dataclasses.replace(flex, use_flex_attn=False, attn_mask_type="causal") == debug
    assert (flex.use_flex_attn, flex.attn_mask_type) == (True, "block_causal")


def test_forward_shape_and_fqns():
    model = _model()
    tokens, _ = _batch(3)
    assert model(tokens).shape == (3, SEQ, ARGS.vocab_size)
    names = set(dict(model.named_parameters()))
    assert {
        "tok_embeddings.weight",
        "layers.1.attention.wq.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.attention_norm.weight",
        "norm.weight",
        "output.weight",
    } <= names
    assert "freqs_cis" not in model.state_dict()


def test_loss_decreases_over_three_adamw_steps():
    model = _model()
    tokens, labels = _batch(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = _loss(model(tokens), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_matches_no_checkpointing(mode):
    tokens, labels = _batch(2)
    ref = _model()
    model = apply_ac(copy.deepcopy(ref), mode)
    _, ref_loss, ref_grads = _step(ref, tokens, labels)
    _, loss, grads = _step(model, tokens, labels)
    torch.testing.assert_close(loss, ref_loss)
    _assert_grads_match(grads, ref_grads)


def _backward_op_counts(mode: str) -> dict[str, int]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    model = apply_ac(_model(), mode)  # type: ignore[arg-type]
    tokens, labels = _batch(2)
    loss = _loss(model(tokens), labels)
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_selective_ac_recomputes_pointwise_and_every_other_matmul_but_not_attention():
    """torchtitan's op policy: of a block's 7 matmuls (wq wk wv wo w1 w3 w2) the 2nd, 4th and 6th are
    recomputed (wk, wo, w3); attention is saved; pointwise ops are recomputed."""
    none, full, selective = (_backward_op_counts(mode) for mode in ("none", "full", "selective"))
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    assert full["mm"] > none["mm"] and full.get(sdpa, 0) == ARGS.n_layers  # full recomputes everything
    assert selective["mm"] == none["mm"] + 3 * ARGS.n_layers and sdpa not in selective
    assert selective["silu"] == full["silu"] == ARGS.n_layers and "silu" not in none  # recomputed


def test_ac_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'op' is not one of"):
        apply_ac(_model(), "op")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- multi-rank
def _run_tp(loss_parallel: bool, ac_mode: ACMode) -> None:
    import torch.distributed as dist

    from parallelisms.dtensor import DTensor, Shard
    from tests.dtensor.harness import get_mesh

    tp = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp, pp=1, world_size=tp)
    tokens, labels = _batch(2)
    ref = _model()
    model = parallelize_llama(
        copy.deepcopy(ref), dims, get_mesh((tp,), ("tp",)), loss_parallel=loss_parallel, ac_mode=ac_mode
    )
    wq = model.get_submodule("layers.0.attention.wq").weight
    assert isinstance(wq, DTensor) and wq.placements == (Shard(0),) and wq.to_local().shape[0] == ARGS.dim // tp
    ref_logits, ref_loss, ref_grads = _step(ref, tokens, labels)
    logits, loss, grads = _step(model, tokens, labels, loss_parallel=loss_parallel)
    assert isinstance(model(tokens), DTensor) == loss_parallel  # vocab-sharded logits only with loss_parallel
    torch.testing.assert_close(logits, ref_logits, **GRAD_TOL)
    torch.testing.assert_close(loss, ref_loss, **GRAD_TOL)
    _assert_grads_match(grads, ref_grads)
    _assert_params_match(model, ref)


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_tp2_matches_single_device(loss_parallel):
    run_world(_run_tp, 2, loss_parallel, "none")


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_tp2_activation_checkpointing_matches_single_device(ac_mode):
    run_world(_run_tp, 2, True, ac_mode)


def _run_fsdp() -> None:
    import torch.distributed as dist

    from parallelisms.fsdp import FSDPModule

    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=world)
    world_mesh = dims.build_mesh("cpu")
    tokens, labels = _batch(BATCH * world)  # the global batch; each rank trains on its slice
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    ref = _model()
    model = parallelize_llama(copy.deepcopy(ref), dims, world_mesh, loss_parallel=False)
    assert all(isinstance(m, FSDPModule) for m in (model, model.tok_embeddings, model.norm, model.output))
    assert all(isinstance(block, FSDPModule) for block in model.get_submodule("layers").children())
    ref_logits, _, ref_grads = _step(ref, tokens, labels)
    logits, loss, grads = _step(model, tokens[local], labels[local])
    torch.testing.assert_close(logits, ref_logits[local], **GRAD_TOL)
    torch.testing.assert_close(loss, _loss(ref_logits[local], labels[local]), **GRAD_TOL)
    _assert_grads_match(grads, ref_grads)  # FSDP averages gradients over dp_shard: the global-batch mean
    _assert_params_match(model, ref)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_matches_single_device_on_concatenated_batch(world):
    run_world(_run_fsdp, world)
