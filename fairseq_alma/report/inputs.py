"""What ``alma-report`` reads: run directories, sweep directories and ``alma-score --json`` files.

* A run directory (``stream.jsonl``, and ``run.json`` with the run's fingerprint) gives one
  series from its logged metric: perplexity on the evaluation mega-batch at every arrival (LM) or
  test error (vision); its setting name and size come from the fingerprint and the records.
* A sweep directory (``alma-sweep``/``alma-vision-sweep`` --sweep-dir: run directories inside)
  stands for its runs.
* An ``alma-score --json`` file gives its series as scored, Ens and gEns included; the run
  directories it names lend it their fingerprints, so seeds of an ensemble group too.  A series
  scored with ``--max-eval-tokens`` on part of the split keeps that slice: perplexities on
  different tokens are not comparable, so ``common_eval_slice`` refuses to mix slices.  A series
  scored with ``--matrix`` brings its stage x period matrix (``report/matrix_table.py``).

Nothing here imports fairseq or torch: reports are drawn on machines without them.  Every bad
input is a one-line ``UsageError`` naming the path and what to pass instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import DataError, UsageError
from ..stream.progress import AUTO, wait_from_flag
from ..stream.records import ArrivalRecord
from ..stream.run_dir import STREAM_LOG
from ..stream.run_view import RunView, fingerprint_megabatches
from ..stream.series import series_from_records
from .result_tables import REPORT_WRITER, series_from_entry
from .seeds import SEED_KEYS, ReportedRun, canonical, find_key


def _started_run(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a run: its records, or the ``run.json`` a run writes when it
    takes its directory, before it records arrival 0."""
    view = RunView(path)
    return view.stream_log.is_file() or view.run_file.is_file()


def expand_run_dirs(paths: list[str]) -> list[str]:
    """A directory that holds no run itself but whose sub-directories do (an ``alma-sweep``
    --sweep-dir) stands for those run dirs, in name order.

    Why a sub-directory with ``run.json`` and no ``stream.jsonl`` is one of them: it is a run
    that started (killed or preempted before it recorded arrival 0); left out, its setting's
    row averaged the other seeds and read as the whole setting, exit 0.  ``read_inputs``
    refuses it in one line, as any unfinished run."""
    out = []
    for path in paths:
        runs = []
        if os.path.isdir(path) and not _started_run(path):
            runs = sorted(entry.path for entry in os.scandir(path)
                          if entry.is_dir() and _started_run(entry.path))
        out += runs or [path]
    return out


def setting_name(flags: Mapping[str, Any], prefix: str | None = None, lr_schedule: Any = None,
                 model: Mapping[str, Any] | None = None) -> str:
    """Table 2's names from a run's stream flags: 'SM_w1', 'Ens_w4 (4x steps)', 'gMoE_w1',
    'UMix_w1' (``--arch umix_switch_transformer_lm*``, given its ``model`` config),
    'SM_wauto' (``--wait auto``),
    ' replay' when replaying, ' replay r=0.25' with partial replay, ' lr decay' with a
    ``--stage-lr-schedule`` other than ALMA's restart, ' (scratch init)' for a single series of
    a ``--stage-init scratch`` run (its gEns series says so already); vision runs name their
    method.

    Why the model: a UMix LM is one model of N members (paper §4.1), trained with the stream
    flags of any SM run; named from the flags alone it was tabulated as 'SM_w1'."""
    wait, replay = wait_from_flag(flags.get("wait", 1)), flags.get("replay")
    ratio = flags.get("replay_ratio") or 0
    steps = flags.get("scale_updates_by_wait")
    grows = bool(flags.get("grow_experts"))
    umix = bool(model and model.get("umix_members"))
    prefix = prefix or flags.get("method") or ("UMix" if umix else "gMoE" if grows else "SM")
    name = f"{prefix}_w{wait}" + (f" ({wait}x steps)" if steps and wait != AUTO and wait > 1 else "")
    name += " (experts grown)" if umix and grows and prefix == "UMix" else ""
    name += " replay" if replay else (f" replay r={ratio:g}" if ratio else "")
    schedule = str(getattr(lr_schedule, "value", lr_schedule)) if lr_schedule else "restart"
    name += f" lr {schedule}" if schedule != "restart" else ""
    init = flags.get("stage_init")
    if str(getattr(init, "value", init)) == "scratch" and prefix != "gEns":  # gEns says it
        name += " (scratch init)"
    return name


def vision_size_label(record: ArrivalRecord) -> str:
    """A vision run's size as its records say: architecture and width, e.g. 'mlp32'."""
    return f"{record.extra.get('arch', '')}{record.extra.get('width', '')}" or "?"


def lm_experts_label(model: Mapping[str, Any], experts: int | None) -> str:
    """Experts per MoE block at the end of the stream ('dense' for fairseq's transformer_lm);
    UMix: 'E@N' (N members of E experts, as Ens).  One rule for alma-report and alma-score."""
    if not experts:
        return "dense"
    members = model.get("umix_members")
    return f"{experts}@{members}" if members and members > 1 else str(experts)


def _lm_experts_label(config: Mapping[str, Any], growth: list[dict[str, Any]]) -> str:
    model = config.get("model") or {}
    return lm_experts_label(model, growth[-1]["experts"] if growth else model.get("moe_experts"))


def _seed(fingerprint: Mapping[str, Any] | None) -> tuple[int, ...] | None:
    value = find_key(fingerprint, SEED_KEYS) if fingerprint is not None else None
    return None if value is None else (int(value),)


def read_run_dir(path: Path) -> ReportedRun:
    """One run directory as a series of its logged metric (module doc); a run that has not
    recorded every arrival of its stream is refused (``RunView.require_finished``)."""
    view = RunView.open(path, "input")
    records, fingerprint = view.records, view.fingerprint
    if len(records) < 2:
        raise UsageError(f"{view.stream_log}: needs arrivals 0..B in order; finish the run "
                         f"(the same training command continues it)")
    view.require_finished()
    view.require_trusted_records()
    schedule = None  # --stage-lr-schedule (LM; absent from fingerprints when ALMA's restart)
    model = None  # LM: the model's config (a UMix model names its series)
    if records[0].eval_ppl is None:  # vision: its records carry the flags
        flags, size = records[-1].extra, vision_size_label(records[-1])
    elif fingerprint is None:
        raise UsageError(f"{view.run_file}: missing (a run of fairseq-alma < 0.2); score it "
                         f"with alma-score --json and pass that file instead")
    else:
        config = fingerprint.get("config") or {}
        flags, size = config.get("task") or {}, _lm_experts_label(config, view.growth)
        schedule = (config.get("lr_scheduler") or {}).get("stage_lr_schedule")
        model = config.get("model") or {}
    name = setting_name(flags, lr_schedule=schedule, model=model)
    try:
        series = series_from_records(name, size, records)
    except ValueError as err:
        raise UsageError(f"{view.stream_log}: {err}") from None
    return ReportedRun(series, str(path), fingerprint, _seed(fingerprint),
                       scoring=logged_scoring(fingerprint, series.metric),
                       runs=(os.path.realpath(path),))


def logged_scoring(fingerprint: Mapping[str, Any] | None, metric: str) -> dict[str, Any]:
    """How a run's own records were measured: vision on the test set of its data set; an LM on
    its ``--eval-subset`` in blocks of its ``--tokens-per-sample``, every token, with the model
    in its training precision, on its training data (the same keys ``evaluated_scoring`` gives
    an alma-score evaluation, so the two group when they measured alike).

    Why a vision run's ``data`` is its data set's sha256 (its fingerprint's), as a mapping:
    ``result_tables.same_shape`` refuses rows whose data identities differ, and a vision row
    had none, so runs on another data set (another test set) shared one CER table."""
    if metric == "error":
        digest = (fingerprint or {}).get("data")
        return {"split": "test", "data": {"vision_data_sha256": digest} if digest else None}
    config = (fingerprint or {}).get("config") or {}
    task, common = config.get("task") or {}, config.get("common") or {}
    precision = "bf16" if common.get("bf16") or common.get("memory_efficient_bf16") else \
        "fp16" if common.get("fp16") or common.get("memory_efficient_fp16") else "fp32"
    return {"split": task.get("eval_subset") or "eval", "tokens_per_sample": task.get("tokens_per_sample"),
            "tokens": "all", "precision": precision, "data": (fingerprint or {}).get("data")}


def evaluated_scoring(scoring: Mapping[str, Any], members: list[dict | None],
                      source: str = "", metric: str = "ppl") -> dict[str, Any]:
    """How ``alma-score`` obtained a series' numbers (its JSON's ``scoring``), as
    ``logged_scoring``'s keys: a ``--from-log`` series is its run's own records, measured as
    its ``metric`` is (a vision run's on the test set, not an LM's evaluation blocks)."""
    if str(scoring.get("source", "")).endswith(STREAM_LOG):
        return logged_scoring(members[0] if members else None, metric)
    settings = scoring.get("settings") or {}
    part = _eval_slice(scoring)
    data = scoring["data_identity"] if "data_identity" in scoring else \
        _data_identity(settings.get("data"), source)
    return {"split": settings.get("subset"), "tokens_per_sample": settings.get("tokens_per_sample"),
            "tokens": "all" if part is None else list(part), "precision": scoring.get("precision", "fp32"),
            "data": data}


def _data_identity(data: Any, source: str) -> Any:
    """The identity of the stream a series was scored on (its manifest's, as a run's
    fingerprint holds it), read from the stream for a JSON that does not keep it (alma-score
    before 2026-11-29).  Why refuse when it cannot be read: its path in its place made every
    row's name a list of ~50 ``data.splits...=None`` keys, kept seeds apart and let series
    scored on different streams into one table."""
    if not data:
        return None
    from fairseq_alma.stream.manifest import data_identity, load_manifest

    try:
        return data_identity(load_manifest(str(data).split(os.pathsep)[0]))
    except (DataError, OSError) as err:
        raise UsageError(f"{source}: the stream it was scored on cannot be read ({err}); put it "
                         f"back, or score the runs again (alma-score --json now keeps what the "
                         f"stream was)") from None


def read_score_json(path: Path) -> list[ReportedRun]:
    """The series of an ``alma-score --json`` file, each with the fingerprints of the run
    directories it was scored from, where they still exist.

    A table an ``alma-report`` (or ``alma-demo``) wrote is refused: its rows are means over
    seeds that carry neither the runs nor how they were scored, so read again beside the files
    it came from (``alma-report report/*.json``) each series appeared twice under labels made
    of every data setting, and its seed groups would be averaged a second time."""
    try:
        data = json.loads(path.read_text("utf-8"))
        metric, entries = data["metric"], data["series"]
        if data.get("written_by") == REPORT_WRITER or any("summary_std" in entry for entry in entries):
            sources = sorted({run for entry in entries for run in entry.get("runs") or []})
            named = f" ({', '.join(sources[:3])}{', ...' if len(sources) > 3 else ''})" if sources else ""
            raise UsageError(f"{path}: a table alma-report (or alma-demo) wrote, not an alma-score --json file; pass "
                             f"the run directories or alma-score --json files it was made from{named}")
        if isinstance(entries, list) and not entries:
            raise UsageError(f"{path}: no series in it; score the runs again with alma-score --json")
        for entry in entries:
            if isinstance(entry, dict) and not isinstance(entry.get("scoring"), dict):
                raise UsageError(f"{path}: series {str(entry.get('setting', '?'))!r} has no \"scoring\" "
                                 f"(how and on what data it was scored); score the runs again with "
                                 f"alma-score --json")
        series = [series_from_entry(entry, metric) for entry in entries]
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: cannot read ({err})") from None
    except UsageError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: not an alma-score --json file ({type(err).__name__}: {err}); "
                         f"pass run directories or alma-score's --json output") from None
    out = []
    for entry, s in zip(entries, series, strict=True):
        scoring = entry["scoring"]  # checked above: without it nothing says what was measured
        members = [Path(run) for run in scoring.get("runs", [])]
        # the fingerprints of the runs as they were scored; a JSON from before they were kept
        # (alma-score before 2026-11-29) lends the run directories' as they are now
        fingerprints = list(scoring["fingerprints"]) if "fingerprints" in scoring else []
        for member in members[len(fingerprints):]:
            try:
                fingerprints.append(RunView(member).fingerprint)
            except UsageError:
                fingerprints.append(None)
        _check_stream_length(path, s, members, fingerprints)
        known = bool(members) and None not in fingerprints
        mode = str(scoring.get("mode") or "single")
        fingerprint = None  # a single model's is its run's, as a run directory gives it
        if known:
            fingerprint = fingerprints[0] if mode == "single" and len(fingerprints) == 1 else \
                {"mode": mode, "members": fingerprints}
        seeds = [_seed(fp) for fp in fingerprints] if known else []
        seed = tuple(s[0] for s in seeds) if seeds and None not in seeds else None
        out.append(ReportedRun(s, f"{path}:{s.setting}", fingerprint, seed, _eval_slice(scoring),
                               entry.get("eval_matrix"),
                               scoring=evaluated_scoring(scoring, fingerprints, str(path), metric),
                               runs=tuple(os.path.realpath(m) for m in members), mode=mode))
    return out


def _check_stream_length(path: Path, series: Any, members: list[Path],
                         fingerprints: list[dict | None]) -> None:
    """A series must cover its runs' whole stream (arrivals 0..B of the B their ``run.json``
    gives).  Why: ``alma-score --from-log`` before 2026-11-29 scored an unfinished vision run as
    a stream of the arrivals it had (B = 4 of 8): its JSON's CER 3.577 was published for a run
    whose finished stream gives 5.298, beside real B = 4 runs, exit 0."""
    for member, fingerprint in zip(members, fingerprints):
        b = fingerprint_megabatches(fingerprint)
        if b is not None and b != series.num_megabatches:
            raise UsageError(f"{path}: series {series.setting!r} covers arrivals 0..{series.num_megabatches} "
                             f"but {member} trains on B = {b} mega-batches (an unfinished run scored by "
                             f"an earlier alma-score?); finish the run and score it again with "
                             f"alma-score --json")


def _eval_slice(scoring: Mapping[str, Any]) -> tuple[int, int] | None:
    """(scored, available) tokens of a series scored on part of its split; None for all of it
    (and for files written before --max-eval-tokens existed, which scored every token)."""
    scored, total = scoring.get("eval_tokens"), scoring.get("eval_tokens_total")
    return None if scored is None or scored == total else (int(scored), int(total))


def common_eval_slice(runs: list[ReportedRun]) -> str | None:
    """The line that labels a table whose series were all scored on one slice (None: on every
    token); a ``UsageError`` naming two series when they were scored on different slices."""
    def name(part: tuple[int, int] | None) -> str:
        return "every token" if part is None else f"the first {part[0]:,} of {part[1]:,} tokens"

    first = runs[0]
    for run in runs[1:]:
        if run.eval_slice != first.eval_slice:
            raise UsageError(f"{first.source} was scored on {name(first.eval_slice)} of its "
                             f"evaluation split, {run.source} on {name(run.eval_slice)}; score "
                             f"them with the same alma-score --max-eval-tokens to compare them")
    if first.eval_slice is None:
        return None
    return (f"perplexity on {name(first.eval_slice)} of the evaluation split "
            f"(alma-score --max-eval-tokens)")


def common_split(runs: list[ReportedRun]) -> str | None:
    """The line that labels a table whose perplexities were all measured on one split other
    than the evaluation mega-batch (None otherwise: rows measured on different splits say so
    in their names, ``seeds.label_collisions``), so a table scored on training text never
    reads as Table 2."""
    from ..stream.manifest import split_note

    splits = {(run.scoring or {}).get("split") for run in runs}
    if len(splits) != 1 or None in splits or "test" in splits:
        return None
    return split_note(str(splits.pop()))


def read_inputs(paths: list[str]) -> list[ReportedRun]:
    """Every run or scored series the command line names (module doc), in order."""
    expanded = expand_run_dirs(paths)
    seen: dict[str, str] = {}
    for path in expanded:
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{path} is given twice (also as {seen[real]}); pass each run once")
        seen[real] = path
    runs: list[ReportedRun] = []
    for path in expanded:
        target = Path(path)
        if target.is_file() and target.suffix == ".json":
            runs += read_score_json(target)
        elif RunView(target).stream_log.is_file():
            runs.append(read_run_dir(target))
        elif target.is_dir() and _started_run(target):
            raise UsageError(f"{RunView(target).stream_log}: training not finished: no arrival "
                             f"recorded yet (run.json is there: the run started); run the same "
                             f"training command again to finish it, or leave {path} out")
        elif target.exists():
            raise UsageError(f"{path}: neither a run directory (stream.jsonl), a sweep directory "
                             f"of them, nor an alma-score --json file")
        else:
            raise UsageError(f"{path}: no such file or directory")
    if not runs:
        raise UsageError("no run to report; pass run directories, sweep directories or "
                         "alma-score --json files")
    refuse_the_same_series_twice(runs)
    return runs


def refuse_the_same_series_twice(runs: list[ReportedRun]) -> None:
    """One line when one model's series comes twice: a run directory and an ``alma-score
    --json`` that scored it alone (or two such files); an ensemble's members may also appear
    alone, which is another series."""
    seen: dict[tuple[str, tuple[str, ...], str], str] = {}
    for run in runs:
        if not run.runs:
            continue
        # an Ens is its set of members (the order they were given in changes nothing); a
        # directory trained again since a JSON scored it holds another run (its fingerprint)
        members, fingerprint = run.runs, run.fingerprint
        if run.mode == "ens":
            members = tuple(sorted(members))
            if fingerprint is not None:
                fingerprint = sorted(map(canonical, fingerprint["members"]))
        key = (run.mode, members, canonical(fingerprint))
        if key in seen:
            raise UsageError(f"{', '.join(run.runs)} is given twice: in {seen[key]} and in "
                             f"{run.source}; pass it once")
        seen[key] = run.source
