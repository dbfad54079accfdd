"""Checking a command line against the real ``fairseq-train`` parser, plugin included.

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
import re
from typing import Mapping, NamedTuple, NoReturn

from ..fairseq_glue.patches import precision_conflict
from ..fairseq_glue.user_dir import load_plugin
from ..stream.progress import AUTO, auto_wait_conflict

_INVALID_CHOICE = re.compile(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)")


def _raise_instead_of_exit(message: str) -> NoReturn:
    """``parser.error`` replacement: argparse's message as an exception, not usage + exit 2.

    ``exit_on_error=False`` is not enough on Python 3.11: it covers bad values and invalid
    choices, but argparse still calls ``error()`` for missing required arguments; and fairseq
    builds the parser itself, so it cannot be a subclass.
    """
    raise argparse.ArgumentError(None, message)


class FlagProblem(NamedTuple):
    """Why fairseq-train would refuse a command line; ``flag`` is the config flag at fault when it
    is known (so the error can name the file that sets it)."""

    message: str
    flag: str | None = None


def parse_training_argv(
    argv: list[str],
) -> tuple[argparse.ArgumentParser, argparse.Namespace, list[str]]:
    """Parse ``argv`` with fairseq-train's complete parser; return it, fairseq-train's namespace
    and the unparsed tokens.

    Raises ``argparse.ArgumentError`` with argparse's message when fairseq-train would refuse a
    value.
    """
    from fairseq import options

    load_plugin()
    parser = options.get_training_parser()
    parser.error = _raise_instead_of_exit  # type: ignore[method-assign]
    args, extra = options.parse_args_and_arch(parser, argv, parse_known=True)
    return parser, args, extra


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
    conflict = precision_conflict(argv)  # fairseq's parser would raise a ValueError on it
    if conflict is not None:
        return FlagProblem(conflict, conflict.split()[0][2:])
    try:
        parser, _, extra = parse_training_argv(argv)
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
    if str(flags.get("wait", "")).strip().lower() == AUTO:
        freqs = {part.strip() for part in str(flags.get("update-freq", "1")).split(",")}
        conflict = auto_wait_conflict({**flags, "update-freq": len(freqs) > 1})  # a per-stage list
        if conflict:
            return FlagProblem(conflict, "wait")
    return None
