"""A tiny Llama written as plain torch code over a dict of weights, every weight a DTensor.

No TP styles and no to_local: the sharding propagation alone decides every collective, which makes
this the benchmark of a dispatcher's cost model. `train(impl, mesh, ...)` runs the same program on
our DTensor or torch's and returns the losses and the collectives one step issued.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DIM, HEADS, LAYERS, FFN, VOCAB, SEQ, BATCH = 32, 4, 2, 64, 64, 8, 2


def init_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    weights = {"embed": w(VOCAB, DIM), "norm": torch.ones(DIM), "output": w(VOCAB, DIM)}
    for i in range(LAYERS):
        weights |= {
            f"{i}.attn_norm": torch.ones(DIM),
            f"{i}.wq": w(DIM, DIM),
            f"{i}.wk": w(DIM, DIM),
            f"{i}.wv": w(DIM, DIM),
            f"{i}.wo": w(DIM, DIM),
            f"{i}.ffn_norm": torch.ones(DIM),
            f"{i}.w1": w(FFN, DIM),
            f"{i}.w3": w(FFN, DIM),
            f"{i}.w2": w(DIM, FFN),
        }
    return weights


def placements_for(name: str, shard, replicate) -> list:
    """Megatron layout: q/k/v/w1/w3 by output rows, wo/w2 by input columns, the rest replicated."""
    kind = name.split(".")[-1]
    if kind in ("wq", "wk", "wv", "w1", "w3"):
        return [shard(0)]
    if kind in ("wo", "w2"):
        return [shard(1)]
    return [replicate()]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def forward(weights: dict[str, torch.Tensor], tokens: torch.Tensor, mask: torch.Tensor, *, sdpa: bool) -> torch.Tensor:
    """Logits (B, T, V); `mask` is the causal (T, T) mask, a replicated DTensor, for math attention."""
    h = F.embedding(tokens, weights["embed"])  # (B, T, D)
    head_dim = DIM // HEADS
    for i in range(LAYERS):
        x = rms_norm(h, weights[f"{i}.attn_norm"])
        q, k, v = (F.linear(x, weights[f"{i}.w{n}"]).view(BATCH, SEQ, HEADS, head_dim).transpose(1, 2) for n in "qkv")
        if sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        h = h + F.linear(o.transpose(1, 2).reshape(BATCH, SEQ, DIM), weights[f"{i}.wo"])
        x = rms_norm(h, weights[f"{i}.ffn_norm"])
        h = h + F.linear(F.silu(F.linear(x, weights[f"{i}.w1"])) * F.linear(x, weights[f"{i}.w3"]), weights[f"{i}.w2"])
    logits = F.linear(rms_norm(h, weights["norm"]), weights["output"])  # (B, T, V)
    return logits


def train(impl: Any, mesh: Any, comm_mode: type, *, sdpa: bool, steps: int = 2) -> dict[str, Any]:
    """`impl` is a module with distribute_tensor/Shard/Replicate (ours or torch.distributed.tensor)."""
    params = {
        name: torch.nn.Parameter(impl.distribute_tensor(t, mesh, placements_for(name, impl.Shard, impl.Replicate)))
        for name, t in init_weights().items()
    }
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=g)
    mask = impl.distribute_tensor(torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), mesh, [impl.Replicate()])
    # torch's DTensor has no rule for CPU flash attention: it runs SDPA's math decomposition
    is_torch = impl.__name__.startswith("torch")
    losses, counts, total, sent = [], {}, 0, 0
    for step in range(steps):
        inputs = impl.distribute_tensor(tokens[step, :, :-1], mesh, [impl.Replicate()])
        labels = impl.distribute_tensor(tokens[step, :, 1:], mesh, [impl.Replicate()])
        with comm_mode() as comm, sdpa_kernel(SDPBackend.MATH) if is_torch else contextlib.nullcontext():
            logits = forward(params, inputs, mask, sdpa=sdpa)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.full_tensor().item())
        total += comm.get_total_counts()
        sent += sum(comm.get_comm_bytes().values())
        counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items() if v}
    final = {name: p.full_tensor() for name, p in params.items()}
    return {"losses": losses, "collectives": total, "bytes": sent, "last_step": counts, "params": final}
