"""Shared helpers for DTensor tests.

Inside ranks (see tests/world.py):
- `get_mesh(shape)` / `get_torch_mesh(shape)`: meshes cached per rank process, so the long-lived
  test worlds do not create process groups for every test.
- `placement_choices(ndim, mesh_ndim)`: every placement tuple of R / S(d) (and P(sum) if asked).
- `check_op(fn, inputs, mesh)`: runs `fn` on DTensors under many placements of each input and
  compares `full_tensor()` of the outputs and of the input gradients with the single-device run.
- `placements_and_collectives(fn, args, want)`: a DTensor call's output placements and collective count.
- `run_ours_and_torch(fn, ours_args, theirs_args)`: one call on our DTensor and on torch's, counted.
- `expect_error(what, fn, error, needle)`: a failure line unless `fn()` raises a helpful error.
- `as_partial(dt, placements)`: the same global value with Partial placements (public
  `redistribute` never makes a Partial, as torch's; tests build pending sums with this).

In the test process:
- `MESHES` / `run_on_meshes(fn)`: the standard sweep over meshes (2,), (4,), (2, 2).
- `assert_no_failures(results)`: for rank functions that return a list of failure lines.
- `FakeMesh` / `make_spec(shape, *placements)`: hand-built specs for single-process rule tests.

Anywhere: `to_torch_placements(placements)` (ours -> torch's DTensor placements) and
`chunk_local(t, mesh_shape, coordinate, placements)` (the torch.chunk reference for a shard).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parallelisms.dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.spec import DTensorSpec, TensorMeta, dense_stride_like, is_dense, stride_order
from tests.world import run_world

# (mesh shape, world size) of the standard sweep: 1-D even and uneven, and nested 2-D sharding
MESHES = (((2,), 2), ((4,), 4), ((2, 2), 4))

_MESHES: dict[tuple, DeviceMesh] = {}
_TORCH_MESHES: dict[tuple, object] = {}


def get_mesh(shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    key = (tuple(shape), tuple(names) if names else None)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]


def get_torch_mesh(shape: Sequence[int], names: Sequence[str] | None = None):
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    key = (tuple(shape), tuple(names) if names else None)
    if key not in _TORCH_MESHES:
        _TORCH_MESHES[key] = torch_init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _TORCH_MESHES[key]


def as_partial(dt: DTensor, placements: Sequence) -> DTensor:
    """`dt` moved to `placements`, Partial ones included: each rank keeps its piece of a Replicate
    value (R -> P moves no data), differentiably, through the internal redistribution."""
    from parallelisms.dtensor.redistribute import Redistribute

    return Redistribute.apply(dt, tuple(placements), False)


def placement_choices(ndim: int, mesh_ndim: int, *, partial: bool = False) -> list[tuple]:
    per_dim = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if partial else [])
    return list(itertools.product(per_dim, repeat=mesh_ndim))


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _flat_tensors(out) -> list:
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat_tensors(o)]
    return [out] if isinstance(out, torch.Tensor) else []


def check_op(
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    mesh: DeviceMesh,
    *,
    grad: bool = True,
    partial: bool = False,
    max_combos: int = 64,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
    shardable: Sequence[bool] | None = None,
) -> int:
    """Compare `fn` on DTensors with `fn` on plain tensors for many input placements.

    Every input is a global tensor; floating inputs get gradients when `grad`. Combos beyond
    `max_combos` are sampled (same sample on every rank). Inputs with `shardable[i] == False`
    stay replicated (e.g. integer index tensors that a rule requires replicated).
    Returns the number of placement combos checked; raises AssertionError naming the combo.
    """
    ref_inputs = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in inputs]
    ref_out = fn(*ref_inputs)
    ref_leaves = _flat_tensors(ref_out)
    weights = [
        torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + i), dtype=o.dtype)
        if o.is_floating_point()
        else None
        for i, o in enumerate(ref_leaves)
    ]
    if grad:
        loss = sum((o * w).sum() for o, w in zip(ref_leaves, weights) if w is not None and o.requires_grad)
        ref_grads = (
            torch.autograd.grad(loss, [t for t in ref_inputs if t.requires_grad], allow_unused=True)
            if torch.is_tensor(loss)
            else []
        )
    choices = [
        placement_choices(t.ndim, mesh.ndim, partial=partial and t.is_floating_point())
        if (shardable is None or shardable[i])
        else [tuple([Replicate()] * mesh.ndim)]
        for i, t in enumerate(inputs)
    ]
    combos = list(itertools.product(*choices))
    if len(combos) > max_combos:
        combos = random.Random(seed).sample(combos, max_combos)
    for combo in combos:
        d_inputs = [
            distribute_tensor(t.detach(), mesh, p).requires_grad_(grad and t.is_floating_point())
            for t, p in zip(inputs, combo)
        ]
        what = f"placements {[tuple(map(str, p)) for p in combo]} on mesh {mesh.shape}"
        try:
            out = fn(*d_inputs)
            leaves = _flat_tensors(out)
            assert len(leaves) == len(ref_leaves), f"{len(leaves)} outputs, expected {len(ref_leaves)}"
            for i, o in enumerate(leaves):
                assert_layout_agrees(o, f"output {i}")
            fulls = [_full(o) for o in leaves]
            for got, want in zip(fulls, ref_leaves):
                torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol)
            if grad and ref_grads:
                loss = sum(
                    (f * w).sum() for f, w, o in zip(fulls, weights, ref_leaves) if w is not None and o.requires_grad
                )
                got_grads = torch.autograd.grad(loss, [t for t in d_inputs if t.requires_grad], allow_unused=True)
                for g, want in zip(got_grads, ref_grads):
                    if want is None:
                        continue
                    assert g is not None, "missing gradient"
                    assert_layout_agrees(g, "gradient")
                    torch.testing.assert_close(_full(g), want, atol=atol, rtol=rtol)
        except Exception as e:
            if torch_refuses_alike(fn, d_inputs, {}, e):
                continue  # a view torch's DTensor refuses too, with the same message (strict view)
            raise AssertionError(f"{getattr(fn, '__name__', fn)} failed for {what}: {type(e).__name__}: {e}") from e
    return len(combos)


STRICT_VIEW_ERRORS = ("Cannot flatten unevenly sharded tensor", "Cannot unflatten unevenly sharded tensor")


def torch_refuses_alike(fn: Callable, args: Sequence, kwargs: dict, error: Exception) -> bool:
    """Whether `error` is a strict-view refusal that torch's DTensor makes too, word for word, on the same
    shards (every DTensor in `args` / `kwargs` rebuilt on a torch mesh of the same shape): then refusing is
    parity, not a failure."""
    if not isinstance(error, RuntimeError) or not str(error).startswith(STRICT_VIEW_ERRORS):
        return False
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.utils._pytree import tree_flatten, tree_map

    ours = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, DTensor)).device_mesh
    mesh = get_torch_mesh(tuple(ours.shape))

    def theirs(t: object) -> object:
        if not isinstance(t, DTensor):
            return t
        return TorchDTensor.from_local(t._local_tensor.detach().clone(), mesh, to_torch_placements(t.placements),
                                       shape=t.shape, stride=t.stride())  # fmt: skip

    try:
        fn(*tree_map(theirs, tuple(args)), **tree_map(theirs, kwargs))
    except RuntimeError as e:
        return str(e).split("\n\n")[0] == str(error)  # torch appends the op it was propagating
    return False


def assert_layout_agrees(t: torch.Tensor, what: str) -> None:
    """A DTensor's reported strides must lay its dims out in the order its shard's strides do, so
    that reshape/view decompositions take the path on the shard that they take on one device."""
    if not isinstance(t, DTensor):
        return
    local = t._local_tensor
    if local.numel() == 0 or local.ndim != t.ndim or not is_dense(t.shape, t.stride()):
        return
    want = stride_order(local.shape, dense_stride_like(t.stride(), local.shape))
    got = stride_order(local.shape, local.stride())
    assert got == want, (
        f"{what}: DTensor strides {t.stride()} (shape {tuple(t.shape)}) disagree with its shard's "
        f"{local.stride()} (shape {tuple(local.shape)})"
    )


def placements_and_collectives(
    fn: Callable[..., DTensor],
    args: Sequence,
    want: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> tuple[tuple[str, ...], int]:
    """Run `fn(*args)` under CommDebugMode, check its full tensor against `want`, and return its
    output placements (as strings) and the number of collectives it issued."""
    with CommDebugMode() as comm:
        out = fn(*args)
    torch.testing.assert_close(out.full_tensor(), want, atol=atol, rtol=rtol)
    return tuple(map(str, out.placements)), comm.get_total_counts()


def run_ours_and_torch(
    fn: Callable,
    ours_args: Sequence,
    theirs_args: Sequence,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> tuple[DTensor, Any, CommDebugMode, CommDebugMode]:
    """`fn` on our DTensors and on torch's, each under CommDebugMode; their full values must agree.

    Returns (our output, torch's output, our CommDebugMode, torch's CommDebugMode) for the caller
    to compare placements, collectives and bytes.
    """
    with CommDebugMode() as ours:
        out = fn(*ours_args)
    with CommDebugMode() as theirs:
        tout = fn(*theirs_args)
    torch.testing.assert_close(out.full_tensor(), tout.full_tensor(), atol=atol, rtol=rtol)
    return out, tout, ours, theirs


def expect_error(what: str, fn: Callable[[], object], error: type[Exception], needle: str) -> list[str]:
    """[] if `fn()` raises `error` with `needle` in its message, else one failure line about `what`.

    Any other exception propagates.
    """
    try:
        fn()
    except error as e:
        return [] if needle in str(e) else [f"unhelpful error from {what}: {e}"]
    return [f"{what} did not raise"]


# --------------------------------------------------------------------------------------------------
# in the test process: mesh sweeps, fake meshes for rule tests
# --------------------------------------------------------------------------------------------------


def run_on_meshes(fn: Callable, meshes: Sequence[tuple[tuple[int, ...], int]] = MESHES) -> Iterator:
    """Every rank's result of `fn(mesh_shape)`, world by world over (mesh shape, world size) `meshes`.

    Lazy: a test that asserts on each result stops before the next world runs, as a loop would.
    """
    for mesh_shape, world_size in meshes:
        yield from run_world(fn, world_size, mesh_shape)


def assert_no_failures(results: Iterable[list[str]]) -> None:
    """Fail on the first rank's non-empty list of failure lines (the results of a world, in rank order)."""
    for failures in results:
        assert not failures, failures


@dataclass(frozen=True)
class FakeMesh:
    """Just what rules read from a mesh: its shape and this rank's coordinate (default all 0)."""

    shape: tuple[int, ...]
    coordinate: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, mesh_dim: int | None = None) -> int:
        return self.shape[mesh_dim] if mesh_dim is not None else math.prod(self.shape)

    def get_coordinate(self) -> list[int]:
        return list(self.coordinate) if self.coordinate is not None else [0] * self.ndim


def make_spec(
    shape: Sequence[int], *placements, mesh: FakeMesh | None = None, dtype: torch.dtype = torch.float32
) -> DTensorSpec:
    """A contiguous spec of global `shape`; by default on a FakeMesh of size 2 per placement."""
    mesh = FakeMesh((2,) * len(placements)) if mesh is None else mesh
    meta = TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype)
    return DTensorSpec(mesh, tuple(placements), meta)


# --------------------------------------------------------------------------------------------------
# anywhere: torch's placements, reference shards
# --------------------------------------------------------------------------------------------------


def to_torch_placements(placements: Sequence) -> list:
    """Our placements as torch.distributed.tensor placements (Partial keeps its reduce op)."""
    from torch.distributed import tensor as tdt

    def convert(p):
        if isinstance(p, Shard):
            return tdt.Shard(p.dim)
        return tdt.Partial(p.reduce_op) if isinstance(p, Partial) else tdt.Replicate()

    return [convert(p) for p in placements]


def chunk_local(t: torch.Tensor, mesh_shape: Sequence[int], coordinate: Sequence[int], placements) -> torch.Tensor:
    """The shard of `t` at `coordinate`: torch.chunk per sharding mesh dim, in mesh order (an empty
    narrow at the end where torch.chunk gives fewer pieces than ranks), made contiguous."""
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = t.chunk(mesh_shape[m], dim=p.dim)
            i = coordinate[m]
            t = chunks[i] if i < len(chunks) else t.narrow(p.dim, t.shape[p.dim], 0)
    return t.contiguous()
