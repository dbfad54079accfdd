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
import traceback
from functools import lru_cache
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


def _failed_option(err: BaseException) -> tuple[argparse.Action, str] | None:
    """The option (and its text) whose value made fairseq's parser raise ``err``: argparse turns a
    ValueError of a value's type function into its own error, but not the SyntaxError (or
    MemoryError...) of fairseq's ``eval_str_list`` (``ast.literal_eval``); argparse's frames
    still hold the action it was converting."""
    found = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        action = frame.f_locals.get("action")
        text = frame.f_locals.get("arg_string")
        if isinstance(action, argparse.Action) and isinstance(text, str):
            found = (action, text)
    return found


def _config_spelling(action: argparse.Action, flags: Mapping[str, object]) -> str | None:
    """The config flag that is one of ``action``'s spellings (its name or an alias)."""
    return next((flag for flag in flags if f"--{flag}" in action.option_strings), None)


def _crash_problem(err: Exception, flags: Mapping[str, object]) -> FlagProblem:
    """A value fairseq's parser crashes on (module ``_failed_option``), as a one-line problem."""
    failed = _failed_option(err)
    reason = f"{type(err).__name__}: {err.msg if isinstance(err, SyntaxError) else err}"
    if failed is None:
        return FlagProblem(f"fairseq-train rejects a value ({reason})")
    action, text = failed
    flag = _config_spelling(action, flags)
    return FlagProblem(f"fairseq-train rejects a value: {action.option_strings[0]} '{text}' "
                       f"is not a valid value ({reason})", flag)


def canonical_flag(action: argparse.Action) -> str:
    """An option's name without dashes as fairseq-train's help lists it first (``batch-size``
    for ``--max-sentences``, ``device-id`` for ``--local_rank``)."""
    return next(s for s in action.option_strings if s.startswith("--"))[2:]


@lru_cache(maxsize=None)
def option_spellings(flag: str) -> tuple[str, ...]:
    """Every option string of fairseq-train's ``--flag`` (``--batch-size`` ->
    (``--batch-size``, ``--max-sentences``)), from its base parser (options every task and
    model share); ``(--flag,)`` when it is not one of them."""
    from fairseq import options

    load_plugin()
    action = options.get_training_parser()._option_string_actions.get(f"--{flag}")
    return tuple(action.option_strings) if action is not None else (f"--{flag}",)


def _spelling_problem(parser: argparse.ArgumentParser, flags: Mapping[str, object],
                      refused: Mapping[str, str]) -> FlagProblem | None:
    """Aliases are one flag (argparse's destination): ``max-sentences`` is ``batch-size``,
    ``local_rank`` is ``device-id``. A flag set under two spellings (the last would win
    silently), or a refused flag under another spelling, is a problem."""
    actions = parser._option_string_actions
    set_by_dest: dict[str, str] = {}
    for flag, value in flags.items():
        action = actions.get(f"--{flag}")
        if action is None:
            continue
        canonical = canonical_flag(action)
        for spelling in action.option_strings:
            name = spelling.lstrip("-")
            if name in refused:
                alias = "" if name == flag else f" (fairseq-train's --{name})"
                return FlagProblem(f"'{flag}'{alias} cannot be set here: {refused[name]}", flag)
        if value is None or value is False:  # not on the command line
            continue
        other = set_by_dest.get(action.dest)
        if other is not None:
            return FlagProblem(f"'{other}' and '{flag}' are two spellings of fairseq-train's "
                               f"--{canonical} (the last would win); set it once, as "
                               f"'{canonical}'", flag)
        set_by_dest[action.dest] = flag
    return None


def argv_flag_problem(argv: list[str], flags: Mapping[str, object],
                      refused: Mapping[str, str] | None = None) -> FlagProblem | None:
    """Why fairseq-train would refuse ``argv``, or None when it accepts it and each config flag
    is one of its options. ``flags`` are the flag: value pairs the config contributed to ``argv``;
    ``refused`` maps a flag a config may not set to the reason, and covers its every spelling.
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
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as err:
        return _crash_problem(err, flags)
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
    spelling = _spelling_problem(parser, flags, refused or {})
    if spelling is not None:
        return spelling
    if extra:
        return FlagProblem(f"fairseq-train does not accept: {' '.join(extra)}")
    if str(flags.get("wait", "")).strip().lower() == AUTO:
        freqs = {part.strip() for part in str(flags.get("update-freq", "1")).split(",")}
        conflict = auto_wait_conflict({**flags, "update-freq": len(freqs) > 1})  # a per-stage list
        if conflict:
            return FlagProblem(conflict, "wait")
    return None
