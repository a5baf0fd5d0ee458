"""Embedding rules (ops/embedding.py) and the `Sharding.local_impl` dispatch hook.

Every check runs `F.embedding` on DTensors under (sampled) placements of the weight and of the int
ids and compares outputs and weight gradients with the single-device run (tests/dtensor/harness.py).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from parallelisms.dtensor import Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import as_partial, check_op, get_mesh, get_torch_mesh, run_on_meshes, to_torch_placements
from tests.world import run_world


def lookup(weight, ids):
    return F.embedding(ids, weight)


def lookup_padded(weight, ids):
    return F.embedding(ids, weight, padding_idx=2)


def lookup_by_freq(weight, ids):
    return F.embedding(ids, weight, padding_idx=0, scale_grad_by_freq=True)


# (vocab, dim, ids shape): even, uneven (short shards) and tiny (empty shards on 4 ranks)
SHAPES = ((8, 4, (4, 6)), (7, 5, (3, 5)), (3, 6, (5,)))


def _check_lookups(mesh_shape: tuple[int, ...]) -> int:
    mesh = get_mesh(mesh_shape)
    torch.manual_seed(0)
    combos = 0
    for vocab, dim, ids_shape in SHAPES:
        weight = torch.randn(vocab, dim)
        ids = torch.randint(0, vocab, ids_shape)
        combos += check_op(lookup, [weight, ids], mesh, max_combos=40)
        combos += check_op(lookup_padded, [weight, ids], mesh, max_combos=12, seed=1)
        combos += check_op(lookup_by_freq, [weight, ids], mesh, max_combos=12, seed=2)
    return combos


def test_embedding_matches_single_device_all_meshes():
    assert all(n > 0 for n in run_on_meshes(_check_lookups))


def _output_placements(mesh_shape, weight_placements, ids_placements, impl="ours"):
    """(output placements, weight-gradient placements, collectives) of a lookup and its backward."""
    import torch.distributed.tensor as tdt

    ours = impl == "ours"
    mesh = get_mesh(mesh_shape) if ours else get_torch_mesh(mesh_shape)
    place = (lambda ps: ps) if ours else to_torch_placements
    torch.manual_seed(0)
    distribute = distribute_tensor if ours else tdt.distribute_tensor
    weight = distribute(torch.randn(8, 4), mesh, place(weight_placements)).requires_grad_()
    ids = distribute(torch.randint(0, 8, (4, 6)), mesh, place(ids_placements))
    with CommDebugMode() as comm:
        out = F.embedding(ids, weight)
        out.backward(torch.ones_like(out))
    return tuple(map(str, out.placements)), tuple(map(_short, weight.grad.placements)), comm.get_total_counts()


def _short(placement) -> str:
    """A placement of ours or torch's as ours prints it: R, S(0), P(sum)."""
    if placement.is_replicate():
        return "R"
    if placement.is_shard():
        return f"S({placement.dim})"
    return "P(sum)" if placement.is_partial() and placement.reduce_op == "sum" else str(placement)


def test_embedding_layouts_need_no_communication_and_grads_land_as_torchs():
    """No collective in forward or backward, and the weight gradient laid out as torch's rule lays it out:
    a row-sharded table's gradient is the whole table's (R), as in torch, since the rule cannot see the
    weight; RowwiseParallel's Embedding gives S(0) (test_vocab_parallel_style_gradient_is_sharded_like_the_weight)."""
    cases = {
        ((Shard(0),), (Replicate(),)): (("P(sum)",), ("R",)),  # vocabulary-parallel (row-wise)
        ((Shard(1),), (Replicate(),)): (("S(2)",), ("S(1)",)),  # column-wise
        ((Replicate(),), (Shard(0),)): (("S(0)",), ("P(sum)",)),  # batch-sharded ids
        ((Replicate(),), (Shard(1),)): (("S(1)",), ("P(sum)",)),  # sequence-sharded ids
        ((Replicate(),), (Replicate(),)): (("R",), ("R",)),  # a replicated table
    }
    for (w, i), (out, grad) in cases.items():
        got_out, got_grad, comms = run_world(_output_placements, 2, (2,), w, i)[0]
        assert (got_out, got_grad, comms) == (out, grad, 0), (w, i, got_out, got_grad, comms)
        assert got_grad == run_world(_output_placements, 2, (2,), w, i, "torch")[0][1], (w, i)


def _vocab_parallel_on_2d_mesh():
    """Vocab-parallel on one mesh dim, batch-sharded ids on the other: P(sum) x S(0) in one output."""
    return _output_placements((2, 2), (Replicate(), Shard(0)), (Shard(0), Replicate()))


def test_embedding_mixes_vocab_and_batch_sharding_on_2d_mesh():
    out, grad, comms = run_world(_vocab_parallel_on_2d_mesh, 4)[0]
    assert (out, grad, comms) == (("S(0)", "P(sum)"), ("P(sum)", "R"), 0)


def _vocab_parallel_style(vocab: int, padding_idx: int | None, by_freq: bool):
    """RowwiseParallel's Embedding: output and S(0) weight gradient equal one device's, no backward collective."""
    from torch import nn

    from parallelisms.tensor_parallel import RowwiseParallel, parallelize_module
    from parallelisms.tensor_parallel.vocab_parallel import VocabParallelEmbedding

    mesh = get_mesh((2,))
    torch.manual_seed(0)
    reference = nn.Embedding(vocab, 4, padding_idx=padding_idx, scale_grad_by_freq=by_freq)
    module = parallelize_module(copy.deepcopy(reference), mesh, RowwiseParallel(input_layouts=Replicate()))
    assert type(module) is VocabParallelEmbedding and isinstance(module, nn.Embedding)
    ids = torch.randint(0, vocab, (3, 5))
    grad_out = torch.randn(3, 5, 4)
    out = module(ids)
    with CommDebugMode() as comm:
        out.backward(grad_out)
    reference(ids).backward(grad_out)
    torch.testing.assert_close(out, reference(ids))
    assert module.weight.grad.placements == (Shard(0),) and comm.get_total_counts() == 0
    torch.testing.assert_close(module.weight.grad.full_tensor(), reference.weight.grad)
    return True


def test_vocab_parallel_style_gradient_is_sharded_like_the_weight():
    for vocab, padding_idx, by_freq in ((8, None, False), (7, 3, True), (3, 0, False)):  # even, uneven, empty shard
        assert all(run_world(_vocab_parallel_style, 2, vocab, padding_idx, by_freq)), (vocab, padding_idx, by_freq)


def _vocab_parallel_under_fsdp() -> int:
    """FSDP(2) x TP(2): the gathered weight is still the row-sharded TP DTensor, so the lookup's backward is
    the vocabulary-parallel one (counted), and the trained table equals one device's."""
    from torch import nn

    import parallelisms.tensor_parallel.vocab_parallel as vocab_parallel
    from parallelisms.fsdp import fully_shard
    from parallelisms.tensor_parallel import RowwiseParallel, parallelize_module

    mesh = get_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    reference = nn.Embedding(8, 4)
    module = parallelize_module(copy.deepcopy(reference), mesh["tp"], RowwiseParallel(input_layouts=Replicate()))
    fully_shard(module, mesh=mesh["dp"])
    calls = []
    backward = vocab_parallel._VocabParallelLookup.backward
    vocab_parallel._VocabParallelLookup.backward = staticmethod(lambda ctx, g: calls.append(1) or backward(ctx, g))
    try:
        ids = torch.randint(0, 8, (2, 2, 5))  # one (2, 5) batch per dp rank
        dp = mesh["dp"].get_local_rank()
        module(ids[dp]).backward(torch.ones(2, 5, 4))
    finally:
        vocab_parallel._VocabParallelLookup.backward = backward
    reference(ids.flatten(0, 1)).backward(torch.ones(4, 5, 4))
    torch.testing.assert_close(module.weight.grad.full_tensor(), reference.weight.grad / 2)  # FSDP averages
    return len(calls)


def test_vocab_parallel_style_under_fsdp():
    assert run_world(_vocab_parallel_under_fsdp, 4) == [1, 1, 1, 1]


def _compare_with_torch(weight_placements, ids_placements):
    """Our forward communication vs torch's DTensor for the same layout (ours: no more collectives)."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    torch.manual_seed(0)
    weight, ids = torch.randn(8, 4), torch.randint(0, 8, (4, 6))
    counts = []
    for mesh, dist_fn, convert in (
        (get_mesh((2,)), distribute_tensor, lambda ps: ps),
        (get_torch_mesh((2,)), torch_distribute, to_torch_placements),
    ):
        w = dist_fn(weight, mesh, convert(weight_placements))
        i = dist_fn(ids, mesh, convert(ids_placements))
        with CommDebugMode() as comm:
            out = F.embedding(i, w).full_tensor()
        torch.testing.assert_close(out, F.embedding(ids, weight))
        counts.append(comm.get_total_counts())
    return counts


def test_embedding_communicates_no_more_than_torch():
    for w, i in (((Shard(0),), (Replicate(),)), ((Shard(1),), (Replicate(),)), ((Shard(0),), (Shard(0),))):
        ours, theirs = run_world(_compare_with_torch, 2, w, i)[0]
        assert ours <= theirs, (w, i, ours, theirs)


# --------------------------------------------------------------------------------------------------
# the local_impl hook, on a private op so no real rule is overwritten
# --------------------------------------------------------------------------------------------------

_LIB = torch.library.Library("meshtrain_test", "DEF")
_LIB.define("offset_rows(Tensor x) -> Tensor")
_LIB.impl("offset_rows", lambda x: x.clone(), "CompositeExplicitAutograd")
_LIB.impl("offset_rows", lambda x: torch.empty_like(x), "Meta")


def _offset_rows_impl(local_args, local_kwargs, input_specs, output_specs, comm):
    """Adds each row's global index: needs the shard offset, which only local_impl can see."""
    (x,) = local_args
    _, offset = input_specs[0].local_shape_and_offset()
    rows = torch.arange(x.shape[0], dtype=x.dtype) + offset[0]
    return x + rows.unsqueeze(1)


def _run_local_impl_hook():
    from parallelisms.dtensor.ops.registry import RULES, OpCall, Sharding

    op = torch.ops.meshtrain_test.offset_rows.default

    def rule(call: OpCall) -> Sharding:
        (spec,) = call.specs
        return Sharding((None,), (spec.placements,), local_impl=_offset_rows_impl)

    RULES[op] = rule
    mesh = get_mesh((4,))
    x = torch.zeros(7, 3)
    out = op(distribute_tensor(x, mesh, (Shard(0),)))
    return out.full_tensor(), out.placements


def test_local_impl_replaces_the_local_op():
    full, placements = run_world(_run_local_impl_hook, 4)[0]
    assert placements == (Shard(0),)
    torch.testing.assert_close(full, torch.arange(7.0).unsqueeze(1).expand(7, 3))


def _partial_weight_lookup():
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    weight, ids = torch.randn(6, 4), torch.randint(0, 6, (3, 4))
    w = as_partial(distribute_tensor(weight, mesh, (Replicate(),)), (Partial(),))
    out = F.embedding(distribute_tensor(ids, mesh, (Replicate(),)), w)
    return out.placements, torch.allclose(out.full_tensor(), F.embedding(ids, weight))


def test_embedding_keeps_partial_weight():
    placements, ok = run_world(_partial_weight_lookup, 2)[0]
    assert placements == (Partial(),) and ok


def test_lookup_and_scatter_options_pure():
    from parallelisms.dtensor.ops.embedding import lookup_options, scatter_options

    r, p = Replicate(), Partial()
    assert [(o.first, o.indices, o.output, o.masked) for o in lookup_options(Shard(0), Shard(1), 3)] == [
        (r, Shard(1), Shard(1), False),  # gather the weight, keep the ids' sharding
        (Shard(0), r, p, True),  # gather the ids, vocabulary-parallel lookup
    ]
    assert [o.output for o in lookup_options(Shard(1), r, 3)] == [r, Shard(2)]
    # backward: batch-sharded ids give a P(sum) grad, unless counts must see every id
    assert [o.output for o in scatter_options(Shard(0), Shard(0), 2, by_freq=False)] == [r, p]
    assert [o.output for o in scatter_options(Shard(0), Shard(0), 2, by_freq=True)] == [r]
