"""Reading config YAML files: a strict PyYAML loader for values, OmegaConf for ``include:`` merging.

Run configs are small YAML files (issue 5: one per paper experiment) that may ``include:`` base
configs; resource profiles are single files. Parsing and merging are split on purpose:

* Values are read by PyYAML's SafeLoader, not by ``OmegaConf.load``. OmegaConf's loader reads
  ``1e-3``, ``5e-4``, ``1e3`` and ``1.0e8`` as floats where SafeLoader keeps the text as written,
  so the same config would give fairseq-train ``--lr 0.001`` instead of ``--lr 1e-3`` and rename
  the run directories of grid values (``lr0.001.seed1``): an existing sweep could no longer be
  resumed. (``.5``, ``0x10``, ``1_000`` and ``1.0e-8`` read the same in both.)
* Duplicate keys are refused with both line numbers: PyYAML silently keeps the last one, which
  would hide a mistyped experiment (two ``lr:`` lines); OmegaConf's loader refuses them too, but
  in a multi-line message that does not say where the first one is.
* Dates stay text, as in OmegaConf's loader (OmegaConf cannot hold a ``date``).
* Merging is ``OmegaConf.merge``: nested mappings merge key by key; scalars, lists and ``null``
  replace (``null`` is how a config removes an included flag); keys keep the base's order with new
  keys last, which is the order of fairseq-train's flags. OmegaConf's ``???`` ("missing") never
  replaces a value.
* Values are read back with ``resolve=False``: a string such as ``${HOME}/data`` reaches
  fairseq-train as written, it is never interpolated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigTypeError, GrammarParseError, OmegaConfBaseException

from ..errors import UsageError

_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a mapping with the same key twice and reads dates as text."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            repeated = key in seen
        except TypeError:  # a list as a key: construct_mapping reports it with its line
            continue
        if repeated:
            raise UsageError(
                f"{loader.name}:{line}: key '{key}' appears twice (first on line {seen[key]}); "
                "keep one of them"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _parse(text: str, name: str) -> Any:
    loader = _StrictLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_yaml_scalar(text: str) -> Any:
    """A value typed on the command line (``--grid lr=1e-3``), read exactly as the same text in a
    config file would be; text that is not valid YAML stays text."""
    try:
        return _parse(text, "<command line>")
    except (yaml.YAMLError, UsageError):
        return text


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse ``path`` as a YAML mapping; ``what`` names the kind of file in error messages."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{what} {path} not found; check the path") from None
    except OSError as err:
        raise UsageError(f"cannot read {what} {path}: {err.strerror}") from None
    try:
        data = _parse(text, str(path))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise UsageError(f"{where}: invalid YAML ({err.problem}); fix the syntax") from None
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: invalid YAML ({err}); fix the syntax") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} must be a YAML mapping (key: value lines)")
    for key in data:
        if not isinstance(key, str):
            raise UsageError(f"{path}: top-level key {key!r} must be a string")
    return data


def _to_omegaconf(data: dict[str, Any], path: Path) -> DictConfig:
    try:
        return OmegaConf.create(data)
    except GrammarParseError as err:  # OmegaConf parses '${' even though nothing is resolved
        problem = str(err).splitlines()[0]
        raise UsageError(
            f"{path}: '{err.full_key}': a malformed '${{...}}' ({problem}); close the braces or "
            "drop the '$'"
        ) from None
    except OmegaConfBaseException as err:
        problem = str(err).splitlines()[0]
        raise UsageError(
            f"{path}: '{err.full_key}': {problem}; write text, numbers, true/false, lists or "
            "mappings"
        ) from None


def _kind_conflict(base: Any, child: Any, prefix: str = "") -> tuple[str, str, str] | None:
    """The first key that is a mapping on one side and a list on the other (OmegaConf cannot
    merge those, and its error does not name the key): ``(key, base kind, child kind)``."""
    kinds = {dict: "mapping", list: "list"}
    base_kind, child_kind = kinds.get(type(base)), kinds.get(type(child))
    if base_kind and child_kind and base_kind != child_kind:
        return prefix, base_kind, child_kind
    if isinstance(base, dict) and isinstance(child, dict):
        for key, value in child.items():
            if key in base:
                found = _kind_conflict(base[key], value, f"{prefix}.{key}" if prefix else str(key))
                if found:
                    return found
    return None


def _merge(base: DictConfig, child: DictConfig, child_path: Path) -> DictConfig:
    try:
        return OmegaConf.merge(base, child)  # type: ignore[return-value]
    except ConfigTypeError:
        plain = [OmegaConf.to_container(c, resolve=False) for c in (base, child)]
        found = _kind_conflict(*plain)
        if found is None:
            raise
        key, base_kind, child_kind = found
        raise UsageError(
            f"{child_path}: '{key}' is a {child_kind} here but a {base_kind} in an included "
            f"config; write a {base_kind}"
        ) from None


def _load_tree(
    path: Path, allowed: set[str], what: str, chain: tuple[Path, ...]
) -> tuple[DictConfig, tuple[Path, ...]]:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise UsageError(f"include cycle: {cycle}; remove one of the include: lines")
    data = read_yaml_mapping(path, what)
    for key in data:
        if key not in allowed:
            raise UsageError(
                f"{path}: unknown top-level key '{key}' (allowed: {', '.join(sorted(allowed))})"
            )
    includes = data.pop("include", None)
    if includes is None:
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    elif not (isinstance(includes, list) and all(isinstance(i, str) for i in includes)):
        raise UsageError(f"{path}: include: must be a file name or a list of file names")
    merged: DictConfig = OmegaConf.create({})
    sources: tuple[Path, ...] = ()
    for include in includes:
        include_path = path.parent / include
        if not include_path.is_file():
            raise UsageError(f"{path}: include '{include}' not found (looked for {include_path})")
        base, base_sources = _load_tree(include_path, allowed, what, (*chain, path))
        merged = _merge(merged, base, include_path.resolve())
        sources += tuple(s for s in base_sources if s not in sources)
    return _merge(merged, _to_omegaconf(data, path), path), (*sources, path)


def load_with_includes(
    path: Path, allowed_keys: Iterable[str], what: str
) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """Load ``path`` and every config it includes (paths relative to the including file).

    Returns the merged mapping as plain Python values (included files first, the including file
    wins) and the files read, base first. Unknown top-level keys are reported against the file
    they are in.
    """
    merged, sources = _load_tree(Path(path), set(allowed_keys), what, ())
    return OmegaConf.to_container(merged, resolve=False), sources  # type: ignore[return-value]
