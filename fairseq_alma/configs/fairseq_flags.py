"""Checking config flags against the real ``fairseq-train`` parser, plugin included.

fairseq builds its parser in two passes (``fairseq.options.parse_args_and_arch``): the first pass
reads ``--task``/``--arch``/``--criterion``/``--optimizer``/``--lr-scheduler``..., the second adds
the options those components declare. A flag is therefore only "real" for a given choice of
components, so every grid point of a config is parsed on its own, exactly the way fairseq-train
will parse it on the cluster. fairseq is imported lazily: it takes seconds and ``alma-sweep
status``/``cancel`` never need it.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
from pathlib import Path
from typing import Mapping, NamedTuple, NoReturn

from ..errors import UsageError
from .run_config import PLUGIN_DIR, RunConfig

_INVALID_CHOICE = re.compile(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)")


def _raise_instead_of_exit(message: str) -> NoReturn:
    """``parser.error`` replacement: argparse's message as an exception, not usage + exit 2.

    ``exit_on_error=False`` is not enough on Python 3.11: it covers bad values and invalid
    choices, but argparse still calls ``error()`` for missing required arguments; and fairseq
    builds the parser itself, so it cannot be a subclass.
    """
    raise argparse.ArgumentError(None, message)


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


class FlagProblem(NamedTuple):
    """Why fairseq-train would refuse a command line; ``flag`` is the config flag at fault when it
    is known (so the error can name the file that sets it)."""

    message: str
    flag: str | None = None


def parse_training_argv(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """Parse ``argv`` with fairseq-train's complete parser; return it and the unparsed tokens.

    Raises ``argparse.ArgumentError`` with argparse's message when fairseq-train would refuse a
    value.
    """
    from fairseq import options

    load_plugin()
    parser = options.get_training_parser()
    parser.error = _raise_instead_of_exit  # type: ignore[method-assign]
    _, extra = options.parse_args_and_arch(parser, argv, parse_known=True)
    return parser, extra


def _readable_parser_error(message: str) -> str:
    """Shorten argparse's "invalid choice" (which lists every registered model) to a hint."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    option, value, choices_text = match.groups()
    choices = re.findall(r"'([^']*)'", choices_text)
    close = difflib.get_close_matches(value, choices, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f" ({len(choices)} choices)"
    return f"{option}: invalid choice '{value}'{hint}"


def argv_flag_problem(argv: list[str], flags: Mapping[str, object]) -> FlagProblem | None:
    """Why fairseq-train would refuse ``argv``, or None when it accepts it and each config flag
    is one of its options. ``flags`` are the flag: value pairs the config contributed to ``argv``.
    """
    if "--arch" not in argv:
        return FlagProblem("fairseq-train needs an architecture: add 'arch: NAME' to args")
    try:
        parser, extra = parse_training_argv(argv)
    except argparse.ArgumentError as err:
        message = str(err)
        named = re.match(r"argument --([\w-]+)", message)
        flag = named.group(1) if named else None
        if flag is not None and flags.get(flag) is True and "expected" in message:
            return FlagProblem(f"'{flag}' takes a value: write {flag}: VALUE", flag)
        readable = _readable_parser_error(message)
        return FlagProblem(f"fairseq-train rejects a value: {readable}", flag)
    actions = parser._option_string_actions
    known = sorted(option[2:] for option in actions if option.startswith("--"))
    for flag, value in flags.items():
        action = actions.get(f"--{flag}")
        if action is None:
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; see fairseq-train --help"
            return FlagProblem(f"unknown fairseq-train flag '{flag}'{hint}", flag)
        is_switch = action.nargs == 0
        if is_switch and value is not None and not isinstance(value, bool):
            return FlagProblem(f"'{flag}' is a switch: write {flag}: true or false", flag)
        if not is_switch and value is True:
            return FlagProblem(f"'{flag}' takes a value: write {flag}: VALUE", flag)
    if extra:
        return FlagProblem(f"fairseq-train does not accept: {' '.join(extra)}")
    return None


def check_config_flags(config: RunConfig) -> None:
    """Parse every grid point of ``config`` with fairseq-train's parser (see module docstring);
    raise ``UsageError`` naming the file (and grid point) that sets the flag at fault."""
    for point in config.grid_points():
        argv = config.to_argv(point, config.seeds[0], "alma-sweep-flag-check")
        problem = argv_flag_problem(argv, {**config.args, **point})
        if problem is not None:
            raise UsageError(f"{_origin(config, problem.flag, point)}: {problem.message}")


def _origin(config: RunConfig, flag: str | None, point: dict) -> str:
    path: Path = config.flag_origin(flag) if flag else config.path
    if not point:
        return str(path)
    shown = ", ".join(f"{k}={v}" for k, v in point.items())
    return f"{path} (grid point {shown})"
