"""Sharding rules: norms family (to be written)."""

from __future__ import annotations
