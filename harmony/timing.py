"""Where a command's seconds go: each stage's duration, logged at INFO (``harmony -v compile``).

A compile of a large model runs for seconds, spent in stages of very different kinds (building the
model, decomposing it, profiling, one search per mode); ``-v`` tells which to blame.
``bench/compile_time.py`` reads these records (``STAGE_MESSAGE``, its arguments the stage's name
and seconds) to break a fresh process's compile down.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

log = logging.getLogger(__name__)

__all__ = ["STAGE_MESSAGE", "log_stage", "stage"]

STAGE_MESSAGE = "%s: %.3f s"


def log_stage(name: str, seconds: float) -> None:
    """Log that stage ``name`` took ``seconds`` (measured elsewhere: a comparison worker's search)."""
    log.info(STAGE_MESSAGE, name, seconds)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Times the block and logs it as stage ``name``; a block that raises logs nothing."""
    start = time.perf_counter()
    yield
    log_stage(name, time.perf_counter() - start)
