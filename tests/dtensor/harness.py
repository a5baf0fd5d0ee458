"""Shared helpers for DTensor tests that run inside ranks (see tests/world.py).

- `get_mesh(shape)` / `get_torch_mesh(shape)`: meshes cached per rank process, so the long-lived
  test worlds do not create process groups for every test.
- `placement_choices(ndim, mesh_ndim)`: every placement tuple of R / S(d) (and P(sum) if asked).
- `check_op(fn, inputs, mesh)`: runs `fn` on DTensors under many placements of each input and
  compares `full_tensor()` of the outputs and of the input gradients with the single-device run.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import torch

from parallelisms.dtensor import DTensor, DeviceMesh, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

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
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + i), dtype=o.dtype)
               if o.is_floating_point() else None for i, o in enumerate(ref_leaves)]
    if grad:
        loss = sum((o * w).sum() for o, w in zip(ref_leaves, weights) if w is not None and o.requires_grad)
        ref_grads = torch.autograd.grad(loss, [t for t in ref_inputs if t.requires_grad], allow_unused=True) if torch.is_tensor(loss) else []
    choices = [
        placement_choices(t.ndim, mesh.ndim, partial=partial and t.is_floating_point())
        if (shardable is None or shardable[i]) else [tuple([Replicate()] * mesh.ndim)]
        for i, t in enumerate(inputs)
    ]
    combos = list(itertools.product(*choices))
    if len(combos) > max_combos:
        combos = random.Random(seed).sample(combos, max_combos)
    for combo in combos:
        d_inputs = [distribute_tensor(t.detach(), mesh, p).requires_grad_(grad and t.is_floating_point())
                    for t, p in zip(inputs, combo)]
        what = f"placements {[tuple(map(str, p)) for p in combo]} on mesh {mesh.shape}"
        try:
            out = fn(*d_inputs)
            leaves = _flat_tensors(out)
            assert len(leaves) == len(ref_leaves), f"{len(leaves)} outputs, expected {len(ref_leaves)}"
            fulls = [_full(o) for o in leaves]
            for got, want in zip(fulls, ref_leaves):
                torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol)
            if grad and ref_grads:
                loss = sum((f * w).sum() for f, w, o in zip(fulls, weights, ref_leaves) if w is not None and o.requires_grad)
                got_grads = torch.autograd.grad(loss, [t for t in d_inputs if t.requires_grad], allow_unused=True)
                for g, want in zip(got_grads, ref_grads):
                    if want is None:
                        continue
                    assert g is not None, "missing gradient"
                    torch.testing.assert_close(_full(g), want, atol=atol, rtol=rtol)
        except Exception as e:
            raise AssertionError(f"{getattr(fn, '__name__', fn)} failed for {what}: {type(e).__name__}: {e}") from e
    return len(combos)
