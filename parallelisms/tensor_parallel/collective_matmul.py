"""Collective matmul (Wang et al. 2023, "Overlap communication with dependent computation via
decomposition"): sequence-parallel TP's two collectives, cut into a ring of sequence chunks so that each
chunk's pass to the next rank overlaps a matmul. `parallelism.enable_async_tensor_parallel` turns it on
(async_styles.py).

all_gather_matmul      x sharded on the sequence (S(dim)) times column-sharded weights. Each rank multiplies
                       the chunk it holds while passing it on; after tp steps it has multiplied every chunk.
                       Backward: the input gradient is a ring reduce-scatter, each weight's gradient
                       accumulates chunk by chunk, both under the passes.
matmul_reduce_scatter  x (the whole sequence, sharded on the contracted dim) times a row-sharded weight,
                       summed over the ranks and scattered on the sequence. Each rank computes one chunk's
                       partial product, adds it to the running sum it received and passes that on; chunk r's
                       sum ends at rank r. Backward: a ring all-gather of the output gradient, with each chunk's
                       input- and weight-gradient matmuls under the passes.

Each is one call of a compiled graph (`allow_in_graph`); while traced, each pass is a functional all-to-all
(parallelisms/ring_pass.py) that inductor can order against the matmuls. The sums run in ring order, not rank
order: at tp = 2 the results equal synchronous TP's bit for bit, beyond that within rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallelisms.dtensor.traceable import register_graph_constant
from parallelisms.ring_pass import PendingPass, RingGroup, start_pass


@dataclass(frozen=True)
class SequenceRing:
    """The tp ranks as a ring, and the activations' dim it cuts into chunks (the sequence). A constant of
    compiled graphs, by reference."""

    ring: RingGroup
    dim: int

    def chunk(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """Chunk `index` of a whole-sequence tensor: every chunk is the same length."""
        length = t.shape[self.dim] // self.ring.size
        return t.narrow(self.dim, index * length, length)


register_graph_constant(SequenceRing)


def pass_around(x: torch.Tensor, ring: RingGroup, visit: Callable[[int, torch.Tensor], None]) -> None:
    """Call `visit(source, chunk)` on every rank's `x` in ring order, this rank's first, each while the next
    pass is in flight: the ring all-gather."""
    current, source = x.contiguous(), ring.rank
    for step in range(ring.size):
        pending = start_pass(current, ring) if step < ring.size - 1 else None
        visit(source, current)
        if pending is not None:
            current, source = pending.wait(), (source - 1) % ring.size


def sum_around(partial_of: Callable[[int], torch.Tensor], ring: RingGroup) -> torch.Tensor:
    """The sum over the ranks of their `partial_of(ring.rank)`: the ring reduce-scatter. Each step computes
    one chunk's partial while the running sum of the previous chunk is in flight."""
    pending: PendingPass | None = None
    for step in range(ring.size):
        partial = partial_of((ring.rank - 1 - step) % ring.size)  # chunk rank-1's sum starts here, ends at rank
        total = partial if pending is None else pending.wait() + partial
        if step < ring.size - 1:
            pending = start_pass(total, ring)
    return total


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq: SequenceRing, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = seq.ring.size
        chunks: list[torch.Tensor] = [x] * n
        outputs: list[list[torch.Tensor]] = [[x] * n for _ in weights]

        def visit(source: int, chunk: torch.Tensor) -> None:
            chunks[source] = chunk
            for output, weight in zip(outputs, weights):
                output[source] = F.linear(chunk, weight)

        pass_around(x, seq.ring, visit)
        ctx.seq = seq
        ctx.save_for_backward(torch.cat(chunks, seq.dim), *weights)  # the gathered x, as synchronous TP saves
        return tuple(torch.cat(output, seq.dim) for output in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        seq: SequenceRing = ctx.seq
        gathered, *weights = ctx.saved_tensors
        weight_grads = [torch.zeros_like(w) for w in weights]

        def partial_of(index: int) -> torch.Tensor:
            x = _rows(seq.chunk(gathered, index))
            total = None
            for j, (grad, weight) in enumerate(zip(grads, weights)):
                g = seq.chunk(grad, index)
                weight_grads[j] += _rows(g).T @ x
                total = g @ weight if total is None else total + g @ weight
            assert total is not None
            return total

        return (None, sum_around(partial_of, seq.ring), *weight_grads)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq: SequenceRing, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.seq = seq
        ctx.save_for_backward(x, weight)
        return sum_around(lambda index: F.linear(seq.chunk(x, index), weight), seq.ring)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        seq: SequenceRing = ctx.seq
        x, weight = ctx.saved_tensors
        input_grads: list[torch.Tensor] = [grad] * seq.ring.size
        weight_grad = [torch.zeros_like(weight)]

        def visit(source: int, g: torch.Tensor) -> None:
            input_grads[source] = g @ weight
            weight_grad[0] += _rows(g).T @ _rows(seq.chunk(x, source))

        pass_around(grad, seq.ring, visit)
        return None, torch.cat(input_grads, seq.dim), weight_grad[0]


@torch._dynamo.allow_in_graph
def all_gather_matmul(seq: SequenceRing, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`F.linear(all_gather(x, seq.dim), w)` for each of `weights` (local shards, plain tensors): this rank's
    chunk of x in, each product over the whole sequence out."""
    return _AllGatherMatmul.apply(seq, x, *weights)


@torch._dynamo.allow_in_graph
def matmul_reduce_scatter(seq: SequenceRing, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reduce_scatter(F.linear(x, weight), seq.dim)` summed over the ranks (local shards, plain tensors):
    the whole sequence in, this rank's chunk of the sum out."""
    return _MatmulReduceScatter.apply(seq, x, weight)
