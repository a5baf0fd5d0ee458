"""A Llama-3-style block (RMSNorm, RoPE, GQA attention with SDPA, SwiGLU) on hand-sharded DTensor
weights — column-wise wq/wk/wv/w1/w3, row-wise wo/w2 — matches one device through forward,
backward and an AdamW step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.world import run_world

DIM, N_HEADS, N_KV_HEADS, FFN, SEQ = 64, 4, 2, 128, 8
HEAD_DIM = DIM // N_HEADS
COLWISE = ("wq", "wk", "wv", "w1", "w3")
ROWWISE = ("wo", "w2")


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "attention_norm": (DIM,),
        "ffn_norm": (DIM,),
        "wq": (N_HEADS * HEAD_DIM, DIM),
        "wk": (N_KV_HEADS * HEAD_DIM, DIM),
        "wv": (N_KV_HEADS * HEAD_DIM, DIM),
        "wo": (DIM, N_HEADS * HEAD_DIM),
        "w1": (FFN, DIM),
        "w3": (FFN, DIM),
        "w2": (DIM, FFN),
    }
    return {k: (torch.randn(s, generator=g) * 0.1 + (1.0 if "norm" in k else 0.0)) for k, s in shapes.items()}


def _freqs_cis(seq: int) -> torch.Tensor:
    freqs = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # (T, Dh/2) complex64


def _rms_norm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, Dh/2)
    return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)  # (B, T, H, Dh)


def block(x, p, freqs_cis):
    """x: (B, T, D). Under TP the head dims below are local-head counts times HEAD_DIM via -1."""
    B, T, _ = x.shape
    h = _rms_norm(x, p["attention_norm"])
    q = F.linear(h, p["wq"]).view(B, T, -1, HEAD_DIM)  # (B, T, H, Dh)    S(2) under TP
    k = F.linear(h, p["wk"]).view(B, T, -1, HEAD_DIM)  # (B, T, Hkv, Dh)
    v = F.linear(h, p["wv"]).view(B, T, -1, HEAD_DIM)
    fc = freqs_cis.view(1, T, 1, HEAD_DIM // 2)
    q, k = _rope(q, fc), _rope(k, fc)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)    S(1) under TP
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + F.linear(att.transpose(1, 2).reshape(B, T, -1), p["wo"])  # wo row-wise: P(sum) -> R
    h = _rms_norm(x, p["ffn_norm"])
    return x + F.linear(F.silu(F.linear(h, p["w1"])) * F.linear(h, p["w3"]), p["w2"])


def _train_step(x, target, params, freqs_cis, steps: int = 2):
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)
    losses, first_grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = ((block(x, params, freqs_cis) - target) ** 2).mean()
        loss.backward()
        if step == 0:
            first_grads = {k: v.grad.clone() for k, v in params.items()}
        opt.step()
        losses.append(loss)
    return losses, first_grads


def _run(mesh_shape: tuple[int, ...]) -> float:
    from parallelisms.dtensor import DTensor, Replicate, Shard, distribute_tensor
    from tests.dtensor.harness import get_mesh

    mesh = get_mesh(mesh_shape)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, SEQ, DIM, generator=g)
    target = torch.randn(2, SEQ, DIM, generator=g)
    ref = {k: v.clone().requires_grad_() for k, v in _params().items()}
    ref_losses, ref_grads = _train_step(x, target, ref, _freqs_cis(SEQ))

    dp = (Shard(0),) if len(mesh_shape) == 2 else ()  # a (dp, tp) mesh shards the batch on dp
    rep = (Replicate(),) * len(mesh_shape)

    def placements(name: str):
        tp = Shard(0) if name in COLWISE else Shard(1) if name in ROWWISE else Replicate()
        return (Replicate(),) * (len(mesh_shape) - 1) + (tp,)

    params = {k: distribute_tensor(v, mesh, placements(k)).requires_grad_() for k, v in _params().items()}
    dx = distribute_tensor(x, mesh, dp + (Replicate(),))
    dtarget = distribute_tensor(target, mesh, dp + (Replicate(),))
    losses, grads = _train_step(dx, dtarget, params, distribute_tensor(_freqs_cis(SEQ), mesh, rep))
    for k, g in grads.items():
        torch.testing.assert_close(
            g.full_tensor(), ref_grads[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"grad {k}: {m}"
        )
    for got, want in zip(losses, ref_losses):
        full = got.full_tensor() if isinstance(got, DTensor) else got
        torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
    worst = 0.0
    for k, v in params.items():
        # AdamW divides by sqrt(v): fp32 summation-order differences in tiny grads grow to ~1e-5
        want = ref[k].detach()
        torch.testing.assert_close(v.full_tensor(), want, atol=1e-4, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        worst = max(worst, (v.full_tensor() - ref[k].detach()).abs().max().item())
    return worst


def test_llama_block_train_step_matches_single_device_tp2():
    assert max(run_world(_run, 2, (2,))) < 1e-4


def test_llama_block_train_step_matches_single_device_dp2_tp2():
    assert max(run_world(_run, 4, (2, 2))) < 1e-4
