"""TrainState: the loop's own progress, checkpointed beside the model so a resumed job continues it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken (the next step is step + 1)."""
    tokens_seen: int = 0
    """Global tokens trained on so far."""
    skipped_steps: int = 0
    """Steps whose update was skipped for a non-finite gradient norm (training.skip_nonfinite_steps)."""

    def advance(self, step: int, *, tokens: int, skipped: bool = False) -> None:
        """Step `step` is done: it trained on `tokens` global tokens (or skipped its update)."""
        self.step = step
        self.tokens_seen += tokens
        self.skipped_steps += int(skipped)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, int(value))
