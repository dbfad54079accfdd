"""Running a demo step: one real command, echoed before it runs, its output in a log file.

The demos are meant to be copied: every step prints the exact command, so a user can re-run any
of them by hand, and a failed step ends the demo with its log's tail (one ``AlmaError``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..errors import AlmaError

# One intra-op thread unless the user says otherwise: the demos' models are tiny, and on a busy
# machine OpenMP threads spin-waiting for each other slow them down many times over.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def tool(name: str) -> str:
    """Console script next to the running interpreter (the venv's), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def step(title: str, cmd: list[str], log: Path) -> str:
    """Run one command, echoing it; output goes to ``log`` and is returned.  Exits on failure."""
    print(f"\n== {title}\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.time()
    env = {**ONE_THREAD, **os.environ}
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env)
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise AlmaError(f"step '{title}' failed (exit {proc.returncode}); log: {log}\n{tail}")
    print(f"   done in {time.time() - start:.0f}s (log: {log})", flush=True)
    return text
