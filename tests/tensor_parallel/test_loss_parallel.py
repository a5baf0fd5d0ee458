"""loss_parallel: cross-entropy on vocabulary-sharded logits with plain targets, as torch's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.world import run_world


def _run(tp: int) -> dict:
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    from parallelisms.dtensor import Shard, distribute_tensor
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.tensor_parallel import loss_parallel
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 37, generator=g)  # (B, T, vocab); 37 classes split unevenly
    labels = torch.randint(0, 37, (2, 5), generator=g)
    labels[0, 1] = -100  # an ignored position
    ref = logits.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref_loss.backward()

    counts = {}
    for name, make, ctx in (
        ("ours", lambda: distribute_tensor(logits, get_mesh((tp,)), [Shard(2)]), loss_parallel),
        ("torch", lambda: torch_distribute(logits, get_torch_mesh((tp,)), [TShard(2)]), torch_loss_parallel),
    ):
        x = make().requires_grad_()
        with CommDebugMode() as comm, ctx():
            loss = F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=-100)
            loss.backward()
        counts[name] = comm.get_total_counts()
        torch.testing.assert_close(loss.full_tensor(), ref_loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, atol=1e-6, rtol=1e-6)
        assert x.grad.placements == x.placements, (name, x.grad.placements)
    return counts


def test_loss_parallel_matches_single_device_without_gathering_logits():
    for tp in (2, 4):
        counts = run_world(_run, tp, tp)[0]
        assert counts["ours"] <= counts["torch"], counts
