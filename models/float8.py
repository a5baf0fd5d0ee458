"""Float8 training of linear layers with dynamic scaling, torchtitan's `model.converters = ["float8"]`:
tensorwise (torchao's default recipe, below) or one of torchao's rowwise recipes (`Float8Recipe`).

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

The rowwise recipes (`RECIPES`, torchao's `Float8LinearConfig.from_recipe_name`) scale the left operand of
each matmul per row and the right one per column, both over the contraction dim, so one outlier spoils only
its own row; every operand is e4m3 (gradients too) and scales are rounded down to powers of two.
"rowwise_with_gw_hp" keeps the weight gradient in high precision and casts the weight tensorwise for the
input gradient. A rowwise operand is cast along a different dim in forward and backward, so the backward
casts the saved high-precision tensors again, as torchao's does. Under tensor parallelism a row's amax over
a sharded contraction dim is one all-reduce of a vector (a `Partial("max")`); the float8 weight all-gather
is tensorwise only (torchao's rule).
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
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    emulate: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(a x a_inv) @ (b x b_inv) from float8 operands, with one inverse scale each (tensorwise) or one per row
    of `a` and per column of `b` (rowwise: (M, 1) and (1, N)); `emulate` dequantizes and multiplies in float32
    (what the CPU kernel does, and the only way on GPUs older than sm_89). Rowwise follows torchao's
    `addmm_float8_unwrapped`: the kernel writes bfloat16 for a float32 or float16 result, and a matmul without
    `fast_accum` (the two backward ones) runs the tensorwise kernel with unit scales and multiplies the scales
    in after, because the rowwise CUTLASS kernel is slow without fast accumulation."""
    if emulate:
        return ((a.to(torch.float32) * a_inv) @ (b.to(torch.float32) * b_inv)).to(out_dtype)
    a = a if a.stride(1) == 1 else a.contiguous()  # row-major first operand
    b = _column_major(b)
    if a_inv.numel() == 1:
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    kernel_dtype = torch.bfloat16 if out_dtype in (torch.float32, torch.float16) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=kernel_dtype, use_fast_accum=True)
    else:
        one = torch.ones((), dtype=torch.float32, device=a_inv.device)
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=kernel_dtype)
        out = (out * (a_inv * b_inv)).to(kernel_dtype)  # torchao's `output *= post_inverse_scale`
    return out.to(out_dtype)


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


@dataclass(frozen=True)
class Operand:
    """How one operand of one matmul is cast: to `dtype` (None: kept in high precision) with a scale per row
    of the left operand or per column of the right one (`rowwise`), or one for the whole tensor."""

    dtype: torch.dtype | None
    rowwise: bool = True


@dataclass(frozen=True)
class Float8Recipe:
    """A linear's three matmuls, each as (left, right) operand casts: `output` = x @ w.T, `grad_input` =
    g @ w, `grad_weight` = g.T @ x (torchao's `Float8LinearConfig.from_recipe_name`)."""

    name: str
    output: tuple[Operand, Operand]
    grad_input: tuple[Operand, Operand]
    grad_weight: tuple[Operand, Operand]
    power_of_2_scales: bool = True  # torchao's round_scales_to_power_of_2, on for both rowwise recipes


_ROW, _WHOLE, _HIGH = Operand(E4M3), Operand(E4M3, rowwise=False), Operand(None)
RECIPES = {
    recipe.name: recipe
    for recipe in (
        Float8Recipe("rowwise", (_ROW, _ROW), (_ROW, _ROW), (_ROW, _ROW)),
        Float8Recipe("rowwise_with_gw_hp", (_ROW, _ROW), (_ROW, _WHOLE), (_HIGH, _HIGH)),
    )
}
"""The rowwise recipes by torchtitan's `quantize.linear.float8.recipe_name`; "tensorwise" (or unset) is
`_Float8Matmul`'s, which also reuses each scale between forward and backward."""


def operand_scale(t: torch.Tensor, operand: Operand, dim: int, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale and inverse scale (float32) casting `t` as `operand` says, as the left (`dim` 1: one per
    row, shape (M, 1)) or right (`dim` 0: one per column, (1, N)) operand; (1, 1) for a whole tensor. torchao's
    `tensor_to_amax` + `amax_to_scale`: the amax in `t`'s dtype, the division in float64."""
    assert operand.dtype is not None
    amax = torch.amax(torch.abs(t), dim=dim if operand.rowwise else (0, 1), keepdim=True).to(torch.float64)
    scale = (torch.finfo(operand.dtype).max / torch.clamp(amax, min=AMAX_EPS)).to(torch.float32)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale, scale.reciprocal()


def recipe_mm(
    a: torch.Tensor, b: torch.Tensor, casts: tuple[Operand, Operand], recipe: Float8Recipe, out_dtype: torch.dtype,
    emulate: bool, fast_accum: bool,
) -> torch.Tensor:  # fmt: skip
    """a @ b with each operand cast as `casts` says; both high precision: a plain matmul."""
    cast_a, cast_b = casts
    if cast_a.dtype is None or cast_b.dtype is None:
        assert cast_a == cast_b, "an operand pair is both float8 or both high precision (torchao's rule)"
        return torch.mm(a, b).to(out_dtype)
    a_scale, a_inv = operand_scale(a, cast_a, 1, recipe.power_of_2_scales)
    b_scale, b_inv = operand_scale(b, cast_b, 0, recipe.power_of_2_scales)
    # torch's kernel takes one granularity: a whole-tensor scale repeated along the other's axis (torchao's
    # `repeat`: CUDA's rowwise kernel reads contiguous scales)
    if cast_a.rowwise and not cast_b.rowwise:
        b_inv = b_inv.expand(1, b.shape[1]).contiguous()
    elif cast_b.rowwise and not cast_a.rowwise:
        a_inv = a_inv.expand(a.shape[0], 1).contiguous()
    a8, b8 = cast_to_float8(a, a_scale, cast_a.dtype), cast_to_float8(b, b_scale, cast_b.dtype)
    return scaled_mm(a8, a_inv, b8, b_inv, out_dtype, emulate, fast_accum)


class _Float8RecipeMatmul(torch.autograd.Function):
    """x @ w.T (x 2-D) with each of the three matmuls cast as a rowwise `Float8Recipe` says; the forward
    saves the high-precision x and w and the backward casts them again along their backward dims."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe, emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate = recipe, emulate
        return recipe_mm(x, weight.t(), recipe.output, recipe, x.dtype, emulate, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = recipe_mm(grad, weight, recipe.grad_input, recipe, x.dtype, emulate, fast_accum=False)
        if ctx.needs_input_grad[1]:
            grad_w = recipe_mm(grad.t(), x, recipe.grad_weight, recipe, weight.dtype, emulate, fast_accum=False)
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose matmuls run in float8 (tensorwise scales, or a rowwise `recipe`); its parameters,
    state dict and initialization are nn.Linear's, so checkpoints, FSDP and TP plans see a linear."""

    emulate: bool = False
    recipe: Float8Recipe | None = None  # None: tensorwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        precast = getattr(weight, "precast", None)  # (e4m3 data, inverse scale): FSDP gathered it in float8
        # under autocast the matmul runs in the autocast dtype, as nn.Linear's would
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x = x.to(dtype)
            weight = weight if precast is not None else weight.to(dtype)  # a precast weight has no data to cast
        with torch.autocast(x.device.type, enabled=False):
            if self.recipe is None:
                y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, self.emulate, precast)
            else:
                y = _Float8RecipeMatmul.apply(x.reshape(-1, x.shape[-1]), weight, self.recipe, self.emulate)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, emulate: bool = False, recipe: Float8Recipe | None = None
    ) -> Float8Linear:
        """`linear` as a Float8Linear: the same module object and parameters, its class swapped (hooks,
        parametrizations and the meta device all stay as they were)."""
        linear.__class__ = cls
        linear.emulate = emulate  # type: ignore[assignment]
        linear.recipe = recipe  # type: ignore[assignment]
        return linear  # type: ignore[return-value]

    def extra_repr(self) -> str:
        name = "tensorwise" if self.recipe is None else self.recipe.name
        return f"{super().extra_repr()}, float8={name}{', emulate' if self.emulate else ''}"


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
    recipe_name: str | None = None,
) -> list[str]:
    """Make every nn.Linear of `model` a Float8Linear, except those whose FQN contains one of `filter_fqns`
    (torchtitan's substring match; e.g. ["output"]) or whose dims are not multiples of 16. Returns the
    FQNs converted. Run it before parallelizing, as torchtitan's converters run. `fsdp_float8_all_gather`:
    mark their weights for fully_shard's float8 all-gather (Float8AllGather; tensorwise only). `recipe_name`:
    None or "tensorwise", or one of `RECIPES`."""
    tensorwise = recipe_name in (None, "tensorwise")
    if not tensorwise and recipe_name not in RECIPES:
        raise ValueError(f"float8 recipe {recipe_name!r}: expected 'tensorwise' or one of {sorted(RECIPES)}")
    recipe = None if tensorwise else RECIPES[recipe_name]  # type: ignore[index]
    if recipe is not None and fsdp_float8_all_gather:
        raise ValueError(
            f"float8 recipe {recipe_name!r} with the float8 all-gather: FSDP gathers float8 weights with one "
            f"scale per tensor, which a rowwise recipe does not use (torchao's rule); turn "
            f"enable_fsdp_float8_all_gather off or use the tensorwise recipe"
        )
    converted = []
    for fqn, module in model.named_modules():
        if type(module) is not nn.Linear or any(f in fqn for f in filter_fqns) or not float8_convertible(module):
            continue
        Float8Linear.from_linear(module, emulate=emulate, recipe=recipe)
        if fsdp_float8_all_gather:
            module.fsdp_all_gather_casts = {"weight": Float8AllGather()}  # type: ignore[assignment]
        converted.append(fqn)
    return converted


__all__ = [
    "E4M3",
    "E5M2",
    "Float8AllGather",
    "Float8Linear",
    "Float8Recipe",
    "Operand",
    "RECIPES",
    "cast_to_float8",
    "convert_to_float8_training",
    "float8_scale",
    "scale_from_amax",
    "scaled_mm",
    "to_float8",
]
