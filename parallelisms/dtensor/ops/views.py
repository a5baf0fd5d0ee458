"""Sharding rules: views family (to be written)."""

from __future__ import annotations
