"""The attention masks a model may train with (torch-free: the pre-flight checks flavors without torch)."""

from __future__ import annotations

MASK_TYPES = ("causal", "block_causal")


def check_mask_type(attn_mask_type: str) -> None:
    """ValueError naming the choices: "causal", or "block_causal" (document masking, models/common/documents.py)."""
    if attn_mask_type not in MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r}: expected one of {MASK_TYPES}")
