"""Sharding rules: attention family (to be written)."""

from __future__ import annotations
