"""Rotary position embeddings (Su et al. 2021): the frequency table and its application (imports only torch).

A table is built in three steps, each its own function so a family can swap one:

    rope_frequencies(head_dim, theta)      the base frequencies theta^(-2j / head_dim), j < head_dim / 2
    scale_rope_freqs(freqs, scaling)       Llama 3.1's long-context rescaling (optional)
    rotary_table(freqs, end)               e^{i m f_j} for positions m < end, complex64

`precompute_freqs_cis` chains them as Llama 3 does. Another context extension (YaRN for Qwen3 and DeepSeek-V3)
is a second rescaling function beside `scale_rope_freqs`, plus, where the recipe asks for it, a factor on the
attention scores; the table and `apply_rotary_emb` stay as they are.

Channels are rotated in consecutive pairs (2j, 2j + 1), Meta's layout. Hugging Face checkpoints rotate channel
j with j + head_dim / 2; the adapters permute the rows of wq / wk on conversion (models/llama3/hf_adapter.py).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Llama3RoPEScaling(Protocol):
    """What `scale_rope_freqs` reads (models/llama3/args.py: RoPEScalingArgs, which stays torch-free)."""

    @property
    def scaling_factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The base frequencies theta^(-2j / head_dim) for j < head_dim / 2: (head_dim/2,) fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))


def scale_rope_freqs(freqs: torch.Tensor, scaling: Llama3RoPEScaling) -> torch.Tensor:
    """Llama 3.1's long-context RoPE (Meta's llama-models `apply_scaling`; HF rope type "llama3").

    With L = original_max_position_embeddings and wavelength w = 2 pi / f: frequencies with
    w < L / high_freq_factor (many turns within the original context) are kept, those with
    w > L / low_freq_factor are divided by scaling_factor, and in between f is interpolated as
    (1 - s) f / scaling_factor + s f with s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
    """
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = context / scaling.high_freq_factor
    low_freq_wavelen = context / scaling.low_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.scaling_factor, freqs)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.scaling_factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_table(freqs: torch.Tensor, end: int) -> torch.Tensor:
    """The rotations e^{i m f_j} for positions m < end: (end, len(freqs)) complex64."""
    angles = torch.outer(torch.arange(end, device=freqs.device).float(), freqs)  # (end, Dh/2)
    return torch.polar(torch.ones_like(angles), angles)


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float = 10000.0, scaling: Llama3RoPEScaling | None = None
) -> torch.Tensor:
    """RoPE rotations e^{i m theta_j} for positions m < end: (end, head_dim/2) complex64.
    With `scaling`, the frequencies are first rescaled as Llama 3.1 does (`scale_rope_freqs`)."""
    freqs = rope_frequencies(head_dim, theta)
    if scaling is not None:
        freqs = scale_rope_freqs(freqs, scaling)
    return rotary_table(freqs, end)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate consecutive pairs of xq / xk channels, (B, T, H, Dh), by position (complex multiply);
    `freqs_cis` holds the rows of these T positions (or more, of which the first T are used)."""
    seqlen = xq.shape[1]
    freqs = freqs_cis[:seqlen].view(1, seqlen, 1, -1)  # (1, T, 1, Dh/2)
    xq_c = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, H, Dh/2)
    xk_c = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))  # (B, T, Hkv, Dh/2)
    xq_out = torch.view_as_real(xq_c * freqs).flatten(3)  # (B, T, H, Dh)
    xk_out = torch.view_as_real(xk_c * freqs).flatten(3)  # (B, T, Hkv, Dh)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def yarn_scale_freqs(
    freqs: torch.Tensor,
    *,
    dim: int,
    theta: float,
    factor: float,
    original_seq_len: int,
    beta_fast: float,
    beta_slow: float,
) -> torch.Tensor:
    """YaRN's frequency interpolation (Peng et al. 2023) as DeepSeek-V3's reference and torchtitan's
    `precompute_freqs_cis` compute it, for the base frequencies `freqs` = rope_frequencies(dim, theta), (dim/2,), of a
    `dim`-channel rotary part (the correction range below needs theta itself, not just the frequencies).

    Channel pair j turns original_seq_len * f_j / (2 pi) times over the original context. Pairs that turn more than
    `beta_fast` times (high frequencies) are kept, pairs that turn fewer than `beta_slow` times are divided by
    `factor` (interpolated), and in between a linear ramp over j mixes the two. The ramp's ends are the pair indices
    d(r) = dim * ln(original_seq_len / (2 pi r)) / (2 ln theta) of r = beta_fast, beta_slow turns, rounded outwards.
    """

    def pair_of(turns: float) -> float:
        return dim * math.log(original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_of(beta_fast)), 0)
    high: float = min(math.ceil(pair_of(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width (as the reference): a step
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=freqs.device) - low) / (high - low), 0, 1)
    smooth = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    return freqs / factor * (1 - smooth) + freqs * smooth


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 * mscale * ln(factor) + 1 (Peng et al. 2023, eq. 21); 1 when
    the context is not extended (factor <= 1). DeepSeek-V3 multiplies its softmax scale by its square."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0
