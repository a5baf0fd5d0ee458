"""nll_loss rules (ops/nll_loss.py): cross_entropy and nll_loss against the single-device run.

`F.cross_entropy` decomposes into _log_softmax + nll_loss_forward, so these checks also drive the
softmax rules. Targets include ignored rows (ignore_index), so a mean over sharded rows is only
right if it divides by the global number of kept rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import check_op, get_mesh, get_torch_mesh, run_on_meshes
from tests.world import run_world


def ce_mean(x, t):
    return F.cross_entropy(x, t)


def ce_sum(x, t):
    return F.cross_entropy(x, t, reduction="sum")


def ce_none(x, t):
    return F.cross_entropy(x, t, reduction="none")


def ce_weighted_ignore_class(x, t, w):
    return F.cross_entropy(x, t, weight=w.detach(), ignore_index=1)  # 1 is also a real class id


def ce_label_smoothing(x, t):  # adds a mean over the classes of -log_softmax (reductions.py)
    return F.cross_entropy(x, t, label_smoothing=0.1)


def ce_sequence(x, t):  # (N, C, T) logits: viewed to (N, C, 1, T) for nll_loss2d (views.py)
    return F.cross_entropy(x, t)


def nll_ops_mean(logp, t):
    return aten.nll_loss_forward(logp, t, None, 1, -100)  # (loss, total_weight)


def nll_ops_sum(logp, t):
    return aten.nll_loss_forward(logp, t, None, 2, -100)


def nll_2d_mean(logp, t):
    return F.nll_loss(logp, t, ignore_index=0)


def nll_2d_none(logp, t):
    return F.nll_loss(logp, t, reduction="none")


def _targets(n: int, classes: int) -> torch.Tensor:
    t = torch.randint(0, classes, (n,))
    t[::3] = -100  # ignored rows, unevenly spread over the shards
    return t


def _check_cross_entropy(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    combos = 0
    for n, classes in ((8, 6), (5, 7), (3, 4)):  # even, uneven, empty shards on 4 ranks
        x, t = torch.randn(n, classes), _targets(n, classes)
        for fn in (ce_mean, ce_sum, ce_none):
            combos += check_op(fn, [x, t], mesh, max_combos=8)
        logp = torch.log_softmax(x, -1)
        for fn in (nll_ops_mean, nll_ops_sum):  # class-sharded log-probs: vocabulary-parallel nll
            combos += check_op(fn, [logp, t], mesh, max_combos=8)
        w = torch.rand(classes) + 0.5
        combos += check_op(ce_weighted_ignore_class, [x, t.clamp(min=0), w], mesh, max_combos=8)
    x, t = torch.randn(5, 6), _targets(5, 6)
    combos += check_op(ce_label_smoothing, [x, t], mesh, max_combos=8)
    x3, t3 = torch.randn(3, 4, 5), torch.randint(0, 4, (3, 5))
    combos += check_op(ce_sequence, [x3, t3], mesh, max_combos=8)
    x1, t1 = torch.randn(5), torch.tensor(3)  # unbatched: (C,) with a 0-d target
    combos += check_op(ce_mean, [x1, t1], mesh)
    logp4, t4 = torch.randn(3, 5, 2, 3).log_softmax(1), torch.randint(0, 5, (3, 2, 3))
    for fn in (nll_2d_mean, nll_2d_none):
        combos += check_op(fn, [logp4, t4], mesh, max_combos=12)
    return combos


def test_cross_entropy_matches_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_cross_entropy))


def _batch_sharded_mean():
    """DP loss: S(0) logits/targets, mean. One scalar all_reduce (the global kept count), grads S(0)."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x, t = torch.randn(6, 5), _targets(6, 5)
    dx = distribute_tensor(x, mesh, (Shard(0),)).requires_grad_()
    dt = distribute_tensor(t, mesh, (Shard(0),))
    with CommDebugMode() as comm:
        loss = F.cross_entropy(dx, dt)
    counts = comm.get_comm_counts()
    loss.backward()
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, t))
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad)
    return loss.placements, dx.grad.placements, {str(k): v for k, v in counts.items()}


def test_batch_sharded_mean_divides_by_global_count():
    loss, grad, counts = run_world(_batch_sharded_mean, 2)[0]
    assert loss == (Partial(),) and grad == (Shard(0),)
    assert counts == {"c10d_functional.all_reduce": 1}, counts


def _compare_with_torch(reduction: str):
    """Batch-sharded sum / none: torch's DTensor placements, and no more collectives."""
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    torch.manual_seed(0)
    x, t = torch.randn(8, 5), torch.randint(0, 5, (8,))
    results = []
    for mesh, dist_fn, s0 in (
        (get_mesh((2,)), distribute_tensor, Shard(0)),
        (get_torch_mesh((2,)), torch_distribute, TS(0)),
    ):
        dx, dt = dist_fn(x, mesh, [s0]), dist_fn(t, mesh, [s0])
        with CommDebugMode() as comm:
            loss = F.cross_entropy(dx, dt, reduction=reduction)
        torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, t, reduction=reduction))
        results.append((str(loss.placements[0]), comm.get_total_counts()))
    return results


def test_batch_sharded_loss_matches_torch_layouts():
    for reduction in ("sum", "none"):
        ours, theirs = run_world(_compare_with_torch, 2, reduction)[0]
        assert ours[0] == theirs[0] and ours[1] <= theirs[1], (reduction, ours, theirs)


def _vocab_parallel_nll():
    """Class-sharded log-probs with replicated targets: no communication, P(sum) loss, S(1) grad."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    logp, t = torch.randn(4, 6).log_softmax(-1), torch.tensor([0, 5, -100, 3])
    dlogp = distribute_tensor(logp, mesh, (Shard(1),)).requires_grad_()
    dt = distribute_tensor(t, mesh, (Replicate(),))
    with CommDebugMode() as comm:
        loss = F.nll_loss(dlogp, dt)
        loss.backward(torch.ones_like(loss))
    return loss.placements, dlogp.grad.placements, comm.get_total_counts()


def test_vocab_parallel_nll_needs_no_communication():
    loss, grad, comms = run_world(_vocab_parallel_nll, 2)[0]
    assert (loss, grad, comms) == ((Partial(),), (Shard(1),), 0)


def _vocab_parallel_cross_entropy(mesh_shape, placements):
    """loss_parallel: class-sharded logits never gather; 2 row-stat all_reduces forward, none in
    backward (the nll backward knows every row's gradient sum: one value, at the target)."""
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    x, t = torch.randn(6, 10), _targets(6, 10)
    dx = distribute_tensor(x, mesh, placements).requires_grad_()
    dt = distribute_tensor(t, mesh, (Replicate(),) * len(mesh_shape))
    with CommDebugMode() as forward:
        loss = F.cross_entropy(dx, dt)
    with CommDebugMode() as backward:
        (grad,) = torch.autograd.grad(loss, dx)
    ref = x.clone().requires_grad_()
    F.cross_entropy(ref, t).backward()
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(x, t))
    torch.testing.assert_close(grad.full_tensor(), ref.grad)
    counts = [{str(k): v for k, v in c.get_comm_counts().items()} for c in (forward, backward)]
    return loss.placements, grad.placements, counts


def test_vocab_parallel_cross_entropy_gathers_no_logits():
    loss, grad, (forward, backward) = run_world(_vocab_parallel_cross_entropy, 2, (2,), (Shard(1),))[0]
    assert (loss, grad) == ((Partial(),), (Shard(1),))
    assert forward == {"c10d_functional.all_reduce": 2} and backward == {}
    # nested over a 2-D mesh (classes split 4 ways): one all_reduce per mesh dim
    loss, grad, (forward, backward) = run_world(_vocab_parallel_cross_entropy, 4, (2, 2), (Shard(1), Shard(1)))[0]
    assert grad == (Shard(1), Shard(1)) and forward == {"c10d_functional.all_reduce": 4} and backward == {}
