"""Block-causal (document) attention, as Llama 3 was pre-trained: inside a packed row a token attends to the
earlier tokens of its own document only (imports only torch).

A document ends at its EOS token, which belongs to the document it ends (torchtitan's mask): the document id of
token t is the number of EOS tokens before t (`document_ids`). A row without an EOS is one document. RoPE is
relative, so a document's logits at any offset in the row equal its logits alone.

Kernels (`block_causal_attention`), all exact:
    "segments"  one causal SDPA per (row, document): every block the mask removes is skipped, so a row of n
                documents of T/n tokens costs 1/n of causal attention. The document boundaries are read to the
                host once per batch (cached by the ids tensor). Eager.
    "mask"      SDPA with the boolean mask (B, 1, T, T): traceable, used while torch.compile traces.
    "flex"      FlexAttention with a BlockMask (fully masked blocks skipped), where torch supports it forward and
                backward: CUDA. On the CPU, torch's FlexAttention has no backward: "segments" runs instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch._dynamo.comptime import comptime
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

DocumentKernel = Literal["segments", "mask", "flex"]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# by the ids tensor itself: every block of a forward reads the same one
_segments: WeakIdKeyDictionary = WeakIdKeyDictionary()
_block_masks: WeakIdKeyDictionary = WeakIdKeyDictionary()


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int32: the document of each token, counted from 0 in each row; an EOS ends its own document."""
    eos = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(eos, dim=-1, dtype=torch.int32) - eos


def segments(documents: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's documents as [start, end) token ranges, read once per ids tensor."""
    found = _segments.get(documents)
    if found is None:
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        length = documents.shape[-1]
        found = []
        for row in starts.tolist():
            begins = [t for t, start in enumerate(row) if start]
            found.append(list(zip(begins, [*begins[1:], length])))
        _segments[documents] = found
    return found


def choose_kernel(use_flex: bool, device: torch.device, tracing: bool) -> DocumentKernel:
    if use_flex and device.type == "cuda":
        return "flex"
    if use_flex:
        if tracing:  # a log call is not graph code: said while dynamo traces (comptime closes over nothing)
            comptime(lambda ctx: _say_once(_FLEX_ON_CPU))
        else:
            _say_once(_FLEX_ON_CPU)
    return "mask" if tracing else "segments"


_FLEX_ON_CPU = "use_flex_attn=True: torch's FlexAttention has no backward on the CPU; the per-document SDPA runs"


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


def block_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    *,
    causal: Attention,
    use_flex: bool = False,
) -> torch.Tensor:
    """Attention of (B, H, T, Dh) queries over (B, Hkv, T, Dh) keys and values in which each token sees only its
    document's earlier tokens; `documents` (B, T) from `document_ids`; `causal` the family's causal attention
    (run per document)."""
    kernel = choose_kernel(use_flex, q.device, torch.compiler.is_compiling())
    if kernel == "segments":
        rows = []
        for b, spans in enumerate(segments(documents)):
            parts = [causal(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e]) for s, e in spans]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)
    if kernel == "mask":
        return masked_attention(q, k, v, block_causal_mask(documents))
    return _flex_attention(q, k, v, documents)


def block_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query t may see key s (the same document, s <= t)."""
    mask = documents[:, None, :, None] == documents[:, None, None, :]
    return mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA under a boolean mask; keys and values may be fewer heads (grouped-query) and another head size."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, *, compiled: bool = True
) -> torch.Tensor:
    """FlexAttention under the block-causal BlockMask (made once per ids tensor); `compiled` as FlexAttention is
    meant to run (eager it materializes the scores: the CPU check of the mask function runs it so, since torch
    2.13's CPU codegen for compiled FlexAttention is wrong or fails on these masks)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = _block_masks.get(documents)
    if block_mask is None:

        def same_document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (documents[b, q_idx] == documents[b, kv_idx])

        batch, length = documents.shape
        block_mask = create_block_mask(same_document_causal, batch, None, length, length, device=q.device)
        _block_masks[documents] = block_mask
    attend = _compiled_flex() if compiled else cast(Callable[..., torch.Tensor], flex_attention)
    return attend(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # FlexAttention is a compiled kernel; eager it materializes the scores
