"""fairseq-alma: Anytime Learning at Macroscale with Switch Transformers (a fairseq user dir).

Importing the package registers its fairseq components (tasks, models, criterions, LR
schedulers): fairseq's ``--user-dir`` imports it, and so do our console tools.  When fairseq
itself cannot be imported, nothing is registered and the parts that need no fairseq (the
stream core in ``stream/``, the errors) still import: the core is tested that way.

``alma-report`` and ``alma-sweep`` start without fairseq (``FAIRSEQ_FREE_TOOLS``): they read
records, run directories and Slurm's state, and importing torch and fairseq took 3-4 s of
every ``alma-sweep status`` and ``--help``.  ``alma-sweep submit`` and ``score`` call
``register`` before they check flags (``cli/sweep.py``), ``alma-data-prep`` and ``alma-score``
once their flags parsed (``data_prep/cli.py``: it binarizes with fairseq's data modules;
``cli/score.py``: it loads fairseq checkpoints).
"""

import os
import sys

from .fairseq_glue.patches import install_quiet_startup, undo_debug_root_logging

install_quiet_startup()  # before fairseq's own import, when we are first (our console tools)

# console tools whose work needs no fairseq until a command asks for it (module doc)
FAIRSEQ_FREE_TOOLS = ("alma-report", "alma-sweep", "alma-data-prep", "alma-score")
_registered = False


def _interrupted_while_importing() -> None:
    """Ctrl-C in the seconds our console tools spend importing torch and fairseq: the same one
    line and status as Ctrl-C later (``console.run_console``), not a traceback through the
    import machinery.  Anything else that imports the package keeps the KeyboardInterrupt."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program.startswith("alma-"):
        print(f"{program}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None  # console.INTERRUPTED_EXIT_STATUS, before it can import


def register() -> None:
    """Import fairseq, register the plugin's components with it and install the patches its
    commands need; once per process (a no-op after the first call, and without fairseq)."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        with undo_debug_root_logging():
            import fairseq  # noqa: F401
    except ModuleNotFoundError as err:  # only the fairseq-free parts are usable
        if err.name != "fairseq":
            raise
        return
    except KeyboardInterrupt:
        _interrupted_while_importing()
        raise
    try:
        from . import criterions, models, optim, tasks  # noqa: F401  (registration side effects)
        from .fairseq_glue.patches import install_command_patches
    except KeyboardInterrupt:
        _interrupted_while_importing()
        raise
    install_command_patches()


if (os.path.basename(sys.argv[0]) if sys.argv else "") not in FAIRSEQ_FREE_TOOLS:
    register()
