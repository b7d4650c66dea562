"""Reading the small text files a user names (answers files, config.toml, config.json) without surprises.

Each read refuses what would hang or blow up instead of failing once, clearly: a FIFO or device (reading
blocks), a folder, a file larger than any such file could be, bytes that are not UTF-8, and YAML with a key
given twice (PyYAML keeps the last one silently), with anchors and aliases (`&a`/`*a`: a few lines of them expand
to billions of values, the "billion laughs"), or nested deeper than any answers file is.

Every YAML file a user gives (an answers file, a project's .copier-answers.yml) is read by read_yaml_mapping.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

# Answers files, config.toml and a model's config.json are a few KiB; anything this large is the wrong file.
MAX_BYTES = 16 * 2**20
# An answers file is under 2 KiB; PyYAML parses ~1 MiB/s, so this bounds the time a wrong file costs.
MAX_YAML_BYTES = 256 * 2**10
# Nesting of an answers file: values are scalars, at most a list or mapping or two deep.
MAX_YAML_DEPTH = 32


class FileInputError(ValueError):
    """A user-named file that cannot be used (the message names the file, the problem and the fix)."""


def read_text(path: Path, what: str, fix: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (at most `max_bytes`); the messages call it `what` (e.g.
    "answers file") and end with `fix` (what to do instead)."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise FileInputError(f"cannot read {what} {path}: {error.strerror or error}; {fix}") from None
    if stat.S_ISDIR(mode):
        raise FileInputError(f"{what} {path} is a folder, not a file; {fix}")
    if not stat.S_ISREG(mode):
        # A FIFO would block the read until someone writes to it; a device may never end.
        raise FileInputError(f"{what} {path} is not a regular file (a pipe or a device); {fix}")
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as error:
        raise FileInputError(f"cannot read {what} {path}: {error.strerror or error}; {fix}") from None
    if len(data) > max_bytes:
        size = f"{max_bytes // 2**20} MiB" if max_bytes >= 2**20 else f"{max_bytes // 2**10} KiB"
        raise FileInputError(f"{what} {path} is larger than {size}; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FileInputError(f"{what} {path} is not UTF-8 text (byte {error.start}); {fix}") from None


class _Refused(yaml.composer.ComposerError):
    """An anchor or alias, which answers files never need."""

    def __init__(self, what: str, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"{what} (YAML anchors and aliases are not accepted)", mark)
        self.what = what


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice, anchors and aliases, and deep nesting.

    Aliases are refused while composing, before any value is built: PyYAML shares an aliased node, so the
    load itself is fast, but any later walk of the value (a comparison, repr in a message, copier's own
    processing) visits every expansion: 10 lines of `&a`/`*a` make 9**10 values (minutes, then MemoryError).
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"alias *{event.anchor}", event.start_mark)
        if getattr(event, "anchor", None) is not None:
            raise _Refused(f"anchor &{event.anchor}", event.start_mark)
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"values nested more than {MAX_YAML_DEPTH} deep", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one"
                )
            seen[key] = line
        except TypeError:  # an unhashable key: construct_mapping reports it
            continue
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)`, except that a key given twice, an anchor or alias, or nesting deeper than
    MAX_YAML_DEPTH raises yaml.YAMLError naming it."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects


def read_yaml_mapping(path: Path, what: str, fix: str) -> dict[str, Any]:
    """The mapping in the YAML file `path` (keys as strings), read by load_yaml from at most MAX_YAML_BYTES;
    FileInputError names `what` and `path`, the problem, and ends with `fix`. The one reader of the YAML files
    users give: `new --answers-file`, and a project's .copier-answers.yml for `new --force`, `update`, `plan`."""
    text = read_text(path, what, fix, max_bytes=MAX_YAML_BYTES)
    try:
        loaded = load_yaml(text)
    except _Refused as error:
        raise FileInputError(
            f"{what} {path} line {error.problem_mark.line + 1}: {error.what} is refused (YAML anchors and aliases "
            "can expand to billions of values); write each value out"
        ) from None
    except yaml.YAMLError as error:
        raise FileInputError(f"{what} {path} is not valid YAML ({yaml_problem(error)}); {fix}") from None
    except RecursionError:  # nesting PyYAML's scanner meets before the composer's depth check
        raise FileInputError(f"{what} {path} is nested too deeply to be answers; {fix}") from None
    if not isinstance(loaded, dict):
        shown = "an empty document" if loaded is None else f"a {type(loaded).__name__}"
        raise FileInputError(f"{what} {path} must be a mapping of answers like 'gpus: 8', got {shown}; {fix}")
    return {str(key): value for key, value in loaded.items()}


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error as one short clause: what is wrong, and where."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f" (line {mark.line + 1})" if mark else ""
        return f"{error.problem or error.context}{where}"
    return " ".join(str(error).split())
