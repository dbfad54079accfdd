"""Running a demo step: one real command, echoed before it runs, its output in a log file.

The demos are meant to be copied: every step prints the exact command, so a user can re-run any
of them by hand.  Each attempt's output is appended to the step's log under a header line, so a
re-run (where a finished training says only "nothing to train") keeps the log of the training
that did the work.  A step whose outputs the tool found finished and left as they were says
"skipped"; a failed step ends the demo with one ``AlmaError`` line: the tool's own error line
(not the tail of a log that starts with fairseq's whole config), with advice in the demo's terms.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

from ..errors import AlmaError, Preempted, first_line

# One intra-op thread unless the user says otherwise: the demos' models are tiny, and on a busy
# machine OpenMP threads spin-waiting for each other slow them down many times over.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# ``<prog>: error: ...``: the one line every console tool of the project ends a refusal with
TOOL_ERROR = re.compile(r"^[\w.-]+: error: ")
# the last line of a traceback: ``SomeError: message`` (a bug in a tool, not a refusal)
EXCEPTION_LINE = re.compile(r"^\w+(\.\w+)*(Error|Exception|Interrupt)\b")
# A tool's way out that names its own flags (another --save-dir, --restart-stream, --clean): the
# demo chose those flags, so its user's way out is an alma-demo one (``demo_advice``)
TOOL_ONLY_ADVICE = re.compile(r";\s*(?:move it aside or )?use another --save-dir\b.*$"
                              r"|;\s*[^;]*--(?:restart-stream|clean)\b.*$")
# "...; wait for that run to end or stop it, or use another --save-dir" (a held run lock): the
# way out that is the demo's too stays, the tool's flag goes
SAVE_DIR_ALTERNATIVE = re.compile(r",\s*or use another --save-dir\b")
ERROR_LINE_LIMIT = 400
# A stop sent to the demo's process alone (a batch system's SIGTERM, `kill PID`, a closed
# terminal's SIGHUP) is passed on to the running step as SIGTERM: a training saves where it is
# and exits, instead of training on without its parent and holding its run directory's lock.
# Ctrl-C needs nothing: the terminal sends SIGINT to the whole process group.
FORWARDED_STOPS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def tool(name: str) -> str:
    """Console script next to the running interpreter (the venv's), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def step(title: str, cmd: list[str], log: Path,
         product: Callable[[], object] | None = None) -> str:
    """Run one command, echoing it; its output is appended to ``log`` and returned.  Raises
    ``AlmaError`` on failure.  ``product`` gives the state of what the step makes (None: not
    there yet); unchanged by the command, the step is reported as skipped."""
    print(f"\n== {title}\n$ {shown_command(cmd)}", flush=True)
    before = product() if product else None
    start = time.time()
    status, text = run_attempt(cmd, log, f"alma-demo step '{title}'", {**ONE_THREAD, **os.environ})
    if status != 0:
        raise AlmaError(failure_message(title, status, text, log))
    if before is not None and product() == before:
        print(f"   skipped: done earlier, its output reused (log: {log})", flush=True)
    else:
        print(f"   done in {time.time() - start:.0f}s (log: {log})", flush=True)
    return text


def shown_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def run_attempt(cmd: list[str], log: Path, header: str, env: dict[str, str]) -> tuple[int, str]:
    """Run ``cmd`` with its output appended to ``log`` under one header line (``header`` and the
    command), so an earlier attempt's output stays; (exit status, this attempt's output).
    Raises ``Preempted`` once the step has stopped if the demo was told to stop meanwhile
    (``FORWARDED_STOPS``)."""
    separator = "\n" if log.is_file() and log.stat().st_size else ""
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"{separator}===== {datetime.now():%Y-%m-%d %H:%M:%S} {header}\n"
                 f"$ {shown_command(cmd)}\n")
        fh.flush()
        offset = log.stat().st_size
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        with stops_forwarded_to(proc) as received:
            status = proc.wait()
    if received:
        raise Preempted(f"{header} stopped on {received[0]} (passed on to it, exit {status}: a "
                        f"training saves where it is); run the same command again to continue "
                        f"(log: {log})")
    return status, log.read_bytes()[offset:].decode("utf-8", errors="replace")


@contextlib.contextmanager
def stops_forwarded_to(proc: subprocess.Popen) -> Iterator[list[str]]:
    """While the block runs, ``FORWARDED_STOPS`` reaching this process are sent on to ``proc``
    as SIGTERM; yields the names of those received.  Handlers are put back afterwards (signals
    can be taken only in the main thread: elsewhere nothing is forwarded)."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001
        received.append(signal.Signals(signum).name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_STOPS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def without_tool_advice(line: str) -> tuple[str, bool]:
    """``line`` without a tool's way out that names the tool's own flags (``TOOL_ONLY_ADVICE``:
    the demo chose those flags), and whether it had one."""
    stripped = TOOL_ONLY_ADVICE.sub("", line)
    return SAVE_DIR_ALTERNATIVE.sub("", stripped), stripped != line


def failure_message(title: str, status: int, output: str, log: Path) -> str:
    """One line: the step, the tool's error line(s) (or a traceback's last line, or the last
    line of output), what to do in the demo's terms, and the log."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if TOOL_ERROR.match(line)]
    if not errors:
        errors = [line for line in lines if EXCEPTION_LINE.match(line)][-1:] or lines[-1:]
    shown = [without_tool_advice(line)[0] for line in errors[-2:]]
    reason = " / ".join(first_line(RuntimeError(line), ERROR_LINE_LIMIT) for line in shown)
    return (f"step '{title}' failed (exit {status}): {reason or 'no output'}; "
            f"{demo_advice(errors)} (log: {log})")


def demo_advice(errors: list[str]) -> str:
    """The next step for someone who ran alma-demo, not the tool inside it."""
    if any(TOOL_ONLY_ADVICE.search(line) for line in errors):
        return ("it holds what another alma-demo command made: use another --out, or the flags "
                "that made it")
    return "fix that and run the same alma-demo command again (finished steps are reused)"
