"""Console scripts run in forked children of one process that has already imported torch and
fairseq: the same entry-point function the installed script calls, in a fresh process of its
own, without paying the seven seconds of imports again for every call.

Why: ``tests/test_bad_inputs.py`` runs about ninety ``fairseq-train`` cases that each fail
before any model is built, so nearly all of a subprocess's time was torch's and fairseq's
import.  A fork of a process that imported them (and nothing of ``fairseq_alma``, which
``--user-dir`` still imports in the child, as in a real run) gives each case its own process,
exit status, stdout and stderr, exactly like the console script.

Run as a script, this file is the server: one JSON request per line on stdin, one JSON reply
per line on stdout.  ``ForkedCommands`` is the client.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from importlib.metadata import entry_points
from pathlib import Path


def _exit_status(code: object) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """In the forked child: become the console script, then leave without returning."""
    status = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdout = sys.__stdout__  # the server points it at stderr (its fd 1 is the reply channel)
        os.chdir(request["cwd"])
        if request.get("whole_env"):  # the caller's complete environment, as subprocess.run(env=...)
            os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        name = os.path.basename(sys.argv[0])
        (script,) = entry_points(group="console_scripts", name=name)
        try:
            status = _exit_status(script.load()())
        except SystemExit as exit_:
            status = _exit_status(exit_.code)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught one
            traceback.print_exc()
            status = 1
    finally:
        try:
            atexit._run_exitfuncs()  # as at interpreter exit: a run's lock releases itself there
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def _wait(pid: int, timeout: float) -> int:
    """The child's exit status as ``subprocess`` reports it (minus the signal if killed)."""
    deadline = time.monotonic() + timeout
    while True:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(raw)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.02)


def serve(preload: list[str]) -> None:
    """Import ``preload`` once, in that order, then fork one child per request and reply with
    its exit status."""
    import importlib

    for name in preload:  # in the order the scripts' own processes import them (ForkedCommands)
        importlib.import_module(name)
    reply = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write into the reply channel
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        status = _wait(pid, request["timeout"])
        print(json.dumps({"status": status}), file=reply, flush=True)


# What a server imports before forking, by the scripts it runs, in their own processes' order:
# fairseq's scripts configure logging at the top of their module, before they import fairseq
# (whose wav2vec2 module would otherwise set the root logger to DEBUG first); ours import
# fairseq_alma, whose __init__ quiets fairseq's start-up before importing it.
FAIRSEQ_SCRIPTS = ("fairseq_cli.train",)
ALMA_SCRIPTS = ("fairseq_alma",)


class ForkedCommands:
    """One server process; ``run`` is ``subprocess.run(argv, capture_output=True, text=True)``
    for a console script of this environment.  One call at a time per instance.

    ``preload``: the modules the server imports (``FAIRSEQ_SCRIPTS`` for fairseq's own console
    scripts, ``ALMA_SCRIPTS`` for ours): a child runs its script in a process that imported
    what the script's own process would have imported first, in that order, so that what
    import-time code sets (logging, warning filters) is what the script would have."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = FAIRSEQ_SCRIPTS) -> None:
        self._env = env
        self._server = subprocess.Popen(
            [sys.executable, __file__, *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=env)
        ready = self._server.stdout.readline()
        if not ready:
            raise RuntimeError(f"{__file__}: the fork server did not start")
        self._scratch = Path(tempfile.mkdtemp(prefix="forked_commands_"))

    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 600, whole_env: bool = False) -> subprocess.CompletedProcess:
        """``env``: variables set on top of the server's environment, or with ``whole_env``
        the child's whole environment (what torch and fairseq read at import keeps the
        server's value)."""
        out, err = self._scratch / "stdout", self._scratch / "stderr"
        request = {"argv": argv, "cwd": str(cwd), "env": env or {}, "timeout": timeout,
                   "stdout": str(out), "stderr": str(err), "whole_env": whole_env}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        status = json.loads(self._server.stdout.readline())["status"]
        return subprocess.CompletedProcess(argv, status, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=60)


if __name__ == "__main__":
    serve(sys.argv[1:])
