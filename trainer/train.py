"""Training entry point: `python -m trainer.train --job.config_file FILE [--section.key value ...]`.

The trainer issue has not landed yet: this entry point is final, the training loop is not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job.config_file", dest="config_file", default="./configs/debug_model.toml")
    args, overrides = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank{os.environ.get('RANK', '0')}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logger.info("config %s, overrides %s", args.config_file, overrides)
    logger.info(
        "trainer not built yet: the DTensor core is in place (parallelisms.dtensor); the training loop is a later issue"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
