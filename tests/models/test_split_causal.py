"""The split causal attention (models/common/split_causal.py) against SDPA: the same output and gradients
(fp32 to rounding; bf16 no further from an fp64 reference than SDPA's own bf16 result), grouped K/V heads,
and taken exactly where its docstring says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common.attention import causal_attention
from models.common.split_causal import _SplitCausal, split_causal_attention, split_levels, splits_causal_square


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _run(attention, base: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Output and (dq, dk, dv) in fp64 for (B, T, H, Dh) leaves seen as (B, H, T, Dh), as the model's q, k, v."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in base)
    out = attention(*(t.transpose(1, 2) for t in (q, k, v)))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    return [out.double(), *(t.grad.double() for t in (q, k, v))]  # type: ignore[union-attr]


def _inputs(seq: int, n_kv: int, batch: int = 2, heads: int = 8, head_dim: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, seq, h, head_dim, generator=gen, dtype=torch.float64) for h in (heads, n_kv, n_kv)]


@pytest.mark.parametrize("seq, n_kv, levels", [(512, 8, 1), (512, 2, 2), (512, 8, 3), (258, 4, 1), (384, 8, 2)])
def test_fp32_equals_sdpa(seq: int, n_kv: int, levels: int) -> None:
    base = _inputs(seq, n_kv)
    assert splits_causal_square(*(t.float().transpose(1, 2) for t in base[:2]))

    def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _SplitCausal.apply(q, k, v, levels)

    for got, want in zip(_run(split, base, torch.float32), _run(_sdpa, base, torch.float32)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_levels_follow_the_threads_and_divide_the_length() -> None:
    assert [split_levels(512, 2), split_levels(512, 1), split_levels(258, 1)] == [1, 2, 1]


def test_bf16_is_as_close_to_fp64_as_sdpa() -> None:
    base = _inputs(512, 4)
    exact = _run(_sdpa, base, torch.float64)
    ours, theirs = _run(split_causal_attention, base, torch.bfloat16), _run(_sdpa, base, torch.bfloat16)
    for mine, sdpa, ref in zip(ours, theirs, exact):
        error, sdpa_error = ((mine - ref).norm() / ref.norm()).item(), ((sdpa - ref).norm() / ref.norm()).item()
        assert error < 1.25 * sdpa_error, (error, sdpa_error)


@pytest.mark.parametrize(
    "seq, kv_seq, dtype, splits",
    [
        (512, 512, torch.float32, True),
        (258, 258, torch.bfloat16, True),
        (256, 256, torch.float32, False),  # half the kernel's key block or less: nothing to save
        (1024, 1024, torch.float32, False),  # the kernel skips masked key blocks itself
        (511, 511, torch.float32, False),  # odd: no halves
        (512, 256, torch.float32, False),  # not a self-attention square
        (512, 512, torch.float64, False),  # no flash kernel
    ],
)
def test_where_the_split_is_taken(seq: int, kv_seq: int, dtype: torch.dtype, splits: bool) -> None:
    q, k = torch.zeros(1, 2, seq, 16, dtype=dtype), torch.zeros(1, 2, kv_seq, 16, dtype=dtype)
    assert splits_causal_square(q, k) is splits


def test_fake_tensors_and_the_model_entry_point() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.zeros(1, 2, 512, 16)
        assert not splits_causal_square(q, q)  # the estimator traces SDPA itself
    base = _inputs(512, 8)
    assert splits_causal_square(*(t.float().transpose(1, 2) for t in base[:2]))  # the entry point takes the split
    for got, want in zip(_run(causal_attention, base, torch.float32), _run(_sdpa, base, torch.float32)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_code_imports_no_parallelisms() -> None:
    """docs/architecture.md §1: models/*/model.py never imports parallelisms (split_causal.py included), checked
    in a fresh interpreter so this session's imports do not hide it."""
    import subprocess
    import sys

    probe = "import sys, models.llama3.model; print(sorted(m for m in sys.modules if m.startswith('parallelisms')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
