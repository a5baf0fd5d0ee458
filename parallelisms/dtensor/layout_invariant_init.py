"""layout_invariant_init(): random initialization whose global values do not depend on the layout.

A model built on the meta device, parallelized (TP, FSDP, any mesh) and then allocated with
`to_empty` must get the weights one process would have, or runs on different layouts train
different models and a seed checkpoint becomes necessary (torchtitan's). Inside the context,
`Tensor.uniform_` and `Tensor.normal_` (and so `nn.init.uniform_`, `normal_`, `trunc_normal_`,
`kaiming_uniform_`, ..., which draw with them) fill each element from the blocked counter-based
stream behind `rand`/`randn` (factories.py): the value at a global index depends only on the seed
and the index. A DTensor draws only its shard's blocks, at its exact global offset (uneven and `_StridedShard` shards
included); a plain tensor is its own global tensor. Later pointwise steps of an init (erfinv, mul,
clamp in trunc_normal_) are elementwise, so they agree bit for bit too.

Every rank must be seeded alike and run the same fills in the same order (each fill draws one base
seed from the default CPU generator), as SPMD programs do. Fills given an explicit `generator=` are
left to torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .dtensor import DTensor, local_tensor
from .factories import _base_seed, _blocked


class layout_invariant_init(TorchFunctionMode):
    """Context manager: uniform_/normal_ fills give the same global values on any layout.

    `nn.init.trunc_normal_` is swapped for the inverse-CDF sampler while the context is active:
    torch 2.13's rejection sampler redraws whole tensors with `torch.where` until no sample lies
    outside [a, b], holding tensor-sized temporaries (2.4x the shards at init peak on a 4-rank
    FSDP); sampling each chunk of rows as uniform -> erfinv -> scale -> clamp needs none.
    """

    def __enter__(self) -> layout_invariant_init:
        nn.init.trunc_normal_ = _trunc_normal_
        return super().__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        nn.init.trunc_normal_ = _TORCH_TRUNC_NORMAL
        super().__exit__(*exc_info)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS and kwargs.get("generator") is None:
            return _FILLS[func](*args, **kwargs)
        return func(*args, **kwargs)


def _uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, **kwargs: Any) -> torch.Tensor:
    a, b = kwargs.pop("from", a), kwargs.pop("to", b)  # Tensor.uniform_(from=, to=) by keyword
    return _fill(tensor, torch.rand, lambda v: v.mul(b - a).add_(a))


def _normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, **_: Any) -> torch.Tensor:
    return _fill(tensor, torch.randn, lambda v: v.mul(std).add_(mean))


def _trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, generator: Any = None
) -> torch.Tensor:
    """N(mean, std) truncated to [a, b] by the inverse CDF, from the layout-invariant stream."""
    if generator is not None:
        return _TORCH_TRUNC_NORMAL(tensor, mean, std, a, b, generator=generator)
    if tensor.is_meta:  # a stand-in (a pipeline stage's absent module): its draw keeps the stream in step
        _base_seed()
        return tensor
    low, high = (_norm_cdf((x - mean) / std) for x in (a, b))

    def transform(v: torch.Tensor) -> torch.Tensor:  # v uniform in [0, 1)
        v = v.mul(2 * (high - low)).add_(2 * low - 1)  # uniform in [2 low - 1, 2 high - 1)
        return v.erfinv_().mul_(std * math.sqrt(2.0)).add_(mean).clamp_(min=a, max=b)

    return _fill(tensor, torch.rand, transform)


def _norm_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


_TORCH_TRUNC_NORMAL = nn.init.trunc_normal_


def _fill(tensor: torch.Tensor, draw: Any, transform: Any) -> torch.Tensor:
    """Write this rank's part of the global stream, through `transform`, into its shard, a group
    of rows at a time (no shard-sized temporary: init peaks near the shards themselves)."""
    base = _base_seed()  # drawn on every rank, shard or not, so the generators stay in step
    if local_tensor(tensor).is_meta:  # nothing to write (a stand-in): the draw alone keeps later fills in place
        return tensor
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return tensor
        shape, offset = tensor._spec.local_shape_and_offset()
    else:
        shape, offset = tuple(tensor.shape), (0,) * tensor.ndim
    local = local_tensor(tensor)
    with torch.no_grad():
        _blocked(
            draw, base, shape, offset, local.dtype, local.device, tuple(tensor.shape), out=local, transform=transform
        )
    return tensor


def _init_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> torch.Tensor:
    return _normal_(tensor, mean, std)


def _init_uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None) -> torch.Tensor:
    return _uniform_(tensor, a, b)


def _init_kaiming_uniform_(
    tensor: torch.Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu", generator: Any = None
) -> torch.Tensor:
    """nn.init.kaiming_uniform_'s bound (He et al. 2015), from the global shape."""
    gain = nn.init.calculate_gain(nonlinearity, a)  # type: ignore[arg-type]
    fan = nn.init._calculate_correct_fan(tensor, mode)  # type: ignore[arg-type]
    bound = math.sqrt(3.0) * gain / math.sqrt(fan)
    return _uniform_(tensor, -bound, bound)


# Tensor methods, and the random nn.init functions that hand themselves to torch-function modes
# (their inner Tensor calls would then run with this mode switched off, so they are done here;
# nn.init.constant_ does the same but draws nothing, so torch's own runs).
_FILLS: dict[Any, Any] = {
    torch.Tensor.uniform_: _uniform_,
    torch.Tensor.normal_: _normal_,
    nn.init.normal_: _init_normal_,
    nn.init.uniform_: _init_uniform_,
    nn.init.kaiming_uniform_: _init_kaiming_uniform_,
}
