"""ParamGroup: the parameters one fully_shard call manages, and their sharded state.

    SHARDED               the sharded DTensors are registered; no unsharded data is held
    SHARDED_POST_FORWARD  reshard_after_forward=k after forward: the sharded DTensors are registered
                          and this rank keeps world / k of the gathered slots, so backward all-gathers
                          over k ranks (intra-node, say) instead of all of them
    UNSHARDED             the unsharded parameters are registered and filled

    SHARDED or SHARDED_POST_FORWARD --unshard--> (an all-gather in flight) --wait_unshard--> UNSHARDED
    UNSHARDED --reshard--> SHARDED            UNSHARDED --reshard_post_forward--> SHARDED_POST_FORWARD
    SHARDED_POST_FORWARD --reshard--> SHARDED (the kept slots are dropped)

One all-gather unshards the whole group and one reduce-scatter reduces it (collectives.py lays out the
flat buffers). Both can run in flight: `unshard(async_op=True)` returns once the all-gather is issued and
`wait_unshard` finishes it; `reduce_grads(async_op=True)` returns once the reduce-scatter is issued and
`finish_reduce` lands the sharded gradients. gloo runs collectives on its own threads and NCCL on its
stream, so the compute in between overlaps them (state.py decides when: prefetch).
"""

from __future__ import annotations

from enum import Enum

import torch

from parallelisms.dtensor import DeviceMesh
from parallelisms.dtensor.collectives import InFlight

from .flat_buffers import FlatBuffers
from .param import FSDPParam
from .policy import MixedPrecisionPolicy


class ShardedState(Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDED = "unsharded"


class ParamGroup:
    """The FSDPParams of one fully_shard call, their sharded state and the collectives that move them."""

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
        self.params = params
        self.mesh = mesh
        self.policy = policy
        self.buffers = FlatBuffers(params, mesh)
        self.state = ShardedState.SHARDED
        self._gathering: InFlight | None = None  # an all-gather issued, not yet copied out
        self._post_forward_shard: torch.Tensor | None = None  # (world / k, numel) in SHARDED_POST_FORWARD
        self._waiting: set[int] = set()  # indices of params whose grad this backward has not produced
        self._reducing: tuple[InFlight, list[FSDPParam]] | None = None  # a reduce-scatter in flight

    @property
    def is_unsharded(self) -> bool:
        return self.state is ShardedState.UNSHARDED

    @property
    def is_gathering(self) -> bool:
        return self._gathering is not None

    def reshard_after_forward_to(self, k: int) -> None:
        """reshard_after_forward=k: after forward keep the shard of a k-rank block (see the module doc)."""
        self.buffers.use_blocks(k)

    # ------------------------------------------------------------------------------ parameters
    def unshard(self, *, async_op: bool = False, post_forward_ok: bool = True, fresh_scales: bool = True) -> None:
        """All-gather the group (one collective) and register the unsharded parameters; with
        `async_op` only issue the all-gather (a prefetch) and leave the rest to `wait_unshard`.

        `post_forward_ok=False` (a forward) drops a post-forward shard and gathers from the sharded
        parameters, which an optimizer step may have changed since that shard was kept.
        `fresh_scales=False` (a backward) gathers cast parameters with their forward's scales."""
        if self.state is ShardedState.UNSHARDED or not self.params:
            return
        if self._gathering is None:
            if self.state is ShardedState.SHARDED_POST_FORWARD and not post_forward_ok:
                self.reshard()
            if self.state is ShardedState.SHARDED_POST_FORWARD:
                shard, self._post_forward_shard = self._post_forward_shard, None
                assert shard is not None, "SHARDED_POST_FORWARD keeps a shard until it is gathered"
                self._gathering = self.buffers.start_block_all_gather(shard, async_op=async_op)
            else:
                dtype = self.policy.param_dtype
                self._gathering = self.buffers.start_all_gather(dtype, async_op=async_op, fresh_scales=fresh_scales)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an issued all-gather: copy every parameter out and register the unsharded ones."""
        if self._gathering is None:
            return
        gathered = self._gathering.wait()
        self._gathering = None
        self.buffers.copy_out(gathered)
        for p in self.params:
            assert p.unsharded is not None
            p.register(p.unsharded)
        self.state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded data (and any post-forward shard)."""
        if self._gathering is not None:  # a prefetch nobody used: land it, so buffers stay in step
            self.wait_unshard()
        if self.state is ShardedState.UNSHARDED:
            for p in self.params:
                p.register(p.sharded)
                p.free_unsharded()
        self._post_forward_shard = None
        self.state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """After forward under reshard_after_forward=k: keep this rank's post-forward shard (1 / k of the
        parameters), free the rest; the next unshard in backward gathers over k ranks only."""
        if not self.params:
            return
        assert self.state is ShardedState.UNSHARDED and self._gathering is None, f"post-forward from {self.state}"
        shard = self.buffers.post_forward_shard()
        self.reshard()
        self._post_forward_shard = shard
        self.state = ShardedState.SHARDED_POST_FORWARD

    # ------------------------------------------------------------------------------ gradients
    def expect_grads(self) -> None:
        """A backward starts: every param that needs a grad is awaited again."""
        self._waiting = {i for i, p in enumerate(self.params) if p.requires_grad}

    def grad_ready(self, param: FSDPParam) -> bool:
        """Note that `param`'s unsharded grad is complete; True once every param that needs one has it."""
        self._waiting.discard(self.params.index(param))
        return not self._waiting

    def holds_grads(self) -> bool:
        return any(p.holds_grad() for p in self.params)

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
        in_flight = self.buffers.start_reduce_scatter(pending, async_op=async_op)
        self._reducing = (in_flight, [p for p, _ in pending])
        if not async_op:
            self.finish_reduce()

    def finish_reduce(self) -> None:
        """Land an issued reduce-scatter in the sharded grads (HSDP: average over replicas first)."""
        if self._reducing is None:
            return
        in_flight, params = self._reducing
        self._reducing = None
        self.buffers.land_reduce_scatter(in_flight, params)

    def stash_grads(self) -> None:
        """No sync this backward: keep each unsharded grad for the next synced backward."""
        for p in self.params:
            p.stash_unsharded_grad(self.policy.reduce_dtype)
