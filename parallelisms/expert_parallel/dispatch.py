"""Token dispatch and combine for expert parallelism: the all-to-alls and the index math around them (torch only).

Each rank holds `E / ep` consecutive experts (rank r: experts [r E_l, (r + 1) E_l)). An MoE layer hands its experts
the routed tokens sorted by expert with a count per expert (models/common/moe.py). Per layer and step:

    counts        one all-to-all of the (E,) per-expert counts: rank r learns how many rows each rank sends
                  each of its local experts, (ep, E_l) source-major
    dispatch      one all-to-all of the rows (uneven splits: rank k gets the rows of its experts)
    regroup       the received rows, source-major, reordered expert-major (one index_select), so the local
                  experts' grouped GEMM sees each expert's rows together
    combine       the inverse: rows back in source-major order, one all-to-all home

The backward mirrors it: each all-to-all's gradient is the all-to-all with the splits swapped, each index_select's
an index_copy. The splits go to the host once per layer (the only sync), as torchtitan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from parallelisms.dtensor.collectives import all_to_all_rows

from .splits import host_splits


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        return all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back_out, back_in = ctx.splits
        return all_to_all_rows(grad, back_out, back_in, ctx.group), None, None, None


def all_to_all_rows_autograd(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """`collectives.all_to_all_rows` with a gradient: the rows' gradients travel back the way the rows came."""
    return _AllToAllRows.apply(x, output_splits, input_splits, group)


def expert_major_order(received: torch.Tensor, total: int) -> torch.Tensor:
    """The row order that regroups received rows by local expert.

    `received` (ep, E_l): received[s, e] rows came from rank s for local expert e, laid out source-major (all of
    rank 0's rows, expert by expert, then rank 1's, ...); `total` = received.sum(), known on the host. Returns the
    indices (total,) into those rows that list them expert-major (expert 0's rows from rank 0, from rank 1, ...,
    then expert 1's), each segment in order."""
    sizes = received.flatten()
    starts = sizes.cumsum(0) - sizes  # each (source, expert) segment's first row, source-major
    by_expert_sizes = received.T.flatten()
    by_expert_starts = starts.view(received.shape).T.flatten()
    # row i of segment j (expert-major) is starts[j] + i: repeat each segment's start minus its offset in the output
    out_offsets = by_expert_sizes.cumsum(0) - by_expert_sizes
    shift = torch.repeat_interleave(by_expert_starts - out_offsets, by_expert_sizes, output_size=total)
    return torch.arange(total, device=received.device) + shift


def token_slice(counts: torch.Tensor, index: int, parts: int, total: int) -> tuple[int, int, torch.Tensor]:
    """Part `index` of `parts` of the `total` = counts.sum() rows sorted by expert (the ranks of a tp group, which
    route the same tokens, split them so each row goes through the experts once): rows [lo, hi) and the count of
    each expert's rows among them. `total` comes from the rows' shape: no host read (fake counts have no values)."""
    lo, hi = total * index // parts, total * (index + 1) // parts
    ends = counts.cumsum(0)
    starts = ends - counts
    return lo, hi, (ends.clamp(max=hi) - starts.clamp(min=lo)).clamp(min=0)


@dataclass
class Dispatched:
    """What combining needs from a dispatch: the splits (this rank's rows to each rank, and from each rank) and the
    expert-major order of the received rows."""

    input_splits: list[int]
    output_splits: list[int]
    order: torch.Tensor
    group: ProcessGroup


def dispatch(
    routed: torch.Tensor, counts: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """Send `routed` (M, D), sorted by expert with `counts` (E,) rows per expert, to the ranks owning the experts.
    Returns this rank's local experts' rows (expert-major), their counts (E_l,), and the state `combine` needs."""
    ep = group.size()
    received = all_to_all_rows(counts, [counts.numel() // ep] * ep, [counts.numel() // ep] * ep, group)
    received = received.view(ep, -1)  # (source rank, local expert)
    # the all-to-all of rows takes them as lists: one host read (assumed when traced on fake tensors)
    input_splits, output_splits = host_splits(counts, received, routed.shape[0])
    rows = all_to_all_rows_autograd(routed, output_splits, input_splits, group)
    order = expert_major_order(received, sum(output_splits))
    return rows.index_select(0, order), received.sum(0), Dispatched(input_splits, output_splits, order, group)


def combine(out: torch.Tensor, state: Dispatched) -> torch.Tensor:
    """The local experts' outputs (expert-major, as `dispatch` returned the rows) back to the ranks that sent the
    rows, in their order."""
    source_major = torch.zeros_like(out).index_copy(0, state.order, out)
    return all_to_all_rows_autograd(source_major, state.input_splits, state.output_splits, state.group)
