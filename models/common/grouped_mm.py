"""The experts' grouped GEMM as torch.compile sees it: `torch._grouped_mm` wrapped in a custom op.

torch's fake kernel of `_grouped_mm` takes bfloat16 only (the CUDA fast path), while the CPU kernel runs any
dtype, so a compiled float32 MoE block fails to trace. The op here runs the same kernel, with a fake kernel that
only computes the output's shape, and its backward is two more of it (the gradients aten's formula computes,
bit for bit). Eager code calls `_grouped_mm` itself (`grouped_mm` picks); only traced code sees the op.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("meshtrain::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(M, K) x (E, K, N) -> (M, N): rows offs[e-1]:offs[e] of `a` times b[e]; or (K, M) x (M, N) -> (E, K, N):
    columns offs[e-1]:offs[e] of `a` times those rows of `b` (the weight gradient's form)."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
    a, b, offs = ctx.saved_tensors  # type: ignore[attr-defined]
    if b.dim() != 3:
        raise NotImplementedError("meshtrain::grouped_mm: no second derivative of the weight-gradient form")
    grad_a = _grouped_mm_op(grad, b.transpose(-2, -1), offs)
    grad_b = _grouped_mm_op(a.transpose(0, 1), grad, offs)
    return grad_a, grad_b, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)`; under torch.compile's tracing, the custom op."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)
