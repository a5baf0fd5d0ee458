"""The SwiGLU MLP (Shazeer 2020) of Llama-style blocks (imports only torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x), `hidden_dim` wide (Llama 3: TransformerModelArgs.ffn_hidden_dim).

    Tensor parallelism shards w1 and w3 by column and w2 by row (models/llama3/parallelize.py: block_tp_plan), so the
    names are part of the plan and of the checkpoint format. `project(x)` applies the `input_projections`, w1 and
    w3, in one call, which async tensor parallelism replaces with one ring over both
    (parallelisms/tensor_parallel/async_styles.py)."""

    input_projections = ("w1", "w3")

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        """w1 ~ N(0, 0.02), w2 and w3 ~ N(0, init_std), cut at [-2, 2] (trunc_normal_, as torchtitan)."""
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.w1(x), self.w3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)  # (..., D) -> (..., hidden), twice
        return self.w2(F.silu(gate) * up)  # (..., hidden) -> (..., D)
