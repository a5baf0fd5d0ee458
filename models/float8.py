"""Float8 training of linear layers with tensorwise dynamic scaling: torchao's default recipe, which
torchtitan turns on with `model.converters = ["float8"]`.

Each of a linear's three matmuls runs in float8 (`torch._scaled_mm`), its operands cast just before it:

    forward      y      = x_e4m3 @ w_e4m3.T
    backward     grad_x = g_e5m2 @ w_e4m3
                 grad_w = g_e5m2.T @ x_e4m3

A cast scales the whole tensor so that its largest magnitude lands on the format's largest finite value
(448 for e4m3, 57344 for e5m2) and rounds; the matmul multiplies the inverse scales back in
and accumulates in the output's dtype. As torchao's, the scale is computed in float64 from the amax and
rounded to float32, and the forward saves the high-precision operands, not their float8 copies (which
would add a byte per element where the input is kept anyway); the backward casts them again with the
forward's scales (saved): the same bytes, without a second amax.

The code is plain torch, so it runs on DTensors as it does on one device: under tensor parallelism the
amax of a sharded weight, activation or gradient is a `Partial("max")`, all-reduced once (a scalar), which
makes every rank's cast the one device's cast bit for bit; TP communicates no float8 tensor. FSDP can gather
the weights in float8 instead of casting after the gather (`Float8AllGather`, torchtitan's
`enable_fsdp_float8_all_gather`): the linear then reads the gathered weight and its inverse scale, and saves
that e4m3 weight for the backward (FSDP frees it and gathers it again). On the CPU `torch._scaled_mm`
dequantizes and multiplies in float32, exactly what `emulate` does; CUDA needs sm_89 or newer (H100, L4, B200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn  # operands of the forward (inputs and weights): more mantissa
E5M2 = torch.float8_e5m2  # gradients: more range
AMAX_EPS = 1e-12  # torchao's floor under the amax: an all-zero tensor gets a finite scale


def float8_scale(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise scale that maps `t`'s largest magnitude onto `dtype`'s largest value, and its inverse
    (what turns the float8 values back into `t`'s): float32, shape (1,), computed as torchao does."""
    # the amax in one pass, accumulated in float64 (exact: a max), which the scale's division wants anyway
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float64)
    if hasattr(amax, "full_tensor"):  # a DTensor's (a Partial("max") when t is sharded): all-reduced once, and
        amax = amax.full_tensor()  # the scalar arithmetic below runs on a plain tensor (replicated implicitly)
    return scale_from_amax(amax, dtype, t.dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, source: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and inverse scale (float32, shape (1,)) of a `source`-dtype tensor whose float64 amax is
    `amax` (any shape of one element), cast to the float8 `dtype`."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.reshape(1), min=AMAX_EPS)).to(torch.float32)
    if source is torch.float16:  # the scaled values must stay finite in the input's own dtype
        scale = torch.clamp(scale, max=torch.finfo(torch.float16).max)
    return scale, scale.reciprocal()


def cast_to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` x `scale` in float32, rounded to `dtype`: torchao's `(t.to(float32) * scale)`, saturated, cast.

    Two passes instead of four: the scale being a 1-element (not 0-d) tensor makes the product float32 in
    one kernel that reads `t` as it is, and no clamp is needed, because the scale comes from this tensor's
    own amax: |t| x scale <= amax x fl(max / amax) <= max (1 + 2^-23), which rounds to max in either format
    (e4m3's next value is 480, e5m2's is inf past 61440), the bytes a saturating clamp would give.
    """
    return torch.mul(t, scale).to(dtype)


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` cast to the float8 `dtype` with one scale for the whole tensor, and the inverse scale."""
    scale, inverse = float8_scale(t, dtype)
    return cast_to_float8(t, scale, dtype), inverse


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix with column-major strides: the layout `_scaled_mm` wants for its second operand."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def scaled_mm(
    a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype, emulate: bool
) -> torch.Tensor:
    """(a x a_inv) @ (b x b_inv) from float8 operands; `emulate` dequantizes and multiplies in float32 (what
    the CPU kernel does, and the only way on GPUs older than sm_89)."""
    if emulate:
        return ((a.to(torch.float32) * a_inv) @ (b.to(torch.float32) * b_inv)).to(out_dtype)
    a = a if a.stride(1) == 1 else a.contiguous()  # row-major first operand
    return torch._scaled_mm(a, _column_major(b), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """x @ w.T (x 2-D) with each of the three matmuls in float8 (the module docstring). `precast`: the weight
    already in e4m3 with its inverse scale (FSDP's float8 all-gather); `weight` is then only the leaf that
    receives the gradient, and its data is never read."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, emulate: bool, precast: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        x_scale, x_inv = float8_scale(x, E4M3)
        if precast is None:
            w_scale, w_inv = float8_scale(weight, E4M3)
            w8 = cast_to_float8(weight, w_scale, E4M3)
            # the high-precision weight is kept, not w8: the backward casts it again with the kept scale
            ctx.save_for_backward(x, weight, x_scale, x_inv, w_scale, w_inv)
        else:
            (w8, w_inv), w_scale = precast, None
            ctx.save_for_backward(x, w8, x_scale, x_inv, w_scale, w_inv)  # w8: FSDP refills it for backward
        ctx.emulate, ctx.weight_dtype = emulate, weight.dtype
        return scaled_mm(cast_to_float8(x, x_scale, E4M3), x_inv, w8.t(), w_inv, x.dtype, emulate)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, x_scale, x_inv, w_scale, w_inv = ctx.saved_tensors
        g8, g_inv = to_float8(grad, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w8 = weight if w_scale is None else cast_to_float8(weight, w_scale, E4M3)
            grad_x = scaled_mm(g8, g_inv, w8, w_inv, x.dtype, ctx.emulate)
        if ctx.needs_input_grad[1]:
            x8 = cast_to_float8(x, x_scale, E4M3)
            grad_w = scaled_mm(g8.t(), g_inv, x8, x_inv, ctx.weight_dtype, ctx.emulate)
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in float8 (tensorwise scales); its parameters, state dict and
    initialization are nn.Linear's, so checkpoints, FSDP and TP plans see a linear."""

    emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        precast = getattr(weight, "precast", None)  # (e4m3 data, inverse scale): FSDP gathered it in float8
        # under autocast the matmul runs in the autocast dtype, as nn.Linear's would
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            weight = weight if precast is not None else weight.to(dtype)  # a precast weight has no data to cast
        with torch.autocast(x.device.type, enabled=False):
            y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, self.emulate, precast)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, emulate: bool = False) -> Float8Linear:
        """`linear` as a Float8Linear: the same module object and parameters, its class swapped (hooks,
        parametrizations and the meta device all stay as they were)."""
        linear.__class__ = cls
        linear.emulate = emulate  # type: ignore[assignment]
        return linear  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, float8=tensorwise{', emulate' if self.emulate else ''}"


@dataclass(frozen=True)
class Float8AllGather:
    """A Float8Linear's `fsdp_all_gather_casts = {"weight": Float8AllGather()}` (torchtitan's
    `enable_fsdp_float8_all_gather`): fully_shard casts each shard of the weight to `dtype` with the whole
    weight's tensorwise scale before the all-gather, a quarter of float32's bytes (half of bf16's), and hands
    the linear the gathered e4m3 weight and its inverse scale as the unsharded parameter's `precast`
    (parallelisms/fsdp/param.py). The bytes are those the linear would cast from the gathered weight: the
    scale comes from the max of the shards' amaxes (under TP too, over the TP shards)."""

    dtype: torch.dtype = E4M3

    def scales(self, amax: torch.Tensor, source: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return scale_from_amax(amax, self.dtype, source)


def float8_convertible(linear: nn.Linear) -> bool:
    """float8 tensor cores need every matrix dim a multiple of 16 (torchtitan's rule)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def convert_to_float8_training(
    model: nn.Module,
    *,
    filter_fqns: list[str] | tuple[str, ...] = (),
    emulate: bool = False,
    fsdp_float8_all_gather: bool = False,
) -> list[str]:
    """Make every nn.Linear of `model` a Float8Linear, except those whose FQN contains one of `filter_fqns`
    (torchtitan's substring match; e.g. ["output"]) or whose dims are not multiples of 16. Returns the
    FQNs converted. Run it before parallelizing, as torchtitan's converters run. `fsdp_float8_all_gather`:
    mark their weights for fully_shard's float8 all-gather (Float8AllGather)."""
    converted = []
    for fqn, module in model.named_modules():
        if type(module) is not nn.Linear or any(f in fqn for f in filter_fqns) or not float8_convertible(module):
            continue
        Float8Linear.from_linear(module, emulate=emulate)
        if fsdp_float8_all_gather:
            module.fsdp_all_gather_casts = {"weight": Float8AllGather()}  # type: ignore[assignment]
        converted.append(fqn)
    return converted


__all__ = [
    "E4M3",
    "E5M2",
    "Float8AllGather",
    "Float8Linear",
    "cast_to_float8",
    "convert_to_float8_training",
    "float8_scale",
    "scale_from_amax",
    "scaled_mm",
    "to_float8",
]
