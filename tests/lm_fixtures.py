"""Tiny real corpora and fairseq-preprocessed data for end-to-end tests.

The text is generated from a small grammar with a fixed seed: enough structure for a tiny model
to show a falling loss within a few dozen updates, and no download.
"""

from __future__ import annotations

import atexit
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # CI's two cores, two test workers

SUBJECTS = ["the model", "a learner", "the stream", "every expert", "the router", "our data", "a mega-batch"]
VERBS = ["reads", "routes", "waits for", "learns from", "forgets", "predicts", "grows with"]
OBJECTS = ["the tokens", "new chunks", "old shards", "the capacity", "each stage", "the loss", "its experts"]
ENDINGS = ["today .", "over time .", "at scale .", "again .", "slowly .", "in order ."]


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}" for _ in range(n)
    ]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tool(name: str) -> str:
    """Path of a console script installed in the same environment as the test interpreter."""
    return str(VENV_BIN / name)


_SERVERS: dict[str, Any] = {}
_SERVER_LOCK = threading.Lock()


def fork_server(script: str = "alma-score") -> Any:
    """This test process's fork server (``forked_commands``), started at its first use.

    Why one for every ``run``: the suite runs several hundred console-script calls, and a
    fresh interpreter spends about seven seconds of CPU importing torch and fairseq before each
    (on CI's two cores, with two test workers, that was a third of ``make test``).  A child
    forked from a process that already imported them is a real process all the same: its own
    pid, exit status, stdout, stderr, cwd and environment, and ``--user-dir`` still imports
    fairseq_alma in it.  fairseq's scripts (``fairseq-*``) and ours get a server each: each
    imports first what the script's own process would (``forked_commands.ForkedCommands``)."""
    from forked_commands import ALMA_SCRIPTS, FAIRSEQ_SCRIPTS, ForkedCommands

    kind = "fairseq" if script.startswith("fairseq-") else "alma"
    with _SERVER_LOCK:
        if kind not in _SERVERS:
            preload = FAIRSEQ_SCRIPTS if kind == "fairseq" else ALMA_SCRIPTS
            _SERVERS[kind] = ForkedCommands({**os.environ, **THREADS}, preload)
            atexit.register(_SERVERS[kind].close)
        return _SERVERS[kind]


def _console_script(cmd: list[str]) -> bool:
    """Whether ``cmd`` runs one of this environment's console scripts (entry points)."""
    from importlib.metadata import entry_points

    path = Path(cmd[0])
    return path.parent == VENV_BIN and bool(entry_points(group="console_scripts", name=path.name))


def run(cmd: list[str], cwd: Path | None = None, check: bool = True, timeout: int = 600,
        fresh: bool = False) -> subprocess.CompletedProcess:
    """``cmd`` to completion, output captured; a console script of this environment runs in a
    child of the fork server (``fork_server``) unless ``fresh`` asks for a new interpreter (for
    what happens at import: start-up messages, import-time environment); ALMA_TESTS_FRESH=1 in
    the environment makes every call fresh (to rule the fork server out of a failure)."""
    env = {**os.environ, **THREADS, "PYTHONUNBUFFERED": "1"}
    if not (fresh or os.environ.get("ALMA_TESTS_FRESH")) and _console_script(cmd):
        server = fork_server(Path(cmd[0]).name)
        with _SERVER_LOCK:  # one call at a time per server
            proc = server.run(cmd, cwd=Path(cwd or os.getcwd()), env=env, timeout=timeout,
                              whole_env=True)
    else:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def preprocess_lm(dest: Path, train_sentences: int = 1200, valid_sentences: int = 120) -> Path:
    """fairseq-preprocess a generated corpus into ``dest`` (train/valid/test, one dict)."""
    raw = dest / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_lines(raw / "train.txt", sentences(train_sentences, seed=1))
    write_lines(raw / "valid.txt", sentences(valid_sentences, seed=2))
    write_lines(raw / "test.txt", sentences(valid_sentences, seed=3))
    run([
        tool("fairseq-preprocess"), "--only-source",
        "--trainpref", str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"),
        "--testpref", str(raw / "test.txt"), "--destdir", str(dest / "bin"), "--workers", "1",
    ])
    return dest / "bin"


USER_DIR = str(Path(__file__).resolve().parent.parent / "fairseq_alma")


def prepare_stream(root: Path, out: Path, num_megabatches: int = 2, lines: int = 1200,
                   vocab_size: int = 400, seed: int = 1, extra: tuple[str, ...] = ()) -> Path:
    """``alma-data-prep`` of a generated corpus (documents of 4 sentences) into ``out``;
    ``extra``: more alma-data-prep flags (e.g. ``--eval-per-megabatch``)."""
    text = sentences(lines, seed=7)
    docs = ["\n".join(text[i : i + 4]) for i in range(0, len(text), 4)]
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    run([tool("alma-data-prep"), str(root / "corpus.txt"), "--out", str(out), "--vocab-size",
         str(vocab_size), "--num-megabatches", str(num_megabatches), "--eval-size", "0.1",
         "--valid-size", "0.05", "--workers", "1", "--seed", str(seed), *extra])
    return out


def stream_cmd(data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        tool("fairseq-train"), str(data), "--user-dir", USER_DIR, "--task", "alma_stream",
        "--arch", "switch_transformer_lm_tiny", "--moe-experts", "2", "--criterion", "switch_cross_entropy",
        "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "alma_stage_linear", "--warmup-updates", "2",
        "--updates-per-stage", "6", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu", "--num-workers", "0",
        "--save-dir", str(save_dir), "--log-format", "simple", "--log-interval", "2", "--seed", "1", "--dropout", "0",
        *extra,
    ]


RESUMABLE = ("--save-interval-updates", "2", "--fairseq-validation")  # saves (and validation) mid-stage


def stage_weights(save: Path, stage: int) -> dict:
    import torch

    return torch.load(save / f"checkpoint_stage{stage}.pt", map_location="cpu", weights_only=False)["model"]


def assert_same_stream(a: Path, b: Path, stages=(1, 2)) -> None:
    import torch

    from fairseq_alma.stream.records import read_records, records_equal

    assert records_equal(read_records(a / "stream.jsonl"), read_records(b / "stream.jsonl"))
    for stage in stages:
        wa, wb = stage_weights(a, stage), stage_weights(b, stage)
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), (stage, key)


def wait_for(path: Path, proc, timeout: float = 600.0) -> None:
    import time

    start = time.time()
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path.name} appeared"
        assert time.time() - start < timeout, f"{path} did not appear"
        time.sleep(0.05)
