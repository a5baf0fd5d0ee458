"""Experimental APIs, as torch.distributed.tensor.experimental: `implicit_replication`."""

from .dispatch import implicit_replication

__all__ = ["implicit_replication"]
