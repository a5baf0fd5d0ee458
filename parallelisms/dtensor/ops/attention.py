"""Sharding rules: scaled dot-product attention kernels (forward and backward).

`F.scaled_dot_product_attention` picks a kernel before dispatch: on CPU (torch 2.13)
`_scaled_dot_product_flash_attention_for_cpu`, on CUDA the flash / efficient / cudnn kernels, and
with a float mask on CPU the math path, which decomposes into bmm / softmax ops (other families).
q is (B, H, Tq, D), k and v are (B, Hkv, Tk, D), logsumexp is (B, H, Tq). One mesh dim at a time:

    batch    q, k, v S(0)           -> out, lse S(0)     sequences are independent
    heads    q, k, v S(1)           -> out, lse S(1)     heads are independent
    queries  q S(2), k, v R         -> out, lse S(2)     each query row sees every key; CPU kernels
                                                          only, and not causal (the causal mask is
                                                          aligned to the local rows)
    otherwise (Tk or D sharded, Partial)  -> gather to R

GQA (`enable_gqa`, Hkv < H): local q head j uses local kv head j // (H / Hkv), which is the global
mapping only when every mesh dim sharding heads splits both H and Hkv evenly; otherwise heads are
gathered. A mask or bias (broadcast to (B, H, Tq, Tk)) is sharded like q on a dim it spans and
replicated on a dim it broadcasts. Backward: grads follow their inputs, except that with queries
sharded each rank holds one term of dk and dv (P(sum)), and a broadcast bias gets a P(sum) grad.

The CPU kernel crashes (SIGFPE) on an empty shard of heads or query rows (an empty batch is fine),
which uneven `torch.chunk` splits produce (3 heads on 4 ranks), so those layouts are offered only
when the pure chunk math leaves every piece non-empty (`splits_without_empty`). (These kernels are
tagged random for dropout and run through random.run_seeded, so a local_impl could not guard them.)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from torch.ops import aten

from ..placements import Partial, Placement, Replicate, Shard, chunk_sizes
from ..spec import DTensorSpec
from .registry import OpCall, Sharding, register

R = Replicate()
PARTIAL_SUM = Partial("sum")

# roles of DTensor inputs, by schema name
Q_LIKE = {"query", "grad_out", "grad_out_", "out"}  # (B, H, Tq, D)
KV_LIKE = {"key", "value"}  # (B, Hkv, Tk, D)
LSE = {"logsumexp", "log_sumexp"}  # (B, H, Tq) (padded Tq on CUDA's efficient kernel)
MASK = {"attn_mask", "attn_bias", "dropout_mask"}  # broadcast to (B, H, Tq, Tk)

# output roles per op: q-like, lse, kv-grad, bias-grad, replicated bookkeeping, None (not a tensor)
OUTPUT_ROLES: dict[str, tuple[str | None, ...]] = {
    "_scaled_dot_product_flash_attention_for_cpu": ("q", "lse"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": ("q", "kv", "kv"),
    "_scaled_dot_product_attention_math": ("q", "q"),  # out, attention weights (B, H, Tq, Tk)
    "_scaled_dot_product_flash_attention": ("q", "lse", "r", "r", None, None, "r", "r", "r"),
    "_scaled_dot_product_flash_attention_backward": ("q", "kv", "kv"),
    "_scaled_dot_product_efficient_attention": ("q", "lse", "r", "r"),
    "_scaled_dot_product_efficient_attention_backward": ("q", "kv", "kv", "bias"),
    "_scaled_dot_product_cudnn_attention": ("q", "lse", "r", "r", None, None, "r", "r", "r"),
    "_scaled_dot_product_cudnn_attention_backward": ("q", "kv", "kv"),
    "_scaled_dot_product_fused_attention_overrideable": ("q", "lse", "r", "r", None, None, "r", "r", "r"),
    "_scaled_dot_product_fused_attention_overrideable_backward": ("q", "kv", "kv", "bias"),
}
# kernels whose logsumexp is exactly (B, H, Tq), tested with sharded query rows
QUERY_SHARDABLE = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_attention_math",
}


class Layout(NamedTuple):
    """One mesh dim: placements of q-like tensors and of k/v; `queries` when q rows are sharded."""

    q: Placement
    kv: Placement

    @property
    def queries(self) -> bool:
        return self.q == Shard(2)


def layout_options(placements: Sequence[Placement], query: Placement, allow_queries: bool) -> list[Layout]:
    """One mesh dim's layouts, offered only where some input already has them (plus R)."""
    options = [Layout(R, R)]
    for dim in (0, 1):
        if Shard(dim) in placements:
            options.append(Layout(Shard(dim), Shard(dim)))
    if allow_queries and query == Shard(2):
        options.append(Layout(Shard(2), R))
    return options


def heads_split_evenly(heads: int, kv_heads: int, mesh_sizes: Sequence[int]) -> bool:
    """GQA: each mesh dim sharding heads (in nesting order) must split H and Hkv into equal pieces."""
    if heads == kv_heads:  # one kv head per q head: uneven chunks of both still line up
        return True
    for n in mesh_sizes:
        if heads % n or kv_heads % n:
            return False
        heads, kv_heads = heads // n, kv_heads // n
    return True


def splits_without_empty(size: int, mesh_sizes: Sequence[int]) -> bool:
    """Whether nested `torch.chunk` splits of `size` over `mesh_sizes` leave every piece non-empty."""
    pieces = {size}
    for n in mesh_sizes:
        pieces = {c for piece in pieces for c in chunk_sizes(piece, n)}
        if 0 in pieces:
            return False
    return True


def legal(combo: Sequence[Layout], mesh_shape: Sequence[int], query: DTensorSpec, key: DTensorSpec) -> bool:
    """Heads split evenly enough for GQA, and no empty piece of heads or query rows."""
    heads = [n for layout, n in zip(combo, mesh_shape) if layout.q == Shard(1)]
    rows = [n for layout, n in zip(combo, mesh_shape) if layout.q == Shard(2)]
    return (
        heads_split_evenly(query.shape[1], key.shape[1], heads)
        and splits_without_empty(key.shape[1], heads)  # Hkv <= H
        and splits_without_empty(query.shape[2], rows)
    )


def mask_placement(mask: DTensorSpec, layout: Layout, query: DTensorSpec) -> Placement:
    """A broadcast mask follows q on the dim it spans (same size), else it is replicated there."""
    if not isinstance(layout.q, Shard):
        return R
    dim = layout.q.dim - (4 - mask.ndim)  # masks broadcast from the right
    if dim >= 0 and mask.shape[dim] == query.shape[layout.q.dim]:
        return Shard(dim)
    return R


def input_target(name: str, spec: DTensorSpec, layout: Layout, query: DTensorSpec) -> Placement:
    if name in Q_LIKE or name in LSE:
        return layout.q
    if name in KV_LIKE:
        return layout.kv
    if name in MASK:
        return mask_placement(spec, layout, query)
    return R  # rng state, cumulative lengths: bookkeeping, replicated


def output_placement(role: str, layout: Layout, bias: Placement | None) -> Placement:
    if role in ("q", "lse"):
        return layout.q
    if role == "kv":  # sharded query rows: each rank's dk, dv sum over its rows only
        return PARTIAL_SUM if layout.queries else layout.kv
    if role == "bias":  # a bias broadcast over a sharded dim gets one term of its grad per rank
        if isinstance(bias, Shard):
            return bias
        return PARTIAL_SUM if isinstance(layout.q, Shard) else R
    return R


@register(*(getattr(aten, name).default for name in OUTPUT_ROLES if hasattr(aten, name)))
def attention_rule(call: OpCall) -> list[Sharding]:
    """Product over mesh dims of the layouts some input has, minus illegal head / row splits."""
    name = call.op._schema.name.split("::")[1]
    named = call.bound.named_specs()
    specs = dict(named)
    query, key = specs["query"], specs["key"]
    allow_queries = name in QUERY_SHARDABLE and not call.bound["is_causal"]
    if _returns_debug_mask(call):  # (B, H, Tq, Tk) debug output: keep it simple, replicate
        return [_sharding(call, named, query, (Layout(R, R),) * call.mesh_ndim)]
    per_dim = [
        layout_options([s.placements[m] for n, s in named if n in Q_LIKE | KV_LIKE], query.placements[m], allow_queries)
        for m in range(call.mesh_ndim)
    ]
    mesh_shape = query.mesh.shape
    return [
        _sharding(call, named, query, combo)
        for combo in itertools.product(*per_dim)
        if legal(combo, mesh_shape, query, key)
    ]


def _returns_debug_mask(call: OpCall) -> bool:
    return bool(call.bound.get("return_debug_mask", False))  # False for ops without the argument


def _sharding(call: OpCall, named, query: DTensorSpec, combo: Sequence[Layout]) -> Sharding:
    inputs = tuple(tuple(input_target(n, s, layout, query) for layout in combo) for n, s in named)
    bias = next((targets for (n, _), targets in zip(named, inputs) if n in MASK), None)
    roles = OUTPUT_ROLES[call.op._schema.name.split("::")[1]]
    outputs = tuple(
        None
        if role is None
        else tuple(output_placement(role, layout, bias[m] if bias else None) for m, layout in enumerate(combo))
        for role in roles
    )
    return Sharding(inputs, outputs)
