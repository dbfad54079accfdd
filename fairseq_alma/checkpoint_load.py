"""Loading a checkpoint without running its pickle: ``weights_only`` with an explicit allowlist.

Why: a checkpoint is a pickle, and unpickling can run any code the file names.  Checkpoints
travel: a collaborator's run directory, the checkpoints published with a paper.  Scoring or
resuming from one must not execute what it holds.  Every checkpoint fairseq-alma reads for
scoring or resuming (stage checkpoints, ``checkpoint_last.pt`` of an LM or a vision stream, and
those fairseq itself loads for ``alma-score``/``fairseq-eval-lm``, whose ``torch.load`` default
is ``weights_only`` since torch 2.6) is loaded with ``weights_only=True``: tensors, numbers,
strings, lists, tuples, dicts and ``OrderedDict``, plus ``SAFE_GLOBALS`` below.  That is all
fairseq's and our checkpoints hold (``tests/test_checkpoint_load.py`` loads every kind).  A file
that needs anything else is refused in one line naming the type; ``--trust-checkpoint`` (a
decision about where the file came from) loads it fully, fairseq's own loads included.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
from typing import Any

import torch

from .errors import CheckpointError, first_line
from .stream.run_view import checked_checkpoint, recovery_hint

# Types beyond torch's weights_only defaults that fairseq or fairseq-alma put in checkpoints.
# fairseq 0.12 stores its config as plain containers and its meters as state dicts, except the
# config of a pre-dataclass component (``--optimizer sgd``, adagrad, adafactor, ...), which it
# keeps as the ``argparse.Namespace`` of the command line: plain attributes, whose values the
# allowlist checks in turn, and no code of its own.  Registered for the whole process, so
# fairseq's own ``torch.load`` calls (resuming, fairseq-eval-lm) accept it too.
SAFE_GLOBALS: list[Any] = [argparse.Namespace]
torch.serialization.add_safe_globals(SAFE_GLOBALS)
TRUST_FLAG = "--trust-checkpoint"
_TRUST_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch's own switch for loads that pass no flag


def trust_checkpoints(trust: bool) -> None:
    """With ``trust``, every later load in this process unpickles fully: ours (``load``) and
    fairseq's own ``torch.load`` calls, which pass no ``weights_only`` (torch reads this
    environment variable at each call)."""
    if trust:
        os.environ[_TRUST_ENV] = "1"
    else:
        os.environ.pop(_TRUST_ENV, None)


def trusted() -> bool:
    return os.environ.get(_TRUST_ENV, "") not in ("", "0")


def load_checkpoint(path: str | os.PathLike, mmap: bool = False) -> Any:
    """The checkpoint at ``path``, its CRCs checked first (``run_view.checked_checkpoint``);
    one-line ``CheckpointError`` naming the file for a damaged or unreadable file, or for one
    that needs a type a checkpoint of ours never holds (module doc)."""
    path = checked_checkpoint(path)
    try:
        # SAFE_GLOBALS are registered for the process (above); torch's safe_globals context
        # manager would drop them again on exit, for fairseq's own loads that come later
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=not trusted())
    except pickle.UnpicklingError as err:
        if "weights_only" not in str(err) and "Unsupported global" not in str(err):
            raise unreadable(path, err) from None
        raise CheckpointError(f"{path}: holds {unsafe_type(err)}, which fairseq-alma's checkpoints "
                              f"never hold; loading it would run code from the file: load it only "
                              f"if you trust where it came from ({TRUST_FLAG})") from None
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        raise unreadable(path, err) from None


def unsafe_type(err: BaseException) -> str:
    """The type torch refused to unpickle, as its message names it."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err)) or re.search(r"global[s]? [`'\"]?([\w.]+)", str(err))
    return f"a {found.group(1)}" if found else "a type outside the allowlist"


def unreadable(path: str | os.PathLike, err: BaseException) -> CheckpointError:
    """The one line for a checkpoint torch cannot read: the file, torch's reason, the way back
    (also fairseq's own loader's, ``fairseq_glue/patches.install_checkpoint_errors``)."""
    reason = first_line(err)
    return CheckpointError(f"{path}: not a readable checkpoint ({reason}); {recovery_hint(path)}")
