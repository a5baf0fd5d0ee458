"""The dry run: a training step traced on fake tensors in one CPU process, priced for a target device.

`trace.py` runs the trainer's own step under a fake process group and counts live bytes (`live_bytes.py`,
`allocator.py`), collectives and FLOPs; `sampling.py` puts short traces on a line to the whole model;
`pricing.py` turns them into a step time on `devices.py`'s tables; `dry_run.py` estimates one layout;
`search.py` ranks layouts; `cli.py` is `python -m trainer.estimate`.
"""

from .cli import main
from .dry_run import LOG_FORMAT, Estimate, estimate

__all__ = ["LOG_FORMAT", "Estimate", "estimate", "main"]
