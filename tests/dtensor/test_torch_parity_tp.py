"""Tensor-parallel behaviour torch's own test_tp_examples.py checks, run on torch's DTensor and ours.

Found with bench/torch_public_tests.py: inside loss_parallel() the logits must be sharded on their
class dim (torch raises a ValueError naming loss_parallel otherwise, rather than gathering them), and
the loss is Replicate over the class-sharding mesh dim after three forward all_reduces, with no
collective in backward, class weights and ignored targets included.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.test_torch_parity import _mesh, both
from tests.world import run_world


def loss_parallel_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    torch.manual_seed(0)
    x = torch.randn(8, 6, 5)  # (batch, class, extra): the class dim is 1
    target = torch.randint(6, (8, 5))
    out = {}
    for placement in (dt.Shard(0), dt.Shard(1), dt.Shard(2), dt.Replicate()):
        d = dt.distribute_tensor(x, mesh, [placement])
        with tp.loss_parallel():
            try:
                loss = F.cross_entropy(d, target)
                out[str(placement.is_shard(1))] = ("ok", loss.full_tensor())
            except ValueError as e:
                out.setdefault("errors", []).append("loss_parallel" in str(e))
        with tp.loss_parallel():
            try:
                F.log_softmax(d, dim=1)
                out.setdefault("log_softmax", []).append("ok")
            except ValueError:
                out.setdefault("log_softmax", []).append("raised")
    return out


def test_loss_parallel_refuses_logits_not_sharded_on_the_class_dim_as_torch() -> None:
    for result in run_world(both, 2, loss_parallel_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["errors"] == theirs["errors"] == [True, True, True]
        assert ours["log_softmax"] == theirs["log_softmax"] == ["raised", "ok", "raised", "raised"]
        torch.testing.assert_close(ours["True"][1], theirs["True"][1])


def loss_parallel_comm_program(name: str, dt, tp) -> dict[str, Any]:
    """torch's test_loss_parallel, with ignored targets: per case the loss's placements, the forward
    and backward collective counts, and the loss and logits' grad against one device. Class weights
    with ignored targets run on ours only (torch's backward fails on them)."""
    mesh = _mesh(name)
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    weight = torch.rand(16)
    for shape in ((8, 16), (8, 16, 3)):
        x = torch.randn(*shape, requires_grad=True)
        target = torch.randint(16, (shape[0], *shape[2:]))
        ignored = target.clone()
        ignored[1] = -100
        cases = itertools.product(("none", "mean", "sum"), (weight, None), (target, ignored))
        for reduction, w, target in cases:
            if name == "torch" and w is not None and target is ignored:
                continue  # torch 2.13's loss_parallel backward indexes the weight with ignored targets
            y = F.cross_entropy(x, target, w, reduction=reduction)
            y.sum().backward()
            d = dt.distribute_tensor(x.detach(), mesh, [dt.Shard(1)]).requires_grad_()
            forward, backward = (CommDebugMode(), CommDebugMode()) if name == "ours" else (
                TorchCommDebugMode(), TorchCommDebugMode())  # fmt: skip
            with tp.loss_parallel():
                with forward:
                    dy = F.cross_entropy(d, target, w, reduction=reduction)
                with backward:
                    dy.sum().backward()
            key = f"{shape} {reduction} {'weight' if w is not None else ''} {'ignored' if target is ignored else ''}"
            out[key] = {
                "placements": [str(p) for p in dy.placements],
                "forward": forward.get_total_counts(),
                "backward": backward.get_total_counts(),
                "loss": torch.allclose(dy.full_tensor(), y, atol=1e-6),
                "grad": torch.allclose(d.grad.full_tensor(), x.grad, atol=1e-6),
                "grad placements": [str(p) for p in d.grad.placements],
            }
            x.grad = None
    return out


def test_loss_parallel_loss_is_replicate_and_its_backward_silent_as_torch() -> None:
    for result in run_world(both, 2, loss_parallel_comm_program):
        ours, theirs = result["ours"], result["torch"]
        assert {k: v for k, v in ours.items() if k in theirs} == theirs and len(ours) == len(theirs) + 6
        assert all(case["loss"] and case["grad"] for case in ours.values())
        assert all(case["forward"] == 3 and case["backward"] == 0 for case in ours.values())
