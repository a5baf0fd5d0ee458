"""models/common against direct references: RMSNorm against its formula, RoPE against the rotation of channel
pairs by angle m theta_j, grouped-query attention (QK-norm off and on, head_dim free of dim) against softmax
attention over repeated K/V heads, SwiGLU against its formula; and Llama 3, composed of them, against Hugging
Face's LlamaForCausalLM (logits and gradients)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.common.attention import GroupedQueryAttention
from models.common.feed_forward import FeedForward
from models.common.rms_norm import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_freqs_cis, rope_frequencies
from models.llama3 import Transformer, TransformerModelArgs
from models.llama3 import hf_adapter as hf
from models.llama3.model import Attention

TOL: dict = dict(atol=1e-5, rtol=1e-5)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """(B, T, H, Dh) with pair (2j, 2j+1) at position m rotated by m * theta^(-2j/Dh), in float64."""
    t, dh = x.shape[1], x.shape[-1]
    j = torch.arange(dh // 2, dtype=torch.float64)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * theta ** (-2 * j / dh)  # (T, Dh/2)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]  # (1, T, 1, Dh/2)
    even, odd = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)  # (B, T, H, Dh)


def _attention_reference(attn: GroupedQueryAttention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Softmax attention written out: projections, optional per-head RMSNorm, RoPE, K/V heads repeated for their
    query-head groups, a causal mask, the output projection."""
    b, t, _ = x.shape
    dh = attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, t, -1, dh)  # (B, T, H, Dh)
    k = (x @ attn.wk.weight.T).view(b, t, -1, dh)  # (B, T, Hkv, Dh)
    v = (x @ attn.wv.weight.T).view(b, t, -1, dh)  # (B, T, Hkv, Dh)
    if attn.q_norm is not None and attn.k_norm is not None:
        q = _rms_norm_reference(q, attn.q_norm.weight, attn.q_norm.eps or 0.0)
        k = _rms_norm_reference(k, attn.k_norm.weight, attn.k_norm.eps or 0.0)
    q, k = _rope_reference(q, theta).float(), _rope_reference(k, theta).float()
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)  # (B, T, H, Dh)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)  # (B, H, T, T)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, -1)  # (B, T, H*Dh)
    return out @ attn.wo.weight.T


# ------------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_is_its_formula_in_value_and_gradient(dtype: torch.dtype) -> None:
    norm = RMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(24, seed=1, dtype=dtype))
    x = _randn(3, 5, 24, dtype=dtype).requires_grad_()
    ours = norm(x)
    want = _rms_norm_reference(x, norm.weight, 1e-5)
    torch.testing.assert_close(ours, want)
    g = _randn(3, 5, 24, seed=2, dtype=dtype)
    torch.testing.assert_close(
        torch.autograd.grad(ours, (x, norm.weight), g), torch.autograd.grad(want, (x, norm.weight), g)
    )


# ---------------------------------------------------------------------------------------------------- RoPE
def test_rope_frequencies_are_theta_to_the_minus_2j_over_head_dim() -> None:
    want = torch.tensor([500000.0 ** (-2 * j / 16) for j in range(8)])
    torch.testing.assert_close(rope_frequencies(16, 500000.0), want)
    table = precompute_freqs_cis(16, 7, 500000.0)
    assert table.shape == (7, 8) and table.dtype == torch.complex64
    torch.testing.assert_close(table.abs(), torch.ones(7, 8))


@pytest.mark.parametrize("head_dim", [8, 64])
def test_rope_rotates_channel_pairs_by_position_times_frequency(head_dim: int) -> None:
    x = _randn(2, 11, 3, head_dim)  # (B, T, H, Dh)
    ours, _ = apply_rotary_emb(x, x[:, :, :1], precompute_freqs_cis(head_dim, 16, 10000.0))
    torch.testing.assert_close(ours.double(), _rope_reference(x, 10000.0), atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_the_relative_position() -> None:
    q, k = _randn(1, 1, 1, 32, seed=1), _randn(1, 1, 1, 32, seed=2)
    freqs = precompute_freqs_cis(32, 64)

    def score(m: int, n: int) -> torch.Tensor:
        qm, _ = apply_rotary_emb(q.expand(1, 64, 1, 32), q.expand(1, 64, 1, 32), freqs)
        _, kn = apply_rotary_emb(k.expand(1, 64, 1, 32), k.expand(1, 64, 1, 32), freqs)
        return (qm[0, m, 0] * kn[0, n, 0]).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "head_dim", "qk_norm"),
    [(4, 4, 12, False), (4, 2, 16, False), (6, 2, 16, True), (4, 1, 8, True)],
    ids=["mha", "gqa_head_dim_free_of_dim", "gqa_qk_norm", "mqa_qk_norm"],
)
def test_attention_is_softmax_attention_over_repeated_kv_heads(
    n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool
) -> None:
    dim, seq = 48, 9
    torch.manual_seed(0)
    attn = GroupedQueryAttention(dim, n_heads, n_kv_heads, head_dim, qk_norm=qk_norm, norm_eps=1e-6)
    attn.init_weights(0.02)
    if qk_norm:  # non-trivial norm weights, so a norm applied to the wrong axis shows
        with torch.no_grad():
            attn.q_norm.weight.copy_(1 + _randn(head_dim, seed=3))  # type: ignore[union-attr]
            attn.k_norm.weight.copy_(1 + _randn(head_dim, seed=4))  # type: ignore[union-attr]
    x = _randn(2, seq, dim, seed=5).requires_grad_()
    freqs = precompute_freqs_cis(head_dim, 16, 10000.0)
    ours, want = attn(x, freqs), _attention_reference(attn, x, 10000.0)
    torch.testing.assert_close(ours, want, **TOL)
    g = _randn(2, seq, dim, seed=6)
    params = [x, *attn.parameters()]
    for got, ref in zip(torch.autograd.grad(ours, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(got, ref, **TOL)


def test_qk_norm_adds_per_head_norms_and_is_off_by_default() -> None:
    plain = GroupedQueryAttention(32, 4, 2, 16)
    assert plain.q_norm is None and plain.k_norm is None
    assert sorted(plain.state_dict()) == ["wk.weight", "wo.weight", "wq.weight", "wv.weight"]
    assert (plain.wq.weight.shape, plain.wo.weight.shape) == ((64, 32), (32, 64))  # head_dim * heads != dim
    normed = GroupedQueryAttention(32, 4, 2, 16, qk_norm=True)
    assert {k: tuple(v.shape) for k, v in normed.state_dict().items() if "norm" in k} == {
        "q_norm.weight": (16,),
        "k_norm.weight": (16,),
    }
    with pytest.raises(ValueError, match=r"n_heads\(4\) must be divisible by n_kv_heads\(3\)"):
        GroupedQueryAttention(32, 4, 3, 16)


# -------------------------------------------------------------------------------------------------- SwiGLU
def test_feed_forward_is_swiglu() -> None:
    torch.manual_seed(0)
    ffn = FeedForward(16, 40)
    x = _randn(2, 3, 16)
    want = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    torch.testing.assert_close(ffn(x), want)
    assert [n for n, _ in ffn.named_parameters()] == ["w1.weight", "w2.weight", "w3.weight"]


# ------------------------------------------------------------------------------------------------- Llama 3
def test_llama_attention_is_the_shared_one_without_qk_norm() -> None:
    args = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97)
    attention = Transformer(args).layers["0"].attention
    assert isinstance(attention, Attention) and isinstance(attention, GroupedQueryAttention)
    assert attention.q_norm is None and attention.head_dim == 16


@pytest.mark.parametrize("tied", [False, True])
def test_llama_matches_hf_llama_in_logits_and_gradients(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    args = TransformerModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=32,
        rope_theta=500000, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(1)
    ours = Transformer(args)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf.hf_config(args, dtype="float32")))
    theirs.load_state_dict({hf.to_hf_name(k): hf.to_hf_tensor(k, v, args) for k, v in ours.state_dict().items()})
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    ours_logits, their_logits = ours(tokens), theirs(tokens).logits
    torch.testing.assert_close(ours_logits, their_logits, **TOL)
    ours_logits.square().mean().backward()
    their_logits.square().mean().backward()
    their_grads = {name: p.grad for name, p in theirs.named_parameters()}
    for fqn, p in ours.named_parameters():
        want = hf.to_hf_tensor(fqn, p.grad, args)  # type: ignore[arg-type]
        torch.testing.assert_close(want, their_grads[hf.to_hf_name(fqn)], atol=1e-6, rtol=1e-4, msg=fqn)


def test_common_imports_no_parallelisms() -> None:
    probe = "import sys, models.common; print(sorted(m for m in sys.modules if m.startswith('parallelisms')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
