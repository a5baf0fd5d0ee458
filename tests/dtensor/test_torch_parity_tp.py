"""Tensor-parallel behaviour torch's own test_tp_examples.py checks, run on torch's DTensor and ours.

Found with bench/torch_public_tests.py: inside loss_parallel() the logits must be sharded on their
class dim (torch raises a ValueError naming loss_parallel otherwise, rather than gathering them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

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
