"""Experimental APIs, named as in torch DTensor's experimental module: `implicit_replication`."""

from .dispatch import implicit_replication

__all__ = ["implicit_replication"]
