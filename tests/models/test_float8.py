"""Float8 training of linears (models.float8): the casts, the three float8 matmuls against their definition,
the converter's choices, and selective AC's view of the float8 matmuls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.float8 import (
    E4M3,
    E5M2,
    RECIPES,
    Float8Linear,
    cast_to_float8,
    convert_to_float8_training,
    float8_scale,
    scaled_mm,
    to_float8,
)


def _dequantize(data: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    return data.to(torch.float32) * inverse_scale


def test_a_cast_puts_the_amax_on_the_largest_float8_value() -> None:
    t = torch.tensor([[0.5, -2.0], [1.0, 0.25]])
    data, inverse = to_float8(t, E4M3)
    assert data.dtype is E4M3 and inverse.dtype is torch.float32 and inverse.shape == (1,)
    assert float(inverse) == pytest.approx(2.0 / 448)
    assert data.to(torch.float32).abs().max() == 448  # the amax lands on e4m3's largest finite value
    assert torch.equal(_dequantize(data, inverse), t)  # these values are exact in e4m3
    zeros, inverse = to_float8(torch.zeros(3), E4M3)  # all zeros: a finite scale (the amax floor), zeros back
    assert torch.isfinite(inverse) and not zeros.to(torch.float32).any()


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_two_pass_cast_gives_torchaos_saturated_cast_bit_for_bit(source: torch.dtype, dtype: torch.dtype) -> None:
    """torchao: amax = max(abs(t)); scale = fp32(max / clamp(fp64(amax), 1e-12)); clamp(t.float() * scale)
    to the format's range, then cast. Ours skips the clamp (the scale is this tensor's own) and multiplies
    in one pass: the same bytes, on tensors whose amax sits anywhere in the range, ties and subnormals too."""
    torch.manual_seed(0)
    limit = torch.finfo(dtype).max
    for magnitude in (1e-6, 3e-3, 1.0, 7.0, 300.0, 6e4):
        if source is torch.float16 and magnitude > 1e3:
            continue  # float16 overflows to inf there
        t = (torch.randn(257, 129) * magnitude).to(source)
        t[0, 0] = -t.abs().max()  # the amax on a negative value
        amax = torch.max(torch.abs(t))
        scale = (limit / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
        if source is torch.float16:
            scale = torch.clamp(scale, max=torch.finfo(torch.float16).max)
        expected = torch.clamp(t.to(torch.float32) * scale, min=-limit, max=limit).to(dtype)
        ours = cast_to_float8(t, float8_scale(t, dtype)[0], dtype)
        assert torch.equal(ours.view(torch.uint8), expected.view(torch.uint8)), magnitude
        if source is not torch.float16 or magnitude > 1e-2:  # float16's scale is capped at its largest value
            assert ours.to(torch.float32).abs().max() == limit


def test_the_cpu_kernel_is_the_emulation_bitwise() -> None:
    torch.manual_seed(0)
    a, a_inv = to_float8(torch.randn(64, 48), E4M3)
    b, b_inv = to_float8(torch.randn(32, 48), E4M3)
    for dtype in (torch.float32, torch.bfloat16):
        kernel = scaled_mm(a, a_inv, b.t(), b_inv, dtype, emulate=False)
        assert torch.equal(kernel, scaled_mm(a, a_inv, b.t(), b_inv, dtype, emulate=True))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an sm_89+ GPU"
)
def test_the_cuda_kernel_is_the_emulation_up_to_its_accumulation_order() -> None:
    torch.manual_seed(0)
    a, a_inv = to_float8(torch.randn(256, 512, device="cuda"), E4M3)
    b, b_inv = to_float8(torch.randn(128, 512, device="cuda"), E4M3)
    kernel = scaled_mm(a, a_inv, b.t(), b_inv, torch.float32, emulate=False)
    emulated = scaled_mm(a, a_inv, b.t(), b_inv, torch.float32, emulate=True)
    torch.testing.assert_close(kernel, emulated, rtol=1e-5, atol=1e-4)


def test_the_three_matmuls_are_float8_products_of_tensorwise_casts() -> None:
    """Forward x8 @ w8.T, backward g8 @ w8 and g8.T @ x8 (g in e5m2), each operand cast with one scale:
    computed here from the definition, equal bit for bit."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 32, bias=False)
    Float8Linear.from_linear(linear)
    x = torch.randn(2, 8, 48, requires_grad=True)
    y = linear(x)
    g = torch.randn_like(y)
    y.backward(g)

    x2, w = x.detach().reshape(-1, 48), linear.weight.detach()
    x8, w8, g8 = to_float8(x2, E4M3), to_float8(w, E4M3), to_float8(g.reshape(-1, 32), E5M2)
    assert torch.equal(y.detach().reshape(-1, 32), _dequantize(*x8) @ _dequantize(*w8).t())
    assert torch.equal(x.grad.reshape(-1, 48), _dequantize(*g8) @ _dequantize(*w8))
    assert torch.equal(linear.weight.grad, _dequantize(*g8).t() @ _dequantize(*x8))


def test_float8_stays_close_to_the_high_precision_linear() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(256, 128, bias=True)
    linear = nn.Linear(256, 128, bias=True)
    linear.load_state_dict(reference.state_dict())
    Float8Linear.from_linear(linear)
    x = torch.randn(4, 16, 256)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = linear(x1), reference(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm())

    # e4m3 keeps 3 mantissa bits, e5m2 2: a few percent of the tensor's norm, not more
    assert relative(y1, y2) < 0.05
    assert relative(x1.grad, x2.grad) < 0.1
    assert relative(linear.weight.grad, reference.weight.grad) < 0.1
    assert torch.equal(linear.bias.grad, reference.bias.grad)  # the bias is added in high precision


def test_under_autocast_the_matmul_runs_in_the_autocast_dtype() -> None:
    linear = Float8Linear.from_linear(nn.Linear(32, 16, bias=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(torch.randn(4, 32))
    assert y.dtype is torch.bfloat16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.ModuleDict({"wq": nn.Linear(64, 64, bias=False), "wo": nn.Linear(64, 64, bias=False)})
        self.odd = nn.Linear(64, 24, bias=False)  # 24 is not a multiple of 16: float8 tensor cores refuse it
        self.output = nn.Linear(64, 32, bias=False)


def test_the_converter_skips_filtered_and_odd_linears_and_keeps_the_parameters() -> None:
    with torch.device("meta"):
        model = _Block()
    weight = model.attention.wq.weight
    keys = list(model.state_dict())
    converted = convert_to_float8_training(model, filter_fqns=["output"])
    assert converted == ["attention.wq", "attention.wo"]
    assert type(model.attention.wq) is Float8Linear and model.attention.wq.weight is weight
    assert type(model.odd) is nn.Linear and type(model.output) is nn.Linear
    assert list(model.state_dict()) == keys  # checkpoints and HF conversion see the same names
    assert convert_to_float8_training(model) == ["output"]  # unfiltered, a second pass converts what is left
    assert "float8=tensorwise" in repr(model.attention.wq)


class _Float8Blocks(nn.Module):
    """Two blocks of float8 linears (32 wide) under `model.layers`, checkpointed by `ac_mode` as apply_ac does."""

    def __init__(self, *, linears_per_block: int, ac_mode: str) -> None:
        from parallelisms.activation_checkpoint import apply_ac

        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(linears_per_block))) for _ in range(2)
        )
        convert_to_float8_training(self)
        apply_ac(self, ac_mode)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_selective_ac_treats_float8_matmuls_as_matmuls() -> None:
    """torchtitan's op-level policy keeps every other matmul; under torchao float8 it sees them as `mm`, here
    as `_scaled_mm`: the same ones are kept, and the backward recomputes only the others."""
    from torch.utils.flop_counter import FlopCounterMode

    calls = {}
    for mode in ("none", "selective"):
        model = _Float8Blocks(linears_per_block=2, ac_mode=mode)
        x = torch.randn(8, 32, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            model(x).sum().backward()
        calls[mode] = counter.get_flop_counts()["Global"][torch.ops.aten._scaled_mm]
    # 4 linears x 3 matmuls; selective recomputes every other forward matmul: 2 more
    assert calls["selective"] == calls["none"] + 2 * 2 * 32 * 32 * 8


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64, bias=False)
        self.fc2 = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _tp_float8_mlp(recipe: str | None = None) -> tuple[float, float, float, int]:
    import torch.distributed as dist

    from parallelisms.dtensor import init_device_mesh
    from parallelisms.dtensor.debug import CommDebugMode
    from parallelisms.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model, reference = _MLP(), _MLP()
    reference.load_state_dict(model.state_dict())
    convert_to_float8_training(model, recipe_name=recipe)
    convert_to_float8_training(reference, recipe_name=recipe)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    x = torch.randn(4, 8, 32)
    with CommDebugMode() as comm:
        y = model(x)
        y.sum().backward()
    expected = reference(x)
    expected.sum().backward()

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    return (
        gap(y.detach(), expected.detach()),
        gap(model.fc1.weight.grad.full_tensor(), reference.fc1.weight.grad),
        gap(model.fc2.weight.grad.full_tensor(), reference.fc2.weight.grad),
        comm.get_total_counts(),
    )


def test_tensor_parallel_float8_casts_the_one_device_bytes() -> None:
    """Colwise / Rowwise float8 linears on 2 ranks: the sharded weight's, the sharded hidden activation's and
    the sharded gradient's amax are all-reduced (one scalar each; the backward reuses the forward's scales),
    so the weight gradients equal one device's bit for bit; the output differs only by the row-parallel
    partial sum's order."""
    from tests.world import run_world

    for y_gap, grad1_gap, grad2_gap, collectives in run_world(_tp_float8_mlp, 2):
        assert y_gap < 1e-6
        assert grad1_gap == 0.0 and grad2_gap == 0.0
        # forward: the amax of fc1's weight, of the hidden activation and of fc2's weight, fc2's partial sum;
        # backward: the amax of fc1's output gradient (fc2's is whole on every rank)
        assert collectives == 5


def test_a_compiled_float8_linear_gives_eager_results() -> None:
    """FSDP-only layouts compile each block (compile.enable): the float8 linear traces whole (its autograd
    Function, the casts and `_scaled_mm`), with eager's outputs and gradients."""
    torch.manual_seed(0)
    eager = Float8Linear.from_linear(nn.Linear(64, 32, bias=False))
    compiled_module = Float8Linear.from_linear(nn.Linear(64, 32, bias=False))
    compiled_module.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = eager(x1), compiled(x2)
    y1.sum().backward()
    y2.sum().backward()
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(eager.weight.grad, compiled_module.weight.grad)


def test_selective_ac_keeps_the_amaxes_so_the_recomputation_reads_no_tensor_for_them() -> None:
    """torchtitan keeps `max` (torchao's amax) under op-level SAC; models.float8 takes its amax with
    `linalg_vector_norm`, kept alike: the backward's recomputation runs no amax, only the gradients' own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.amaxes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.amaxes += func is torch.ops.aten.linalg_vector_norm.default
            return func(*args, **(kwargs or {}))

    counts = {}
    for mode in ("none", "selective"):
        model = _Float8Blocks(linears_per_block=1, ac_mode=mode)
        loss = model(torch.randn(8, 32, requires_grad=True)).sum()
        with Count() as count:
            loss.backward()
        counts[mode] = count.amaxes
    assert counts == {"none": 2, "selective": 2}  # one gradient amax per linear; no recomputed x or w amax


# --------------------------------------------------------------------------------------------------
# the rowwise recipes (torchao's "rowwise" and "rowwise_with_gw_hp")
# --------------------------------------------------------------------------------------------------


def _rowwise_cast(t: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's axiswise (or, dim None, tensorwise) cast: the amax along `dim`, the scale in float64 rounded
    down to a power of two, e4m3; returns (float8 data, inverse scale), computed here from the definition."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (448.0 / amax.double().clamp(min=1e-12)).float()
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).to(E4M3), scale.reciprocal()


def _kernel(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], fast: bool) -> torch.Tensor:
    """torchao's rowwise `_scaled_mm` call on the CPU: the float32 product of the dequantized operands written in
    bfloat16; without fast accumulation, the unscaled product in bfloat16, times the scales, in bfloat16."""
    if fast:
        return (_dequantize(*a) @ _dequantize(*b)).bfloat16().float()
    raw = (a[0].float() @ b[0].float()).bfloat16()
    return (raw * (a[1] * b[1])).bfloat16().float()


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_rowwise_recipes_cast_and_multiply_as_torchao_defines_them(recipe: str) -> None:
    """Forward x @ w.T with x per row and w.T per column; backward g @ w (w per column, or tensorwise
    repeated along the columns under rowwise_with_gw_hp) and g.T @ x (per row / column, or in float32 under
    rowwise_with_gw_hp): every operand e4m3 with power-of-two scales, recomputed in backward along its new
    dim. Built here from the definition, equal bit for bit."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 32, bias=False)
    convert_to_float8_training(linear, recipe_name=recipe)
    x = torch.randn(2, 8, 48, requires_grad=True)
    y = linear(x)
    g = torch.randn_like(y)
    y.backward(g)

    x2, w, g2 = x.detach().reshape(-1, 48), linear.weight.detach(), g.reshape(-1, 32)
    assert torch.equal(y.detach().reshape(-1, 32), _kernel(_rowwise_cast(x2, 1), _rowwise_cast(w.t(), 0), True))
    if recipe == "rowwise":
        grad_x = _kernel(_rowwise_cast(g2, 1), _rowwise_cast(w, 0), False)
        grad_w = _kernel(_rowwise_cast(g2.t(), 1), _rowwise_cast(x2, 0), False)
    else:
        w8, w_inv = _rowwise_cast(w, None)
        grad_x = _kernel(_rowwise_cast(g2, 1), (w8, w_inv.reshape(1, 1).expand(1, 48)), False)
        grad_w = g2.t() @ x2
    assert torch.equal(x.grad.reshape(-1, 48), grad_x)
    assert torch.equal(linear.weight.grad, grad_w)


def test_a_rowwise_scale_keeps_an_outlier_to_its_own_row() -> None:
    """One huge row: tensorwise flushes the other rows' small values to zero, rowwise keeps them."""
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    x[3] *= 1e6
    w = torch.randn(32, 64)
    exact = (x @ w.t())[[i for i in range(16) if i != 3]]
    results = {}
    for recipe in (None, "rowwise"):
        linear = nn.Linear(64, 32, bias=False)
        linear.weight.data.copy_(w)
        convert_to_float8_training(linear, recipe_name=recipe)
        y = linear(x).detach()[[i for i in range(16) if i != 3]]
        results[recipe] = float((y - exact).norm() / exact.norm())
    assert results["rowwise"] < 0.05 and results[None] > 0.5, results


def test_the_converter_names_recipes_it_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"float8 recipe 'blockwise': expected 'tensorwise' or one of \['rowwise'"):
        convert_to_float8_training(nn.Linear(16, 16), recipe_name="blockwise")
    with pytest.raises(ValueError, match="'rowwise' with the float8 all-gather: .* one scale per tensor"):
        convert_to_float8_training(nn.Linear(16, 16), recipe_name="rowwise", fsdp_float8_all_gather=True)
    linear = nn.Linear(16, 16)
    assert convert_to_float8_training(linear, recipe_name="rowwise_with_gw_hp") == [""]
    assert "float8=rowwise_with_gw_hp" in repr(linear)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_tensor_parallel_rowwise_float8_follows_one_device(recipe: str) -> None:
    """Colwise / Rowwise rowwise-float8 linears on 2 ranks: every row's or column's scale is the one device's
    (an amax over a sharded contraction dim is all-reduced: a vector), so both weight gradients equal one
    device's bit for bit; the output differs by the row-parallel sum's order, each partial rounded to the
    kernel's bfloat16."""
    from tests.world import run_world

    for y_gap, grad1_gap, grad2_gap, collectives in run_world(_tp_float8_mlp, 2, recipe):
        assert y_gap < 0.01 and grad1_gap == 0.0 and grad2_gap == 0.0, (y_gap, grad1_gap, grad2_gap)
        # forward: fc2's input-row and weight-column amaxes (both over the sharded hidden dim) and its partial
        # sum; the backward's casts reduce over whole dims, except rowwise_with_gw_hp's whole-tensor amax of
        # fc2's sharded weight for the input gradient
        assert collectives == {"rowwise": 3, "rowwise_with_gw_hp": 4}[recipe]
