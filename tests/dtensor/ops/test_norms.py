"""Softmax and normalization rules (ops/norms.py) against the single-device run.

Forward+backward through `F.softmax`, `F.log_softmax`, `F.layer_norm` under (sampled) placements of
every input, direct calls of the backward ops with Partial grads, and the RMSNorm flavours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import as_partial, check_op, get_mesh, get_torch_mesh, run_on_meshes
from tests.world import run_world


def softmax_last(x):
    return F.softmax(x, dim=-1)


def softmax_first(x):
    return F.softmax(x, dim=0)


def log_softmax_mid(x):
    return F.log_softmax(x, dim=1)


def log_softmax_last(x):
    return F.log_softmax(x, dim=-1)


def layer_norm_last(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def layer_norm_two(x, w, b):
    return F.layer_norm(x, tuple(x.shape[-2:]), w, b, eps=1e-3)


def layer_norm_plain(x):
    return F.layer_norm(x, (x.shape[-1],))


# even and uneven (3 and 5 on 4 ranks leave short and empty shards)
SHAPES = ((4, 6, 8), (3, 5, 7))


def _check_softmax_and_layer_norm(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    combos = 0
    for shape in SHAPES:
        x = torch.randn(shape)
        for fn in (softmax_last, softmax_first, log_softmax_mid, layer_norm_plain):
            combos += check_op(fn, [x], mesh, max_combos=8)
        w, b = torch.randn(shape[-1]), torch.randn(shape[-1])
        combos += check_op(layer_norm_last, [x, w, b], mesh, max_combos=12)
        w2, b2 = torch.randn(shape[-2:]), torch.randn(shape[-2:])
        combos += check_op(layer_norm_two, [x, w2, b2], mesh, max_combos=8, atol=1e-4, rtol=1e-4)
    xb = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    combos += check_op(log_softmax_last, [xb], mesh, max_combos=8, atol=1e-2, rtol=1e-2)
    return combos


def test_softmax_and_layer_norm_match_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_softmax_and_layer_norm))


# --------------------------------------------------------------------------------------------------
# backward ops called directly: Partial grads, output_mask, the fused rms_norm backward
# --------------------------------------------------------------------------------------------------


def softmax_backward(g, y):
    return aten._softmax_backward_data(g, y, -1, torch.float32)


def log_softmax_backward(g, y):
    return aten._log_softmax_backward_data(g, y, 1, torch.float32)


def layer_norm_backward(g, x, mean, rstd, w, b):
    return aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])


def layer_norm_backward_input_only(g, x, mean, rstd, w, b):
    return aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b, [True, False, False])


HAS_FUSED_RMS_NORM_CPU = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", "CPU")


def rms_norm_backward(g, x, rstd, w):
    return aten._fused_rms_norm_backward(g, x, [x.shape[-1]], rstd, w, [True, True])


def _check_backward_ops(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    # check_op enumerates every combo before sampling: on a 2-D mesh keep the saved statistics and
    # parameters replicated so the product stays small (1-D meshes shard them all)
    stats = len(mesh_shape) == 1
    combos = 0
    for shape in SHAPES:
        x, g = torch.randn(shape), torch.randn(shape)
        w, b = torch.randn(shape[-1]), torch.randn(shape[-1])
        y = torch.softmax(x, -1)
        combos += check_op(softmax_backward, [g, y], mesh, grad=False, partial=True, max_combos=24)
        combos += check_op(
            log_softmax_backward, [g, torch.log_softmax(x, 1)], mesh, grad=False, partial=True, max_combos=24
        )
        _, mean, rstd = aten.native_layer_norm(x, [shape[-1]], w, b, 1e-5)
        for fn in (layer_norm_backward, layer_norm_backward_input_only):
            combos += _check_norm_backward(fn, [g, x, mean, rstd, w, b], mesh, [True, True] + [stats] * 4)
        if not HAS_FUSED_RMS_NORM_CPU:  # torch 2.13 has the fused kernel on CUDA only
            continue
        rstd_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        combos += _check_norm_backward(rms_norm_backward, [g, x, rstd_rms, w], mesh, [True, True, stats, stats])
    return combos


def _check_norm_backward(fn, inputs: list[torch.Tensor], mesh, shardable: list[bool]) -> int:
    """check_op for a norm backward op: no gradients of its own, Partial grads allowed, fp32 sums at 1e-4."""
    return check_op(
        fn, inputs, mesh, grad=False, partial=True, max_combos=16, atol=1e-4, rtol=1e-4, shardable=shardable
    )


def test_norm_backward_ops_match_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_backward_ops))


def _partial_grad_layouts():
    """A P(sum) grad with Replicate saved tensors stays P(sum) without communication."""
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x, g, w, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)
    _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    rep = [distribute_tensor(t, mesh, (Replicate(),)) for t in (x, mean, rstd, w, b)]
    dg = as_partial(distribute_tensor(g, mesh, (Replicate(),)), (Partial(),))
    with CommDebugMode() as comm:
        outs = aten.native_layer_norm_backward(dg, rep[0], [8], rep[1], rep[2], rep[3], rep[4], [True] * 3)
        y = aten._softmax_backward_data(dg, torch.softmax(rep[0], -1), -1, torch.float32)
    return [o.placements for o in outs] + [y.placements], comm.get_total_counts()


def test_backward_keeps_partial_grad_without_communication():
    placements, comms = run_world(_partial_grad_layouts, 2)[0]
    assert placements == [(Partial(),)] * 4 and comms == 0


def _row_sharded_layouts():
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 6, 8), mesh, (Shard(1),)).requires_grad_()
    w = distribute_tensor(torch.randn(8), mesh, (Replicate(),)).requires_grad_()
    b = distribute_tensor(torch.randn(8), mesh, (Replicate(),)).requires_grad_()
    with CommDebugMode() as comm:
        y = F.layer_norm(x, (8,), w, b)
        s = F.softmax(x, dim=-1)
        y.backward(torch.ones_like(y))
    return y.placements, s.placements, x.grad.placements, w.grad.placements, comm.get_total_counts()


def test_sequence_sharded_layer_norm_needs_no_communication():
    y, s, gx, gw, comms = run_world(_row_sharded_layouts, 2)[0]
    assert (y, s, gx, gw, comms) == ((Shard(1),), (Shard(1),), (Shard(1),), (Partial(),), 0)


def _compare_with_torch():
    """Row-sharded softmax / layer_norm: same placements as torch's DTensor, no more collectives.

    (torch 2.13's DTensor refuses a softmax over a sharded dim; ours gathers that dim.)
    """
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    results = []
    for dx in (distribute_tensor(x, get_mesh((2,)), (Shard(1),)), torch_distribute(x, get_torch_mesh((2,)), [TS(1)])):
        with CommDebugMode() as comm:
            y = F.softmax(dx, dim=-1)
            z = F.layer_norm(dx, (8,))
        torch.testing.assert_close(y.full_tensor(), F.softmax(x, dim=-1))
        torch.testing.assert_close(z.full_tensor(), F.layer_norm(x, (8,)))
        results.append((str(y.placements[0]), str(z.placements[0]), comm.get_total_counts()))
    return results


def test_norms_match_torch_layouts_and_communication():
    ours, theirs = run_world(_compare_with_torch, 2)[0]
    assert ours[:2] == theirs[:2] and ours[2] <= theirs[2]


# --------------------------------------------------------------------------------------------------
# RMSNorm: F.rms_norm / nn.RMSNorm decompose into pointwise + mean on CPU; the Llama hand-written one
# --------------------------------------------------------------------------------------------------


def rms_norm_functional(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def rms_norm_llama(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _check_rms_norms(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    combos = 0
    for shape in SHAPES:
        x, w = torch.randn(shape), torch.randn(shape[-1])
        for fn in (rms_norm_functional, rms_norm_llama):
            combos += check_op(fn, [x, w], mesh, max_combos=24, atol=1e-4, rtol=1e-4)
    return combos


def test_rms_norm_matches_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_rms_norms))
