"""Sharding rules: pointwise family (to be written)."""

from __future__ import annotations
