"""Reading YAML config files: strict mappings, duplicate-key detection and ``include:`` merging.

Run configs are small YAML files (issue 5: one per paper experiment) that may ``include:`` a base
config. PyYAML silently keeps the last of two equal keys, which would hide a mistyped experiment
(two ``lr:`` lines, say), so the loader here refuses duplicates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml

from .errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a mapping with the same key twice."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(
                f"{loader.name}:{line}: key '{key}' appears twice (first on line {seen[key]}); "
                "keep one of them"
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """Parse ``path`` as a YAML mapping; ``what`` names the kind of file in error messages."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found; check the path") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML ({err.problem}); fix the syntax") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML ({err}); fix the syntax") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a YAML mapping (key: value lines)")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: top-level key {key!r} must be a string")
    return data


def deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Merge two config mappings: nested mappings merge key by key, anything else the child wins."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_with_includes(
    path: Path, allowed_keys: Iterable[str], what: str, _chain: tuple[Path, ...] = ()
) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """Load ``path`` and every config it includes (paths relative to the including file).

    Returns the merged mapping (included files first, the including file wins) and the list of
    files read, base first. Unknown top-level keys are reported against the file they are in.
    """
    path = path.resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"include cycle: {cycle}; remove one of the include: lines")
    data = read_yaml_mapping(path, what)
    allowed = set(allowed_keys)
    for key in data:
        if key not in allowed:
            raise ConfigError(
                f"{path}: unknown top-level key '{key}' (allowed: {', '.join(sorted(allowed))})"
            )
    includes = data.pop("include", None)
    if includes is None:
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    elif not (isinstance(includes, list) and all(isinstance(i, str) for i in includes)):
        raise ConfigError(f"{path}: include: must be a file name or a list of file names")
    merged: dict[str, Any] = {}
    sources: tuple[Path, ...] = ()
    for include in includes:
        include_path = path.parent / include
        if not include_path.is_file():
            raise ConfigError(f"{path}: include '{include}' not found (looked for {include_path})")
        base, base_sources = load_with_includes(include_path, allowed, what, (*_chain, path))
        merged = deep_merge(merged, base)
        sources += tuple(s for s in base_sources if s not in sources)
    return deep_merge(merged, data), (*sources, path)
