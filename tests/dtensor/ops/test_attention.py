"""Attention rules (ops/attention.py): F.scaled_dot_product_attention against the single-device run.

On CPU, sdpa without a float mask runs `_scaled_dot_product_flash_attention_for_cpu` (+ backward).
q, k, v get the same placements (the layouts attention is sharded with in practice), and also
independent sampled placements (which mostly gather), on even and uneven shapes (3 heads on 4 ranks
leave an empty shard), causal or not, and with GQA.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch.ops import aten

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import check_op, get_mesh, get_torch_mesh, make_spec, placement_choices, run_on_meshes
from tests.world import run_world


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def sdpa_gqa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def flash_cpu_masked(q, k, v, mask):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask.detach())


def sdpa_float_mask(q, k, v, mask):  # CPU: the math path (bmm, _safe_softmax, ...: other families)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach())


def sdpa_bool_mask(q, k, v, mask):  # CPU: where(mask, 0, -inf) then the flash kernel with a float mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check_same_placements(fn, q, k, v, mesh, atol=1e-5, max_combos=12) -> int:
    """q, k, v share a placement tuple (R / S(d) per mesh dim; up to `max_combos` of them, sampled
    alike on every rank); outputs and grads vs one device."""
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = fn(*ref)
    weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(0))
    ref_grads = torch.autograd.grad((ref_out * weight).sum(), ref)
    choices = placement_choices(4, mesh.ndim)
    if len(choices) > max_combos:
        choices = random.Random(fn.__name__).sample(choices, max_combos)
    for placements in choices:
        dq, dk, dv = (distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v))
        what = f"{fn.__name__} q/k/v {[str(p) for p in placements]} on mesh {mesh.shape}"
        out = fn(dq, dk, dv).full_tensor()
        grads = torch.autograd.grad((out * weight).sum(), (dq, dk, dv))
        for got, want in zip((out, *grads), (ref_out.detach(), *ref_grads)):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, want, atol=atol, rtol=atol, msg=lambda m, what=what: f"{what}: {m}")
    return len(choices)


# (B, H, Hkv, Tq, Tk, D): even; uneven with empty shards on 4 ranks; GQA (H 4, Hkv 2); cross-attention
SHAPES = ((2, 4, 4, 6, 6, 8), (3, 3, 3, 5, 5, 4), (2, 4, 2, 5, 5, 8), (3, 2, 2, 3, 7, 4))


def _check_sdpa(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    combos = 0
    for b, h, hkv, tq, tk, d in SHAPES:
        q, k, v = torch.randn(b, h, tq, d), torch.randn(b, hkv, tk, d), torch.randn(b, hkv, tk, d)
        fns = (sdpa_gqa, sdpa_gqa_causal) if h != hkv else (sdpa, sdpa_causal)
        for fn in fns:
            combos += check_same_placements(fn, q, k, v, mesh)
            combos += check_op(fn, [q, k, v], mesh, max_combos=6)
    q, k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    mask = torch.randn(3, 1, 5, 5)  # broadcast over heads
    combos += check_op(flash_cpu_masked, [q, k, v, mask], mesh, max_combos=12)
    combos += check_op(sdpa_float_mask, [q, k, v, mask], mesh, max_combos=8)
    keep = torch.rand(5, 5) > 0.3
    keep[:, 0] = True  # no fully masked row (its softmax is NaN)
    combos += check_op(sdpa_bool_mask, [q, k, v, keep], mesh, max_combos=8)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    combos += check_same_placements(sdpa_causal, qb, kb, vb, mesh, atol=2e-2)
    return combos


def test_sdpa_matches_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_sdpa))


# --------------------------------------------------------------------------------------------------
# layouts: which shardings run without communication
# --------------------------------------------------------------------------------------------------


def _layout(mesh_shape, placements, heads, kv_heads, causal, kv_placements=None):
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    q = distribute_tensor(torch.randn(2, heads, 4, 8), mesh, placements).requires_grad_()
    k, v = (
        distribute_tensor(torch.randn(2, kv_heads, 4, 8), mesh, kv_placements or placements).requires_grad_()
        for _ in "kv"
    )
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    forward_comms = comm.get_total_counts()
    # autograd.grad, not .backward(): AccumulateGrad re-lays a leaf's grad out with new_empty_strided
    # (Replicate, tensor_ops.py) + copy_, which would hide the placement the backward rule chose
    _, dk, _ = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return out.placements, dk.placements, forward_comms


def test_batch_and_head_sharding_need_no_communication():
    for placements in ((Shard(0),), (Shard(1),)):
        for heads, kv_heads in ((4, 4), (4, 2)):  # MHA and GQA (2 q heads per kv head)
            out, dk, comms = run_world(_layout, 2, (2,), placements, heads, kv_heads, True)[0]
            assert (out, dk, comms) == (placements, placements, 0), (placements, heads, kv_heads)


def test_gqa_heads_that_do_not_split_evenly_are_gathered():
    # 2 kv heads on 4 ranks: local q head j would map to the wrong kv head, so heads are gathered
    out, _, comms = run_world(_layout, 4, (4,), (Shard(1),), 4, 2, False)[0]
    assert out == (Replicate(),) and comms > 0


def test_query_rows_sharding_without_causal_mask():
    out, dk, comms = run_world(_layout, 2, (2,), (Shard(2),), 4, 4, False, (Replicate(),))[0]
    assert (out, dk, comms) == ((Shard(2),), (Partial(),), 0)
    out, _, comms = run_world(_layout, 2, (2,), (Shard(2),), 4, 4, True, (Replicate(),))[0]
    assert out == (Replicate(),) and comms > 0  # causal: the local mask would be misaligned


def _compare_with_torch(placement: int):
    """torch 2.13's DTensor has no rule for the CPU flash kernel; ours runs it without communication."""
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mesh = get_mesh((2,))
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(placement)]) for t in (q, k, v))
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    torch.testing.assert_close(out.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    tq, tk, tv = (torch_distribute(t, get_torch_mesh((2,)), [TS(placement)]) for t in (q, k, v))
    try:
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        torch_supported = True
    except NotImplementedError:
        torch_supported = False
    return out.placements, comm.get_total_counts(), torch_supported


def test_sdpa_runs_where_torch_dtensor_has_no_cpu_rule():
    for placement in (0, 1):
        placements, comms, _torch_supported = run_world(_compare_with_torch, 2, placement)[0]
        assert placements == (Shard(placement),) and comms == 0  # the fewest possible


# --------------------------------------------------------------------------------------------------
# CUDA kernels, single process: the rules on hand-built specs (no GPU here; the local math of these
# kernels is the same as the CPU one: batch and heads are independent)
# --------------------------------------------------------------------------------------------------


def _cuda_kernel_calls(q, lse, rng):
    """(op, args) of every CUDA sdpa kernel and its backward that this torch build has."""
    calls = {
        "_scaled_dot_product_flash_attention": (q, q, q, 0.0, True, False),
        "_scaled_dot_product_flash_attention_backward": (q, q, q, q, q, lse, None, None, 8, 8, 0.0, True, rng, rng),
        "_scaled_dot_product_efficient_attention": (q, q, q, None, True, 0.0, True),
        "_scaled_dot_product_efficient_attention_backward": (
            q,
            q,
            q,
            q,
            None,
            q,
            lse,
            rng,
            rng,
            0.0,
            (True, True, True, False),
            True,
        ),
        "_scaled_dot_product_cudnn_attention": (q, q, q, None, True, 0.0, True, False),
        "_scaled_dot_product_cudnn_attention_backward": (
            q,
            q,
            q,
            q,
            q,
            lse,
            rng,
            rng,
            None,
            None,
            None,
            8,
            8,
            0.0,
            True,
        ),
        "_scaled_dot_product_fused_attention_overrideable": (q, q, q, None, 0.0, True, False),
    }
    return [(getattr(aten, name).default, args) for name, args in calls.items() if hasattr(aten, name)]


def test_cuda_kernel_rules_shard_batch_and_heads():
    from parallelisms.dtensor.ops import RULES, OpCall
    from parallelisms.dtensor.planning import choose

    for dim in (0, 1):
        q, lse, rng = (
            make_spec((2, 4, 8, 16), Shard(dim), dtype=torch.float16),
            make_spec((2, 4, 8), Shard(dim)),
            make_spec((), Replicate(), dtype=torch.int64),
        )
        for op, args in _cuda_kernel_calls(q, lse, rng):
            call = OpCall(op, args, {})
            choice = choose(call, RULES[op](call))
            assert all(p is None or p == (Shard(dim),) for p in choice.inputs[:3]), (op, choice)
            assert len(choice.outputs) == len(op._schema.returns), op
            assert choice.outputs[0] == (Shard(dim),), (op, choice.outputs)


def test_head_and_row_splits_pure_chunk_math():
    from parallelisms.dtensor.ops.attention import heads_split_evenly, splits_without_empty

    assert heads_split_evenly(4, 2, [2]) and not heads_split_evenly(4, 2, [4])
    assert not heads_split_evenly(4, 2, [2, 2]) and heads_split_evenly(8, 4, [2, 2])
    assert heads_split_evenly(3, 3, [4])  # MHA: uneven chunks of q and kv heads line up
    assert splits_without_empty(5, [2, 2]) and not splits_without_empty(3, [4])
    assert not splits_without_empty(5, [4])  # torch.chunk(5, 4) gives 2, 2, 1 and an empty piece
