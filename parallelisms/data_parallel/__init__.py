"""Data parallelism by replication (DDP): `replicate(module, mesh=None, *, bucket_cap_mb=25)`."""

from .buckets import assign_buckets
from .replicate import ReplicateModule, replicate

__all__ = ["ReplicateModule", "assign_buckets", "replicate"]
