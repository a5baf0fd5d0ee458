"""Sharding rules: foreach family (to be written)."""

from __future__ import annotations
