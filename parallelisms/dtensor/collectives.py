"""The only file that calls torch.distributed collectives.

Every function works on local tensors of one mesh dim's group and follows `torch.chunk` sharding:
uneven pieces are padded to the largest chunk for the fixed-size collectives (all_gather,
reduce_scatter, scatter) and sent unpadded where the collective takes split sizes (all_to_all).
Gloo has no AVG reduction, so "avg" is a SUM followed by a division on every backend; a p-norm
partial ("norm2") is a SUM of |x|**p followed by the p-th root. Gloo's SUM reduce_scatter runs as an
all_to_all and a local sum (`_reduce_scatter_single`).

Under torch.compile's tracing (`traced()`), the same functions issue functional collectives
(`torch.ops._c10d_functional`, each followed by its `wait_tensor`): they return new tensors and name
their group by string, so the traced graph holds them (an in-place c10d call would capture the
ProcessGroup object) and inductor may move them. `async_op` is then moot: the compiler schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from .async_tensor import pending, wait_all
from .debug import counted_as
from .placements import chunk_size_and_offset, chunk_sizes, norm_order

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


_FUNCTIONAL_REDUCE_OPS = {"sum": "sum", "avg": "sum", "prod": "product", "min": "min", "max": "max"}
_functional = torch.ops._c10d_functional


def traced() -> bool:
    """Whether torch.compile is tracing (dynamo's fake run or AOT autograd's): collectives go functional."""
    return torch.compiler.is_compiling()


def _functional_reduce_op(reduce_op: str) -> str:
    return "sum" if norm_order(reduce_op) is not None else _FUNCTIONAL_REDUCE_OPS[reduce_op]


def functional_all_to_all(
    send: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """all_to_all_single as a functional collective and its wait (rows of dim 0 by the splits): CommDebugMode counts
    it and torch.compile traces it (`all_to_all_rows`, and every all-to-all while traced)."""
    out = _functional.all_to_all_single(send.contiguous(), output_splits, input_splits, group.group_name)
    return _functional.wait_tensor(out)


def _traced_reduce_scatter(stacked: torch.Tensor, reduce_op: str, group: ProcessGroup) -> torch.Tensor:
    """`_reduce_scatter_single`'s result, functional: gloo's SUM as an all_to_all and a sum, as there."""
    n = group.size()
    if reduce_op == "sum" and stacked.device.type == "cpu" and dist.get_backend(group) == "gloo":
        chunk = stacked.shape[0] // n
        received = functional_all_to_all(stacked, [chunk] * n, [chunk] * n, group)
        return received.view(n, chunk, *stacked.shape[1:]).sum(0)
    out = _functional.reduce_scatter_tensor(stacked.contiguous(), reduce_op, n, group.group_name)
    return _functional.wait_tensor(out)


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad `t` along `dim` up to `size` (no copy when already that size)."""
    missing = size - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (t.ndim - dim - 1) + [0, missing]
    return F.pad(t, pad)


def _dist_op(reduce_op: str) -> dist.ReduceOp.RedOpType:
    return _REDUCE_OPS["sum"] if norm_order(reduce_op) is not None else _REDUCE_OPS[reduce_op]


def _start_reduce(t: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """A new contiguous tensor to reduce: p-norm partials travel as |x|**p (summed, then rooted)."""
    p = norm_order(reduce_op)
    if p is None:
        return t.clone(memory_format=torch.contiguous_format)
    return (t * t if p == 2 else t.abs().pow(p)).contiguous()


def _finish_reduce(t: torch.Tensor, reduce_op: str, group_size: int) -> torch.Tensor:
    """avg: the sum / n; norm<p>: the p-th root of the summed |x|**p."""
    p = norm_order(reduce_op)
    if p is not None:
        return t.sqrt_() if p == 2 else t.pow_(1.0 / p)
    return t.div_(group_size) if reduce_op == "avg" else t


class _SummedAllToAll:
    """A reduce_scatter in flight as an all_to_all: `wait()` lands it and sums the n received contributions
    (rank order) into the output. A work handle as c10d's (wait, is_completed)."""

    __slots__ = ("out", "received", "work")

    def __init__(self, work: Any, received: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.received, self.out = work, received, out

    def is_completed(self) -> bool:
        return self.work is None

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            torch.sum(self.received, 0, out=self.out)
        return True


def _reduce_scatter_single(
    out: torch.Tensor, stacked: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup, async_op: bool
) -> Any:
    """dist.reduce_scatter_single(out, stacked, op), except gloo's SUM: there every rank sends each rank its
    chunk of `stacked` (one all_to_all, the same (n-1)/n of the bytes) and sums what it receives. gloo's own
    reduce_scatter takes 2.9x as long for 2 MB on 2 ranks (2.81 ms against 0.98) and 1.5x for 32 MB (35.7
    against 24.0): bench/collective_latency.py's `reduce_scatter_ms`. CommDebugMode counts it as the
    reduce_scatter it stands for."""
    if op != dist.ReduceOp.SUM or stacked.device.type != "cpu" or dist.get_backend(group) != "gloo":
        return dist.reduce_scatter_single(out, stacked, op=op, group=group, async_op=async_op)
    received = stacked.new_empty((group.size(), *out.shape))
    with counted_as(torch.ops.c10d_functional.reduce_scatter_tensor):
        work = dist.all_to_all_single(received, stacked, group=group, async_op=async_op)
    if async_op:
        return _SummedAllToAll(work, received, out)
    torch.sum(received, 0, out=out)
    return None


def all_reduce(
    local: torch.Tensor, reduce_op: str, group: ProcessGroup, group_size: int, *, async_op: bool = False
) -> torch.Tensor:
    """Reduce `local` over the group into a new tensor (the input is left untouched).

    `async_op`: return at once a PendingTensor (async_tensor.py) that waits on first use.
    """
    local = wait_all(local)  # a collective reads its input now: an async result must have landed
    out = _start_reduce(local, reduce_op)
    if traced():
        out = _functional.wait_tensor(_functional.all_reduce(out, _functional_reduce_op(reduce_op), group.group_name))
        return _finish_reduce(out, reduce_op, group_size)
    work = dist.all_reduce(out, op=_dist_op(reduce_op), group=group, async_op=async_op)
    return pending(work, out, lambda t: _finish_reduce(t, reduce_op, group_size))


def all_ranks_agree(flag: bool, device: torch.device, group: ProcessGroup | None = None) -> bool:
    """The logical AND of `flag` over every rank of `group` (default: the world), a 1-element MIN all-reduce.

    torch.equal's answer, as torch's DTensor computes it: every rank of the world joins, those
    outside the DTensor's mesh with True, so they learn the answer too.
    """
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def all_gather(
    local: torch.Tensor, dim: int, group: ProcessGroup, sizes: list[int], *, async_op: bool = False
) -> torch.Tensor:
    """Concatenate every rank's `local` along `dim`; `sizes[r]` is rank r's length on `dim`.

    `async_op` returns a PendingTensor where the gathered buffer is the result as it lands (even
    shards on dim 0); other layouts need a copy after the wait, and so wait here.
    """
    local = wait_all(local)  # a collective reads its input now: an async result must have landed
    n, full = len(sizes), max(sizes)
    if full == 0:  # every shard is empty: nothing to move
        shape = list(local.shape)
        shape[dim] = 0
        return local.new_empty(shape)
    padded = _pad_dim(local, dim, full).contiguous()
    direct = dim == 0 and all(s == full for s in sizes)
    if traced():
        out, work = _functional.wait_tensor(_functional.all_gather_into_tensor(padded, n, group.group_name)), None
    else:
        out = padded.new_empty((n * padded.shape[0], *padded.shape[1:]))
        work = dist.all_gather_single(out, padded, group=group, async_op=async_op and direct)
    if direct:
        return pending(work, out)
    pieces = [c.narrow(dim, 0, s) for c, s in zip(out.chunk(n), sizes)]
    return torch.cat(pieces, dim=dim)


def reduce_scatter(
    local: torch.Tensor, dim: int, reduce_op: str, group: ProcessGroup, index: int, *, async_op: bool = False
) -> torch.Tensor:
    """Reduce `local` over the group and keep chunk `index` along `dim` (torch.chunk semantics).

    `async_op` returns a PendingTensor when this rank's chunk is the whole output buffer (even
    shards); otherwise it waits here.
    """
    local = wait_all(local)  # a collective reads its input now: an async result must have landed
    n = group.size()
    size = local.shape[dim]
    full = -(-size // n) if size else 0
    my_size, _ = chunk_size_and_offset(size, n, index)
    if full == 0:
        return all_reduce(local, reduce_op, group, n)  # empty along dim: only the shape matters
    if norm_order(reduce_op) is not None:
        local = _start_reduce(local, reduce_op)  # |x|**p; the zero padding below adds nothing to it
    padded = _pad_dim(local, dim, full * n)
    stacked = padded if dim == 0 else torch.cat(padded.chunk(n, dim=dim), dim=0)
    stacked = stacked.contiguous()
    if traced():
        out = _finish_reduce(_traced_reduce_scatter(stacked, _functional_reduce_op(reduce_op), group), reduce_op, n)
        return out.narrow(dim, 0, my_size).contiguous() if my_size != full else out
    out = stacked.new_empty((stacked.shape[0] // n, *stacked.shape[1:]))
    if async_op and my_size == full:
        work = _reduce_scatter_single(out, stacked, _dist_op(reduce_op), group, async_op=True)
        return pending(work, out, lambda t: _finish_reduce(t, reduce_op, n))
    _reduce_scatter_single(out, stacked, _dist_op(reduce_op), group, async_op=False)
    out = _finish_reduce(out, reduce_op, n)  # already shaped like one chunk of `padded`
    return out.narrow(dim, 0, my_size).contiguous() if my_size != full else out  # torch's shards are contiguous


def all_to_all(
    local: torch.Tensor, src_dim: int, dst_dim: int, group: ProcessGroup, index: int, logical_shape: list[int]
) -> torch.Tensor:
    """Move sharding from `src_dim` to `dst_dim`: S(src) -> S(dst) with one all_to_all_single.

    `logical_shape` is the shape this mesh dim splits. Rank r sends to rank k the k-th chunk of its
    shard along `dst_dim`; pieces travel flattened with `src_dim` leading, so the receiver's
    concatenation of pieces is already the concatenation along `src_dim`. No padding is sent.
    """
    local = wait_all(local)  # a collective reads its input now: an async result must have landed
    n = group.size()
    src_sizes = chunk_sizes(logical_shape[src_dim], n)
    dst_sizes = chunk_sizes(logical_shape[dst_dim], n)
    other = math.prod(s for d, s in enumerate(local.shape) if d not in (src_dim, dst_dim))
    leading = local.movedim(src_dim, 0)
    moved_dst = dst_dim + 1 if dst_dim < src_dim else dst_dim  # dst's index after the movedim
    send = torch.cat([p.reshape(-1) for p in leading.split(dst_sizes, dim=moved_dst)])
    my_dst = dst_sizes[index]
    output_splits = [s * other * my_dst for s in src_sizes]
    input_splits = [src_sizes[index] * other * d for d in dst_sizes]
    if traced():
        recv = functional_all_to_all(send, output_splits, input_splits, group)
    else:
        recv = send.new_empty(logical_shape[src_dim] * other * my_dst)
        dist.all_to_all_single(
            recv, send, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group
        )
    out_shape = list(leading.shape)
    out_shape[0], out_shape[moved_dst] = logical_shape[src_dim], my_dst
    return recv.view(out_shape).movedim(0, src_dim).contiguous()


def all_to_all_rows(
    local: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Send rows [sum(input_splits[:k]), +input_splits[k]) of `local` to group rank k and return the rows every
    rank sent here, rank-major (`output_splits[k]` of them from rank k): uneven splits, nothing padded. A
    functional collective (`_c10d_functional.all_to_all_single` and its wait), so CommDebugMode counts it and
    torch.compile can trace it. Expert parallelism's token dispatch and combine."""
    return functional_all_to_all(wait_all(local), output_splits, input_splits, group)


def broadcast(tensor: torch.Tensor, group: ProcessGroup, group_src: int) -> torch.Tensor:
    """Overwrite `tensor` (in place, contiguous) with group rank `group_src`'s copy."""
    tensor = wait_all(tensor)  # a collective reads its input now: an async result must have landed
    dist.broadcast(tensor, group=group, group_src=group_src)
    return tensor


def scatter_chunks(tensor: torch.Tensor, dim: int, group: ProcessGroup, index: int, group_src: int) -> torch.Tensor:
    """Chunk `tensor` along `dim` on the source rank and send rank r its chunk r.

    Only the source's `tensor` is read; the others need only the same shape.
    """
    tensor = wait_all(tensor)  # a collective reads its input now: an async result must have landed
    n = group.size()
    sizes = chunk_sizes(tensor.shape[dim], n)
    full = max(sizes)
    shape = list(tensor.shape)
    shape[dim] = full
    out = tensor.new_empty(shape)
    if full:
        chunks = None
        if index == group_src:
            chunks = [_pad_dim(c, dim, full).contiguous() for c in tensor.split(sizes, dim=dim)]
        dist.scatter(out, chunks, group=group, group_src=group_src)
    return out.narrow(dim, 0, sizes[index]).contiguous() if sizes[index] != full else out


def exchange(
    sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]], group: ProcessGroup
) -> None:
    """Point to point within `group`: send each tensor to its group rank and fill each buffer from its group
    rank, all posted as one batch (`batch_isend_irecv`); returns when every transfer has completed. Each pair
    of ranks exchanges at most one tensor each way per call (the pairs then need no tags)."""
    ops = [dist.P2POp(dist.isend, wait_all(t).contiguous(), group=group, group_peer=peer) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer) for peer, buffer in receives]
    if ops:
        wait_point_to_point(dist.batch_isend_irecv(ops), group, "a halo exchange")


def group_timeout(group: ProcessGroup) -> timedelta | None:
    """The group's collective timeout as it stands now (`_set_pg_timeout` moves it: the trainer sets
    comm.train_timeout_seconds after the first step); None where the backend keeps no options (the fake one)."""
    for device in group._device_types:
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def wait_point_to_point(works: list[Any], group: ProcessGroup, what: str) -> None:
    """Wait for posted sends and receives within the group's timeout. gloo's point-to-point works wait, unless
    told otherwise, on the timeout the group was created with (comm.init_timeout_seconds), not the one it has
    now: a hung peer would be found minutes late. A transfer past its bound raises TimeoutError naming it."""
    timeout = group_timeout(group)
    for work in works:
        try:
            work.wait() if timeout is None else work.wait(timeout)
        except RuntimeError as error:  # gloo: "Timed out waiting ...", or "Application timeout caused pair
            # closure" when another transfer on the same pair timed out first
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise
            seconds = timeout.total_seconds() if timeout is not None else float("nan")
            raise TimeoutError(
                f"{what} did not complete within {seconds:.0f} s (the group's timeout: comm.train_timeout_seconds "
                f"after the first step, comm.init_timeout_seconds before it): a peer rank is hung or gone"
            ) from error


def all_gather_object(obj: object, group: ProcessGroup) -> list[object]:
    """Every rank's `obj` (pickled); for rare metadata checks only."""
    out: list[object] = [None] * group.size()
    dist.all_gather_object(out, obj, group=group)
    return out


@dataclass(slots=True)
class InFlight:
    """A flat collective issued with async_op: `wait()` completes it and returns the result.

    gloo runs the collective on its own threads and NCCL on its stream, so compute between the
    call and `wait()` overlaps it. The input stays referenced until then (the backend reads it).
    """

    out: torch.Tensor
    work: Any
    source: torch.Tensor
    divisor: int = 1

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.divisor > 1:  # gloo has no AVG: SUM, then divide (once)
            self.out.div_(self.divisor)
            self.divisor = 1
        return self.out


def all_gather_flat(local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's 1-D `local` (all of the same numel), concatenated rank-major: (n * numel,).

    FSDP packs a whole parameter group's padded shards into `local`, so one call unshards the group.
    """
    return start_all_gather_flat(local, group).wait()


def start_all_gather_flat(local: torch.Tensor, group: ProcessGroup, *, async_op: bool = False) -> InFlight:
    """all_gather_flat, returned in flight (`async_op`) or complete."""
    assert local.ndim == 1, f"all_gather_flat takes a 1-D buffer, got shape {tuple(local.shape)}"
    local = wait_all(local).contiguous()
    out = local.new_empty(group.size() * local.numel())
    work = dist.all_gather_single(out, local, group=group, async_op=async_op)
    return InFlight(out, work if async_op else None, local)


def start_all_reduce_flat(flat: torch.Tensor, group: ProcessGroup, *, async_op: bool = False) -> InFlight:
    """SUM the 1-D `flat` over the group in place (DDP's gradient buckets, pre-scaled by 1/n), in flight
    (`async_op`) or complete; `wait()` returns `flat` itself."""
    assert flat.ndim == 1 and flat.is_contiguous(), "start_all_reduce_flat takes a contiguous 1-D buffer"
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return InFlight(flat, work if async_op else None, flat)


def reduce_scatter_flat(flat: torch.Tensor, reduce_op: str, group: ProcessGroup) -> torch.Tensor:
    """Reduce the rank-major 1-D `flat` (n * k,) over the group and keep this rank's chunk: (k,).

    `reduce_op` is "sum" or "avg" (a SUM then a division, since gloo has no AVG).
    """
    return start_reduce_scatter_flat(flat, reduce_op, group).wait()


def start_reduce_scatter_flat(
    flat: torch.Tensor, reduce_op: str, group: ProcessGroup, *, async_op: bool = False
) -> InFlight:
    """reduce_scatter_flat, returned in flight (`async_op`) or complete."""
    n = group.size()
    assert flat.ndim == 1 and flat.numel() % n == 0, f"reduce_scatter_flat needs a 1-D buffer divisible by {n}"
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter_flat supports reduce_op 'sum' or 'avg', got {reduce_op!r}")
    flat = flat.contiguous()
    out = flat.new_empty(flat.numel() // n)
    work = _reduce_scatter_single(out, flat, dist.ReduceOp.SUM, group, async_op)
    return InFlight(out, work, flat, n if reduce_op == "avg" else 1)
