"""fairseq-alma: Anytime Learning at Macroscale with Switch Transformers (a fairseq user dir).

Importing the package registers its fairseq components (tasks, models, criterions, LR
schedulers): fairseq's ``--user-dir`` imports it, and so do our console tools.  When fairseq
itself cannot be imported, nothing is registered and the parts that need no fairseq (the
stream core in ``stream/``, the errors) still import: the core is tested that way.
"""

from .fairseq_glue.patches import install_quiet_startup, undo_debug_root_logging

install_quiet_startup()  # before fairseq's own import, when we are first (our console tools)

try:
    with undo_debug_root_logging():
        import fairseq  # noqa: F401
except ModuleNotFoundError as err:  # only the fairseq-free parts are usable
    if err.name != "fairseq":
        raise
else:
    from . import criterions, models, optim, tasks  # noqa: F401  (registration side effects)
    from .fairseq_glue.patches import install_command_patches

    install_command_patches()
