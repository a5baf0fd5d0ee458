"""The online-softmax merge of partial attention outputs (Milakov & Gimelshein 2018; flash attention's).

Attention over keys K1 and K2 is a mix of the attention over each: with lse_i the log-sum-exp of block i's
scores, out = sum_i exp(lse_i - lse) * out_i where lse = log(sum_i exp(lse_i)). Done in fp32.
"""

from __future__ import annotations

import torch


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a block's (out (..., L, Dh), lse (..., L)) into the fp32 accumulators, in place."""
    merged = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - merged).unsqueeze(-1))
    acc_out.add_(out.float() * torch.exp(lse - merged).unsqueeze(-1))
    acc_lse.copy_(merged)
