"""Sharding rules: embedding family (to be written)."""

from __future__ import annotations
