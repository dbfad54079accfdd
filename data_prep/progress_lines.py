"""Progress lines on stderr for the long steps (documents and MB so far, rate).

Printed at most every ``interval`` seconds as whole lines (not ``\\r`` redraws) so they read well
in Slurm logs too.
"""

from __future__ import annotations

import sys
import time


def log(message: str) -> None:
    print(f"alma-data-prep: {message}", file=sys.stderr, flush=True)


class Progress:
    def __init__(self, step: str, unit: str = "documents", interval: float = 5.0) -> None:
        self.step = step
        self.unit = unit
        self.interval = interval
        self.items = 0
        self.bytes = 0
        self.start = self.last = time.monotonic()

    def update(self, items: int, nbytes: int) -> None:
        """Add ``items`` (documents, or chunks) and ``nbytes`` of text just processed."""
        self.items += items
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            log(f"{self.step}: {self._counts(now)}")

    def finish(self) -> float:
        """Print the final counts; return the seconds spent."""
        now = time.monotonic()
        log(f"{self.step}: done, {self._counts(now)}")
        return now - self.start

    def _counts(self, now: float) -> str:
        mb = self.bytes / 1e6
        rate = mb / max(now - self.start, 1e-9)
        return f"{self.items:,} {self.unit}, {mb:,.1f} MB ({rate:,.1f} MB/s)"
