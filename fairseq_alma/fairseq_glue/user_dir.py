"""The plugin as fairseq sees it: the directory every fairseq command gets as ``--user-dir``,
and registering its components the way ``--user-dir`` does.

One place for the path, so ``alma-train``, the run configs' command lines and the flag check
cannot point fairseq at different copies of the package.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

# The fairseq_alma package directory: the --user-dir every run gets.
PLUGIN_DIR = Path(__file__).resolve().parents[1]


def load_plugin() -> None:
    """Register fairseq_alma's components the way ``fairseq-train --user-dir`` does.

    ``import_user_module`` skips the tasks/ and models/ auto-import when the package is already
    imported (it is: this module lives in it), so those folders are imported here too; importing
    a module twice is a no-op, so nothing registers twice.
    """
    from fairseq import utils
    from fairseq.models import import_models
    from fairseq.tasks import import_tasks

    utils_logger = logging.getLogger("fairseq.utils")
    level = utils_logger.level
    utils_logger.setLevel(logging.WARNING)  # not "--user-dir ... has already been imported"
    try:
        utils.import_user_module(argparse.Namespace(user_dir=str(PLUGIN_DIR)))
    finally:
        utils_logger.setLevel(level)
    if (PLUGIN_DIR / "tasks").is_dir():
        import_tasks(str(PLUGIN_DIR / "tasks"), f"{PLUGIN_DIR.name}.tasks")
    if (PLUGIN_DIR / "models").is_dir():
        import_models(str(PLUGIN_DIR / "models"), f"{PLUGIN_DIR.name}.models")
