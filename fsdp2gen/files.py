"""Reading the small text files a user names (answers files, config.toml, config.json) without surprises.

Each read refuses what would hang or blow up instead of failing once, clearly: a FIFO or device (reading
blocks), a folder, a file larger than any such file could be, bytes that are not UTF-8, and YAML with a key
given twice (PyYAML keeps the last one silently).
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

# Answers files, config.toml and a model's config.json are a few KiB; anything this large is the wrong file.
MAX_BYTES = 16 * 2**20


class FileInputError(ValueError):
    """A user-named file that cannot be used (the message names the file, the problem and the fix)."""


def read_text(path: Path, what: str, fix: str) -> str:
    """The UTF-8 text of the regular file `path`; the messages call it `what` (e.g. "answers file") and end
    with `fix` (what to do instead)."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise FileInputError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise FileInputError(f"{what} {path} is a folder, not a file; {fix}")
    if not stat.S_ISREG(mode):
        # A FIFO would block the read until someone writes to it; a device may never end.
        raise FileInputError(f"{what} {path} is not a regular file (a pipe or a device); {fix}")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as error:
        raise FileInputError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if len(data) > MAX_BYTES:
        raise FileInputError(f"{what} {path} is larger than {MAX_BYTES // 2**20} MiB; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FileInputError(f"{what} {path} is not UTF-8 text (byte {error.start}); {fix}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice."""


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
    """`yaml.safe_load(text)`, except that a key given twice raises yaml.YAMLError naming it."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error as one short clause: what is wrong, and where."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        where = f" (line {mark.line + 1})" if mark else ""
        return f"{error.problem or error.context}{where}"
    return " ".join(str(error).split())
