"""ParamGroup: the parameters one fully_shard call manages, moved with one collective each way.

Unshard: every parameter's padded shard goes into one flat buffer (the same offsets on every rank),
one all-gather returns `(world, group_numel)` rank-major, and each parameter copies its column
block `[:, offset : offset + slot]` into its unsharded storage. Reduce: every gradient is chunked
and padded to `(world, slot)` the same way, the blocks are concatenated column-wise into one
`(world, group_numel)` buffer, one reduce-scatter averages it over the mesh, and each parameter
takes its `slot` of the result as its sharded gradient. On a 2-D (replicate, shard) mesh (HSDP) the
collectives run over the shard dim, and the reduced shards are then averaged over the replicate dim
with one all-reduce.

`reshard_after_forward=k` (an int) reshards onto groups of k consecutive shard ranks after forward:
each rank keeps k / world of the gathered buffer (its block of world / k rank slots), so backward
all-gathers over k ranks (intra-node, say) instead of all of them.

Both directions can run in flight (`async_op=True`): `unshard` returns once the all-gather is
issued and `wait_unshard` finishes it; `reduce_grads` returns once the reduce-scatter is issued and
`finish_reduce` lands the sharded gradients. gloo runs collectives on its own threads and NCCL on
its stream, so the compute in between overlaps them (state.py decides when: prefetch).
"""

from __future__ import annotations

import torch

from parallelisms.dtensor import DeviceMesh, collectives
from parallelisms.dtensor.collectives import InFlight

from .param import FSDPParam
from .policy import MixedPrecisionPolicy

# k-rank groups of reshard_after_forward=k: (root, group, this rank's index in it) per (root, dims, k)
_PARTIAL_GROUPS: dict[tuple, tuple] = {}


class ParamGroup:
    """The FSDPParams of one fully_shard call, with the collectives that move them."""

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        self.params = params
        self.mesh = mesh
        self.policy = policy
        self.is_unsharded = False
        self.offsets: list[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.slot_numel
        self.group_numel = total  # per-rank elements in the flat all-gather / reduce-scatter buffers
        self._waiting: set[int] = set()  # indices of params whose grad this backward has not produced
        self._gathering: InFlight | None = None  # an all-gather issued, not yet copied out
        # the k-rank process group of reshard_after_forward=k
        self._partial_group: torch.distributed.ProcessGroup | None = None
        self._partial_block: int = 0  # which block of rank slots this rank keeps
        self._partial: torch.Tensor | None = None  # (world / k, group_numel) kept after forward
        self._kept: torch.Tensor | None = None  # the block reshard_to_partial keeps, cut at the gather
        self._reducing: tuple[InFlight, list[FSDPParam]] | None = None  # a reduce-scatter in flight

    @property
    def is_gathering(self) -> bool:
        return self._gathering is not None

    # ------------------------------------------------------------------------------ parameters
    def unshard(self, *, async_op: bool = False) -> None:
        """All-gather the group (one collective) and register the unsharded parameters; with
        `async_op` only issue the all-gather (a prefetch) and leave the rest to `wait_unshard`."""
        if self.is_unsharded or not self.params:
            return
        if self._gathering is None and self._partial is not None:  # from the k-rank reshard
            assert self._partial_group is not None
            partial, self._partial = self._partial, None
            self._gathering = collectives.start_all_gather_flat(
                partial.reshape(-1),
                self._partial_group,
                async_op=async_op,
            )
        if self._gathering is None:
            inputs = [t for p in self.params for t in p.all_gather_inputs()]
            flat = torch.cat(inputs)  # (group_numel,)  this rank's padded shards
            if self.policy.param_dtype is not None:
                flat = flat.to(self.policy.param_dtype)
            group = self.mesh.get_group(self.mesh.ndim - 1)
            self._gathering = collectives.start_all_gather_flat(flat, group, async_op=async_op)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: copy every parameter out and register the unsharded ones."""
        if self._gathering is None:
            return
        gathered = self._gathering.wait()
        self._gathering = None
        shard_dim = self.mesh.ndim - 1
        per_rank = gathered.view(self.mesh.size(shard_dim), self.group_numel)  # (shard world, group_numel)
        if self._partial_group is not None and torch._C._current_graph_task_id() == -1:
            # forward under reshard_after_forward=k: keep only the block this rank holds after it
            k = self._partial_group.size()
            self._kept = per_rank.view(k, -1, self.group_numel)[self._partial_block].clone()
        for p, offset in zip(self.params, self.offsets):
            p.fill_unsharded(per_rank[:, offset : offset + p.slot_numel])
            assert p.unsharded is not None
            p.register(p.unsharded)
        self.is_unsharded = True
        self.expect_grads()

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded data."""
        if self._gathering is not None:  # a prefetch nobody used: land it, so buffers stay in step
            self.wait_unshard()
        if not self.is_unsharded:
            return
        for p in self.params:
            p.register(p.sharded)
            p.free_unsharded()
        self.is_unsharded = False
        self._kept = None

    def use_partial_reshard(self, k: int) -> None:
        """Join the k-rank groups of reshard_after_forward=k: consecutive ranks of the shard dim,
        for every coordinate of the root's other dims (created once per root, dims and k: every
        rank of the world makes the same new_group calls in the same order)."""
        root, shard_dims = self.mesh._root, self.mesh._root_dims[-1]
        key = (id(root), shard_dims, k)
        if key not in _PARTIAL_GROUPS:
            rest = [d for d in range(root.ndim) if d not in shard_dims]
            world = self.mesh.size(self.mesh.ndim - 1)
            rows = root.mesh.permute(*rest, *shard_dims).reshape(-1, world).tolist()
            me, mine = torch.distributed.get_rank(), None
            for row in rows:
                for start in range(0, world, k):
                    ranks = row[start : start + k]
                    group = torch.distributed.new_group(ranks)
                    if me in ranks:
                        mine = (group, ranks.index(me))
            assert mine is not None, "this rank is on the mesh, so in one of its rows"
            _PARTIAL_GROUPS[key] = (root, *mine)  # the root is held so its id stays unique
        _, self._partial_group, self._partial_block = _PARTIAL_GROUPS[key]

    def drop_partial(self) -> None:
        self._partial = None

    def reshard_to_partial(self) -> None:
        """After forward, reshard_after_forward=k: keep this rank's block of the gathered slots
        (world / k of them, so 1 / k of the parameters) and free the rest; the next unshard
        gathers over k ranks only."""
        kept = self._kept
        self.reshard()
        self._partial = kept

    # ------------------------------------------------------------------------------ gradients
    def expect_grads(self) -> None:
        """A backward starts: every param that needs a grad is awaited again."""
        self._waiting = {i for i, p in enumerate(self.params) if p.requires_grad}

    def grad_ready(self, param: FSDPParam) -> bool:
        """Note that `param`'s unsharded grad is complete; True once every param that needs one has it."""
        self._waiting.discard(self.params.index(param))
        return not self._waiting

    def reduce_grads(self, *, async_op: bool = False) -> None:
        """Reduce-scatter (average) every unsharded grad in one collective into the sharded grads;
        with `async_op` only issue it and leave the rest to `finish_reduce`.

        Parameters that got no gradient are left out (their sharded `.grad` is untouched); which
        ones those are must agree across ranks, as in torch.
        """
        self.finish_reduce()  # one reduce-scatter per group in flight (a re-entered backward)
        reduce_dtype = self.policy.reduce_dtype
        pending = [(p, g) for p in self.params if (g := p.take_unsharded_grad(reduce_dtype)) is not None]
        if not pending:
            return
        blocks = [p.reduce_scatter_input(g) for p, g in pending]  # each (world, slot)
        dtype = blocks[0].dtype
        flat = torch.cat([b.to(dtype) for b in blocks], dim=1)  # (world, numel of these slots)
        group = self.mesh.get_group(self.mesh.ndim - 1)
        self._reducing = (
            collectives.start_reduce_scatter_flat(flat.reshape(-1), "avg", group, async_op=async_op),
            [p for p, _ in pending],
        )
        if not async_op:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Land an issued reduce-scatter in the sharded grads (HSDP: average over replicas first)."""
        if self._reducing is None:
            return
        in_flight, params = self._reducing
        self._reducing = None
        reduced = in_flight.wait()
        if self.mesh.ndim > 1:  # HSDP: every replica of this shard averages it with the others
            reduced = collectives.all_reduce(reduced, "avg", self.mesh.get_group(0), self.mesh.size(0))
        offset = 0
        for p in params:
            p.accumulate_sharded_grad(reduced[offset : offset + p.slot_numel])
            offset += p.slot_numel

    def stash_grads(self) -> None:
        """No sync this backward: keep each unsharded grad for the next synced backward."""
        for p in self.params:
            p.stash_unsharded_grad(self.policy.reduce_dtype)
