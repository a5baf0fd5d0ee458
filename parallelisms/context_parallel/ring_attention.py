"""Ring attention (Liu et al. 2023) on local sequence shards: each rank's queries against every rank's K/V
block, merged by log-sum-exp, skipping the blocks the causal mask zeroes (blocks.py), with the backward
returning dK/dV to their owners. K/V travel by one all-gather or around a ring (exchange.py).

`RingAttention` is the drop-in for `F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=True)`
on (B, H, L, Dh) queries and (B, Hkv, L, Dh) keys and values, L = this rank's share of the sequence.
The backward re-fetches K/V instead of keeping every rank's (memory stays 1/cp of one device's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.autograd.function import once_differentiable

from parallelisms.dtensor.device_mesh import DeviceMesh
from parallelisms.dtensor.traceable import register_graph_constant

from .blocks import Block, attention_block, ring_sources
from .exchange import PendingPass, RingGroup, all_gather_blocks, reduce_scatter_blocks, start_pass
from .kernels import Kernel, block_backward, block_forward, choose_kernel
from .merge import merge_into
from .sequence import rank_positions

RotateMethod = Literal["allgather", "alltoall"]
ROTATE_METHODS: tuple[RotateMethod, ...] = ("allgather", "alltoall")


@dataclass(frozen=True)
class RingPlan:
    """What one rank's ring attention does: its group, the mask, the split, how K/V travel, the kernel. A
    constant of compiled graphs, by reference (`register_graph_constant`)."""

    ring: RingGroup
    causal: bool
    load_balance: bool
    rotate_method: RotateMethod
    kernel: Kernel

    def blocks(self) -> list[tuple[int, Block | None]]:
        """(source rank, block) at each step, in ring order: own block first."""
        rank = self.ring.rank
        return [
            (src, attention_block(rank, src, causal=self.causal, load_balance=self.load_balance))
            for src in ring_sources(rank, self.ring.size)
        ]


register_graph_constant(RingPlan)


class KVSource:
    """The K/V block of each step, in `RingPlan.blocks` order: all gathered at once, or passed along the ring
    (the next pass in flight while the caller computes on the current one)."""

    def __init__(self, kv: torch.Tensor, plan: RingPlan) -> None:
        self.plan, self.step = plan, 0
        self.gathered = all_gather_blocks(kv, plan.ring) if plan.rotate_method == "allgather" else None
        self.current = kv
        self.pending: PendingPass | None = None

    def next(self, source: int) -> torch.Tensor:
        """The K/V of `source`, the rank of this step."""
        if self.gathered is not None:
            return self.gathered[source]
        if self.step > 0:
            assert self.pending is not None
            self.current = self.pending.wait()
        self.step += 1
        if self.step < self.plan.ring.size:  # start the next pass before the caller computes on this one
            self.pending = start_pass(self.current, self.plan.ring)
        return self.current


def _block_keys(block: Block, q: torch.Tensor, kv: torch.Tensor) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """The block's query range, and its K and V made contiguous (torch's context parallel notes that without
    it "the loss curve is bad"). Queries stay as they come: the output keeps their (B, L, H, Dh) layout, so the
    caller's transpose back is free."""
    ks = block.keys.select(kv.shape[3])
    return block.queries.select(q.shape[2]), kv[0][:, :, ks].contiguous(), kv[1][:, :, ks].contiguous()


class DocumentBlocks:
    """Block-causal attention under CP: the pairs of a block that share a document, from the whole sequences'
    document ids (B, T) and each rank's global positions. A block whose pairs share none is skipped (eager: it
    reads one flag to the host; while traced every block runs, masked)."""

    def __init__(self, documents: torch.Tensor, plan: RingPlan, local_len: int) -> None:
        ring, total = plan.ring, local_len * plan.ring.size
        positions = [
            rank_positions(total, ring.size, r, plan.load_balance).to(documents.device) for r in range(ring.size)
        ]
        self.of_rank = [documents.index_select(1, p) for p in positions]  # (B, L) per rank
        self.rank, self.local_len = ring.rank, local_len

    def mask(self, src: int, block: Block) -> torch.Tensor | None:
        """(B, 1, Lq, Lk) bool of the block's pairs in one document; None when it has none (skip the block)."""
        queries = self.of_rank[self.rank][:, block.queries.select(self.local_len)]
        keys = self.of_rank[src][:, block.keys.select(self.local_len)]
        mask = queries[:, None, :, None] == keys[:, None, None, :]
        if not torch.compiler.is_compiling() and not bool(mask.any()):
            return None
        return mask


def ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse (fp32)) of this rank's queries over every rank's keys; with `documents` (B, T) the whole
    sequences' document ids, within documents only."""
    kernel = choose_kernel(plan.kernel, q)
    source = KVSource(torch.stack([k, v]), plan)
    docs = None if documents is None else DocumentBlocks(documents, plan, q.shape[2])

    def attend(src: int, block: Block, mask: torch.Tensor | None) -> tuple[slice, torch.Tensor, torch.Tensor]:
        qs, k_b, v_b = _block_keys(block, q, source.next(src))
        out, lse = block_forward(q[:, :, qs], k_b, v_b, causal=block.causal, scale=scale, kernel=kernel, mask=mask)
        return qs, out, lse

    (own_src, own_block), *others = plan.blocks()
    assert own_block is not None, "a rank's queries always see its own keys"
    own_mask = None if docs is None else docs.mask(own_src, own_block)  # never None: a token shares its document
    _, out, lse = attend(own_src, own_block, own_mask)  # covers every query: the accumulators start from it
    # copies (strides kept): the merge writes into them, and selective AC may have cached the kernel's output
    acc_out, acc_lse = out.to(torch.float32, copy=True), lse.to(torch.float32, copy=True)
    for src, block in others:
        mask = None if docs is None or block is None else docs.mask(src, block)
        if block is None or (docs is not None and mask is None):
            source.next(src)  # the ring still passes these K/V on
            continue
        qs, out, lse = attend(src, block, mask)
        merge_into(acc_out[:, :, qs], acc_lse[:, :, qs], out, lse)
    return acc_out.to(q.dtype), acc_lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: RingPlan,
    scale: float,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shards: each block's backward given the merged out and lse, dq kept
    here, every block's dK/dV returned to the rank that owns it."""
    kernel = choose_kernel(plan.kernel, q)
    docs = None if documents is None else DocumentBlocks(documents, plan, q.shape[2])
    ring = plan.ring
    kv = torch.stack([k, v])
    source = KVSource(kv, plan)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    gathered_grads = None  # allgather: every block's gradient, reduce-scattered to the owners at the end
    if plan.rotate_method == "allgather":
        gathered_grads = torch.zeros((ring.size, *kv.shape), dtype=torch.float32, device=q.device)
    grad_pass: PendingPass | None = None
    for src, block in plan.blocks():
        kv_src = source.next(src)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        mask = None if docs is None or block is None else docs.mask(src, block)
        if block is not None and (docs is None or mask is not None):
            qs, k_b, v_b = _block_keys(block, q, kv_src)
            ks = block.keys.select(k.shape[2])
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, qs], q[:, :, qs], k_b, v_b, out[:, :, qs], lse[:, :, qs].contiguous(),
                causal=block.causal, scale=scale, kernel=kernel, mask=mask,
            )  # fmt: skip
            dq[:, :, qs] += dq_b
            dkv[0][:, :, ks] += dk_b
            dkv[1][:, :, ks] += dv_b
        if gathered_grads is not None:
            gathered_grads[src] = dkv
            continue
        if grad_pass is not None:  # the gradient of this block so far, from the ranks before us
            dkv += grad_pass.wait()
        grad_pass = start_pass(dkv, ring)
    if gathered_grads is not None:
        own = reduce_scatter_blocks(gathered_grads, ring)
    else:
        assert grad_pass is not None
        own = grad_pass.wait()  # our block's, back from its last rank
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    """Forward and backward each compute in their own dtypes: autocast off, so P matches its lse."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        out, lse = ring_forward(q, k, v, plan, scale, documents)
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @once_differentiable
    @torch.autocast("cpu", enabled=False)
    @torch.autocast("cuda", enabled=False)
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, documents = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, documents)
        return dq, dk, dv, None, None, None


class RingAttention:
    """`F.scaled_dot_product_attention` over a sequence sharded on `cp_mesh` (shards as sequence.py cuts them).

    `rotate_method`: "allgather" or "alltoall" (the ring); `kernel`: "auto", "flash" or "math" (kernels.py)."""

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        *,
        causal: bool = True,
        load_balance: bool = True,
        rotate_method: RotateMethod = "allgather",
        kernel: Kernel = "auto",
    ) -> None:
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(
                f"context_parallel_rotate_method={rotate_method!r}: expected one of {', '.join(ROTATE_METHODS)}"
            )
        self.plan = RingPlan(RingGroup.of(cp_mesh), causal, load_balance, rotate_method, kernel)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of this rank's shards; with `documents` (B, T), the whole sequences' document ids, each
        token sees only its own document's earlier tokens (block-causal)."""
        if q.shape[2] != k.shape[2] or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must hold the same "
                f"tokens (this rank's shard of one sequence), q and k one head size"
            )
        if v.shape[-1] > q.shape[-1]:
            raise ValueError(
                f"ring attention: values {v.shape[-1]} wide are wider than queries and keys ({q.shape[-1]})"
            )
        if v.shape[-1] < q.shape[-1]:
            # narrower values (DeepSeek's latent attention: 128 against 192): the kernels take one head size, so v
            # gets zero channels, which the output then has as zeros (the weights are the same) and drops
            width = v.shape[-1]
            return self(q, k, torch.nn.functional.pad(v, (0, q.shape[-1] - width)), documents)[..., :width]
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"ring attention: {q.shape[1]} query heads do not group over {k.shape[1]} K/V heads")
        if self.plan.load_balance and self.plan.causal and q.shape[2] % 2:
            raise ValueError(
                f"ring attention: a load-balanced shard holds two equal chunks, but this rank has {q.shape[2]} "
                f"tokens (odd); the sequence length must divide by 2 x the context parallel degree"
            )
        return ring_attention(q, k, v, self.plan, q.shape[-1] ** -0.5, documents)


@torch._dynamo.allow_in_graph
def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, scale: float,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Ring attention as one call of a compiled graph (the plan a constant of it): AOT autograd traces its
    forward and backward, whose collectives are then functional (exchange.py)."""
    return _RingAttentionFunction.apply(q, k, v, plan, scale, documents)
