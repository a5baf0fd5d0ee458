"""A small Llama and ONE training program for the FSDP x TP composition matrix (tests/fsdp/test_composition.py).

`train(backend, layout)` runs on every rank of a world of `world_size(layout)` ranks. `backend` picks
the namespace the program imports from -- torch's (torch.distributed.device_mesh / fsdp / tensor /
tensor.parallel / tensor.debug) or ours (parallelisms.dtensor / fsdp / tensor_parallel /
dtensor.debug) -- and nothing else differs: same model, same torchtitan-style TP plan, same FSDP
wrapping, same batches, optimizer and clipping. `reference()` is the same training on one process
with the whole global batch. Everything is fp32.

The model is independent of models/llama3: RMSNorm, real-valued (rotate-half) RoPE from a buffer on
the root, multi-head attention with wq/wk/wv/wo (no biases, `view(B, T, -1, head_dim)` so TP's local
head counts work), SwiGLU w1/w2/w3. Dims are chosen so dim 0 is uneven under the shardings: vocab 37
(TP: 19 | 18, then FSDP over those), ffn hidden 42 (FSDP-4: 11, 11, 11, 9; TP-2 then FSDP-2: 21 ->
11 | 10).

Imports of either backend are lazy, so the torch oracle runs even when ours does not import.
"""

from __future__ import annotations

import math
import types
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, N_HEADS, HIDDEN, N_LAYERS = 37, 16, 4, 42, 2
HEAD_DIM = DIM // N_HEADS  # 4; TP-2 leaves 2 heads per rank
SEQ, GLOBAL_BATCH = 8, 8  # SEQ divisible by tp (sequence parallel); GLOBAL_BATCH by every dp size
LR, MAX_NORM = 1e-2, 1.0
COUNTED_STEP = 2  # collectives counted by the backend's own CommDebugMode (forward, backward, clip, step)
BYTES_STEP = 3  # counts and bytes by our CommDebugMode, for both backends: one meter for both

# mesh dims (outer to inner, row-major as init_device_mesh lays them out) and their sizes
LAYOUTS: dict[str, dict[str, int]] = {
    "fsdp2": {"dp_shard": 2},
    "fsdp4": {"dp_shard": 4},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
    "hsdp2x2_tp2": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
}


def world_size(layout: str) -> int:
    return math.prod(LAYOUTS[layout].values())


# ------------------------------------------------------------------------------------------ model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_table(seq: int = SEQ, head_dim: int = HEAD_DIM, theta: float = 10000.0) -> torch.Tensor:
    """(2, seq, head_dim // 2): cos and sin of position * frequency."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, head_dim), rotate-half form."""
    t = x.shape[1]
    cos, sin = rope[0, :t, None, :], rope[1, :t, None, :]  # (T, 1, head_dim // 2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # under TP x is a replicated DTensor: its shape is the global one
        q = self.wq(x).view(b, t, -1, HEAD_DIM)  # (B, T, local heads, head_dim)
        k = self.wk(x).view(b, t, -1, HEAD_DIM)
        v = self.wv(x).view(b, t, -1, HEAD_DIM)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, DIM)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class SmallLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("rope", rope_table(), persistent=False)  # as torchtitan's freqs_cis

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, DIM); under SP the local (B, T / tp, DIM)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))  # (B, T, VOCAB); under TP a DTensor sharded on VOCAB


def build_model() -> SmallLlama:
    """The full model, identical on every rank and in the reference (same seed)."""
    torch.manual_seed(0)
    return SmallLlama()


# ------------------------------------------------------------------------------------ backends
def namespace(backend: str) -> types.SimpleNamespace:
    """The names the program uses, from torch's packages or from ours."""
    if backend == "torch":
        import torch.distributed.device_mesh as mesh_mod
        import torch.distributed.fsdp as fsdp_mod
        import torch.distributed.tensor as dtensor_mod
        import torch.distributed.tensor.debug as debug_mod
        import torch.distributed.tensor.parallel as tp_mod
    elif backend == "ours":
        import parallelisms.dtensor as dtensor_mod
        import parallelisms.dtensor as mesh_mod
        import parallelisms.dtensor.debug as debug_mod
        import parallelisms.fsdp as fsdp_mod
        import parallelisms.tensor_parallel as tp_mod
    else:
        raise ValueError(f"backend must be 'torch' or 'ours', not {backend!r}")
    names = [  # (module, names): ours has mesh and DTensor in one module, so not a dict
        (mesh_mod, ["init_device_mesh"]),
        (fsdp_mod, ["fully_shard"]),
        (dtensor_mod, ["DTensor", "Replicate", "Shard"]),
        (debug_mod, ["CommDebugMode"]),
        (tp_mod, ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel"]),
        (tp_mod, ["PrepareModuleInput", "loss_parallel"]),
    ]
    return types.SimpleNamespace(**{n: getattr(mod, n) for mod, ns in names for n in ns})


_MESHES: dict[tuple, object] = {}  # per rank process: worlds live across tests, process groups are not free


def get_world_mesh(backend: str, layout: str):
    dims = LAYOUTS[layout]
    assert dist.get_world_size() == world_size(layout), (layout, dist.get_world_size())
    key = (backend, tuple(dims.items()))
    if key not in _MESHES:
        _MESHES[key] = namespace(backend).init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    return _MESHES[key]


def _submesh(mesh, names: tuple[str, ...]):
    return mesh if tuple(mesh.mesh_dim_names) == names else mesh[names if len(names) > 1 else names[0]]


def apply_tp(model: SmallLlama, tp_mesh, ns: types.SimpleNamespace) -> None:
    """torchtitan's Llama plan: sequence parallel norms, colwise-in / rowwise-out projections,
    vocabulary-sharded logits for loss_parallel."""
    Replicate, Shard = ns.Replicate, ns.Shard
    ns.parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": ns.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": ns.SequenceParallel(),
            "output": ns.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.layers:
        ns.parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": ns.SequenceParallel(),
                "attention": ns.PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ns.ColwiseParallel(),
                "attention.wk": ns.ColwiseParallel(),
                "attention.wv": ns.ColwiseParallel(),
                "attention.wo": ns.RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": ns.SequenceParallel(),
                "feed_forward": ns.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ns.ColwiseParallel(),
                "feed_forward.w2": ns.RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ns.ColwiseParallel(),
            },
        )


def apply_fsdp(model: SmallLlama, dp_mesh, ns: types.SimpleNamespace) -> None:
    """Each block, the embedding, [norm, output] as one group (not resharded after forward, as
    torchtitan's default: backward needs it first), then the root."""
    for block in model.layers:
        ns.fully_shard(block, mesh=dp_mesh)
    ns.fully_shard(model.tok_embeddings, mesh=dp_mesh)
    ns.fully_shard([model.norm, model.output], mesh=dp_mesh, reshard_after_forward=False)
    ns.fully_shard(model, mesh=dp_mesh)


# -------------------------------------------------------------------------------------- training
def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # ours or torch's DTensor


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tokens, labels, loss_ctx=nullcontext):
    """One step: forward, loss (mean over this batch), backward, clip to MAX_NORM, AdamW. Returns the
    loss and the pre-clip gradient norm (plain tensors)."""
    opt.zero_grad(set_to_none=True)
    with loss_ctx():
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
    norm = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    opt.step()
    return _full(loss.detach()), norm.detach()


def _counts(comm) -> dict[str, int]:
    return {str(k).split(".")[-1]: int(v) for k, v in comm.get_comm_counts().items() if v}


def train(backend: str, layout: str, steps: int = 5) -> dict:
    """Run on every rank of a world of `world_size(layout)` ranks; returns this rank's
    {losses, grad_norms (per step, averaged over dp ranks), params (full, by FQN), placements,
    comm_counts (backend's CommDebugMode, step COUNTED_STEP), comm_counts_ours_meter and
    comm_bytes (our CommDebugMode, step BYTES_STEP), dp_rank}."""
    ns = namespace(backend)
    dims = LAYOUTS[layout]
    mesh = get_world_mesh(backend, layout)
    tp = dims.get("tp", 1)
    model = build_model()
    if tp > 1:
        apply_tp(model, mesh["tp"], ns)
    apply_fsdp(model, _submesh(mesh, tuple(d for d in dims if d.startswith("dp_"))), ns)
    opt = make_optimizer(model)

    coordinate = dict(zip(dims, mesh.get_coordinate()))
    dp_rank = coordinate.get("dp_replicate", 0) * dims["dp_shard"] + coordinate["dp_shard"]
    per_dp = GLOBAL_BATCH // (dims.get("dp_replicate", 1) * dims["dp_shard"])
    loss_ctx = ns.loss_parallel if tp > 1 else nullcontext

    out: dict = {"losses": [], "grad_norms": [], "dp_rank": dp_rank}
    try:  # our meter for both backends (torch's counts no bytes); the torch oracle must not need ours
        from parallelisms.dtensor.debug import CommDebugMode as OurMeter
    except Exception as e:  # reported: the meter tests fail on it
        OurMeter, out["meter_error"] = None, f"{type(e).__name__}: {e}"
    for step in range(steps):
        tokens, labels = (t[dp_rank * per_dp : (dp_rank + 1) * per_dp] for t in global_batch(step))
        if step == COUNTED_STEP:
            meter = ns.CommDebugMode()
        elif step == BYTES_STEP and OurMeter is not None:
            meter = OurMeter()
        else:
            meter = nullcontext()
        with meter, warnings.catch_warnings():
            # torch's FSDP: the root's logits are a view of the matmul; the embedding's inputs need no grad
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss, norm = train_step(model, opt, tokens, labels, loss_ctx)
        if step == COUNTED_STEP:
            out["comm_counts"] = _counts(meter)
        elif step == BYTES_STEP and OurMeter is not None:
            out["comm_counts_ours_meter"] = _counts(meter)
            out["comm_bytes"] = {str(k).split(".")[-1]: int(v) for k, v in meter.get_comm_bytes().items() if v}
        # tp ranks of a dp group hold the same loss: the world mean is the dp mean
        stats = torch.stack([loss, norm]).float()
        dist.all_reduce(stats)
        stats /= dist.get_world_size()
        out["losses"].append(stats[0].item())
        out["grad_norms"].append(stats[1].item())

    out["params"] = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    out["placements"] = {
        n: f"{tuple(p.device_mesh.mesh_dim_names or ())} {tuple(map(str, p.placements))}"
        for n, p in model.named_parameters()
        if isinstance(p, ns.DTensor)
    }
    out["all_dtensor"] = all(isinstance(p, ns.DTensor) for p in model.parameters())
    return out


def reference(steps: int = 5) -> dict:
    """The same training on one process, the whole global batch each step: {losses, grad_norms, params}."""
    model = build_model()
    opt = make_optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        loss, norm = train_step(model, opt, *global_batch(step))
        losses.append(loss.item())
        norms.append(norm.item())
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
