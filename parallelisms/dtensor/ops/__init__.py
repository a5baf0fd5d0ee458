"""Sharding rules, one module per op family; importing this package registers them all."""

from .registry import RULES, OpCall, Sharding, register, rule_file_for  # noqa: F401
from . import tensor_ops  # noqa: F401  (registers)
