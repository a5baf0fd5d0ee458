"""Python's garbage collection at a fixed step cadence, the same on every rank (torchtitan's `gc_freq`).

The automatic collector runs whenever allocation counts cross its thresholds, which differ between ranks;
a rank that pauses for a full collection makes every peer wait for it in the next collective. So the
automatic collector is off for the job and every rank collects the young generations at the same steps.
"""

from __future__ import annotations

import gc
import logging
import time
from types import TracebackType

logger = logging.getLogger(__name__)


class GarbageCollection:
    """A context for the training loop: `step(n)` after each step collects every `freq` steps.

    With `debug`, it collects fully after every step and logs how many unreachable objects it found
    (reference cycles that plain refcounting would have freed at once are what to fix).
    """

    def __init__(self, freq: int, *, debug: bool = False) -> None:
        if freq < 1:
            raise ValueError(f"training.gc_freq={freq}: must be >= 1")
        self.freq, self.debug = freq, debug
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> GarbageCollection:
        gc.disable()
        gc.collect(1)  # what the build left behind, before the first step
        return self

    def step(self, step: int) -> None:
        if self.debug:
            found = gc.collect()
            logger.info("step %d: the garbage collector found %d unreachable objects", step, found)
        elif step % self.freq == 0:
            start = time.perf_counter()
            gc.collect(1)
            logger.debug("step %d: garbage collection took %.3f s", step, time.perf_counter() - start)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._was_enabled:
            gc.enable()
