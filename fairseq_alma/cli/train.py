"""``alma-train``: ``fairseq-train`` with the fairseq-alma plugin loaded, and a full ``--help``.

Why: ``fairseq-train --help`` prints before fairseq adds the options of the chosen task, model,
criterion, optimizer and LR scheduler, so none of the plugin's flags (``--wait``,
``--moe-experts``, ``--grow-experts`` ...) are listed.  ``alma-train ... --help`` first lets
fairseq build its complete parser for the components on the command line, then prints it.
Training itself is exactly ``fairseq-train`` (its own ``cli_main``) with ``--user-dir`` set;
``fairseq-train --user-dir fairseq_alma ...`` keeps working.

    alma-train --task alma_stream --arch switch_transformer_lm_base --criterion switch_cross_entropy \\
        --lr-scheduler alma_stage_linear --help
    alma-train DATA --task alma_stream --arch switch_transformer_lm_base ...   # trains
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from ..fairseq_glue.patches import HELP_FLAGS, arch_missing
from ..fairseq_glue.user_dir import PLUGIN_DIR

DEFAULTS = {"--task": "alma_stream"}  # the plugin's task unless another one is named
HELP_ARCH = "switch_transformer_lm"  # whose options --help lists when no --arch is named


def with_plugin(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--user-dir`` pointing at this package and ``--task alma_stream`` unless
    given."""
    argv = list(argv)
    for flag, value in {"--user-dir": str(PLUGIN_DIR), **DEFAULTS}.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            argv += [flag, value]
    return argv


def full_help(argv: Sequence[str]) -> str:
    """fairseq-train's help with every option of the components named in ``argv``."""
    from fairseq import options

    logging.getLogger().setLevel(logging.WARNING)  # the help alone, not fairseq's INFO lines
    rest = [a for a in argv if a not in HELP_FLAGS]
    shown_arch = arch_missing(rest)  # fairseq cannot build a parser without a model
    if shown_arch:
        rest += ["--arch", HELP_ARCH]
    sys.argv = ["alma-train", *rest]  # fairseq reads --user-dir from sys.argv
    parser = options.get_training_parser()
    parser.prog = "alma-train"
    if shown_arch:
        parser.epilog = (f"No --arch was given: the model options above are those of --arch "
                         f"{HELP_ARCH}; add --arch NAME to see another model's.")
    if not rest or rest[0].startswith("-"):  # no DATA given (it comes first): a stand-in
        rest = ["DATA", *rest]
    options.parse_args_and_arch(parser, input_args=rest, parse_known=True)
    return parser.format_help()


def main(argv: Sequence[str] | None = None) -> int:
    argv = with_plugin(sys.argv[1:] if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv):
        print(full_help(argv), end="")
        return 0
    sys.argv = ["alma-train", *argv]
    from fairseq_cli.train import cli_main

    from ..fairseq_glue.patches import install_command_patches

    # the package was imported (and its patches installed) before fairseq_cli.train was: wrap
    # its main and flag parsing now, so alma-train refuses what fairseq-train refuses
    install_command_patches()
    cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
