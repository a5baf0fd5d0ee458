"""Sharding rules: matmul family (to be written)."""

from __future__ import annotations
