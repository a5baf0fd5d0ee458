"""The fixed metrics line."""

from __future__ import annotations

from trainer.metrics import format_metrics


def test_metrics_line_format() -> None:
    line = format_metrics(10, 3.21449, 1.0234, 3e-4, 12345.4, 41.23, 1.234)
    assert line == "step 10 | loss 3.2145 | grad_norm 1.02 | lr 3.0e-4 | tok/s 12,345 | mfu 41.2% | mem 1.2GiB"
    assert "mfu n/a" in format_metrics(1, 1.0, 1.0, 1e-3, 1.0, None, 0.1)
