"""models/common/rms_norm.py: nn.RMSNorm's values, a closed-form backward on fp32 CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.common.rms_norm import RMSNorm, _RMSNormCPU


def _pair(dim: int) -> tuple[nn.RMSNorm, RMSNorm]:
    ref = nn.RMSNorm(dim, eps=1e-5)
    ours = RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim))
        ours.weight.copy_(ref.weight)
    return ref, ours


@pytest.mark.parametrize("shape", [(4, 32, 64), (7, 48), (48,)])
def test_forward_is_nn_rmsnorm_bit_for_bit_and_the_backward_its_gradients(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    ref, ours = _pair(shape[-1])
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(shape)
    want, got = ref(x), ours(x2)
    assert torch.equal(got, want)
    assert got.grad_fn is not None and "_RMSNormCPU" in type(got.grad_fn).__name__
    want.backward(g)
    got.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_gradcheck_in_double_through_the_function() -> None:
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormCPU.apply(x, w, 1e-6), (x, w))


def test_a_frozen_weight_or_input_gets_no_gradient() -> None:
    _, ours = _pair(16)
    ours.weight.requires_grad_(False)
    x = torch.randn(2, 16, requires_grad=True)
    ours(x).sum().backward()
    assert x.grad is not None and ours.weight.grad is None
    ours.weight.requires_grad_(True)
    ours(torch.randn(2, 16)).sum().backward()
    assert ours.weight.grad is not None


def test_other_dtypes_keep_torchs_path() -> None:
    ref, ours = _pair(16)
    x = torch.randn(2, 16, dtype=torch.bfloat16, requires_grad=True)
    y = ours.to(torch.bfloat16)(x)
    assert "_RMSNormCPU" not in type(y.grad_fn).__name__
    assert torch.equal(y, ref.to(torch.bfloat16)(x))
