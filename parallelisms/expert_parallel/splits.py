"""The host splits of an expert-parallel dispatch: how many rows this rank sends each ep rank and receives from each.

In a run they are read from the per-expert counts (one host sync per layer). Traced on fake tensors (the dry run,
trainer/estimate), counts have no values, so the splits are assumed: this rank sends its rows in even shares and is
the busiest rank of its ep group, receiving `imbalance` x the mean rows (balanced routing: 1.0), in even shares
from every source. Its local experts' activations, grouped GEMMs and the all-to-alls that return their outputs
then scale with the factor, as on the rank the step waits for.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch._subclasses.fake_tensor import is_fake

# context-local (as dtensor.cost's model): one thread's dry run never changes another's
_IMBALANCE: ContextVar[float] = ContextVar("meshtrain_routing_imbalance", default=1.0)


@contextmanager
def assume_routing_imbalance(factor: float) -> Iterator[None]:
    """Dispatches traced on fake tensors inside the context take this rank as the busiest of its ep group, receiving
    `factor` x the mean routed rows (1 <= factor <= ep)."""
    if factor < 1:
        raise ValueError(f"routing imbalance {factor}: the busiest rank receives at least the mean rows (>= 1)")
    token = _IMBALANCE.set(factor)
    try:
        yield
    finally:
        _IMBALANCE.reset(token)


def even_shares(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares that differ by at most one, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def host_splits(counts: torch.Tensor, received: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
    """(rows to each ep rank, rows from each ep rank): `counts` (E,) this rank's `rows` per expert, `received`
    (ep, E_l) each source's rows for this rank's experts. On fake tensors, assumed (see the module docstring)."""
    ep = received.shape[0]
    if is_fake(counts):
        return even_shares(rows, ep), even_shares(round(_IMBALANCE.get() * rows), ep)
    splits = torch.stack([counts.view(ep, -1).sum(1), received.sum(1)]).tolist()  # one host read for both
    return splits[0], splits[1]
