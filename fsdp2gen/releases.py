"""The template of each fsdp2gen version this installation can render: its own, and the earlier releases it
carries (fsdp2gen/previous_templates/<version>.tar.xz, written by scripts/release_templates.py from git).

`update` and `new --force` re-render a project as the version it records made it: that rendering is the base of
their three-way merge, so it must come from the package, with no network and no git repository of the template.
"""

from __future__ import annotations

import lzma
import re
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp2gen import __version__
from fsdp2gen.questions import PACKAGE_DIR, template_dir

PREVIOUS = PACKAGE_DIR / "previous_templates"
# What `_commit` holds: the version tag (v0.1.0), as copier records it.
VERSION = re.compile(r"^v?(\d+(\.\d+)*)$")


class UnknownVersion(ValueError):
    """A project records a template version this fsdp2gen does not carry (the message names those it does)."""


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def versions() -> list[str]:
    """Every version whose template this installation can render, oldest first (its own last)."""
    shipped = [path.name.removesuffix(".tar.xz") for path in PREVIOUS.glob("*.tar.xz")]
    return sorted({*shipped, __version__}, key=_key)


def recorded_version(commit: Any, where: str) -> str:
    """The version in a project's `_commit` (`v0.1.0` -> `0.1.0`), or UnknownVersion saying which this fsdp2gen
    can render and what to do. `where`: the answers file, for the message."""
    known = versions()
    listed = ", ".join(f"v{version}" for version in known)
    match = VERSION.match(str(commit).strip()) if isinstance(commit, str | int | float) else None
    version = match.group(1) if match else None
    if version in known:
        return version
    if version is not None and _key(version) > _key(__version__):
        raise UnknownVersion(
            f"{where} records template version v{version}, newer than this fsdp2gen ({__version__}); "
            "upgrade it (pip install -U fsdp2gen) and run again"
        )
    shown = f"v{version}" if version else repr(commit)
    raise UnknownVersion(
        f"{where} records template version {shown}, which this fsdp2gen ({__version__}) cannot update from (it can "
        f"from {listed}); restore the _commit fsdp2gen wrote (git log -p -- {Path(where).name}), or update a "
        "project of another template with `copier update`"
    )


@contextmanager
def template_of(version: str) -> Iterator[Path]:
    """The template folder (copier.yml and project/) of `version`, one of versions(): this installation's own, or
    an earlier release's unpacked into a temporary folder for the duration of the `with`."""
    if version == __version__:
        yield template_dir()
        return
    with tempfile.TemporaryDirectory(prefix="fsdp2gen-v" + version + "-") as tmp:
        with lzma.open(PREVIOUS / f"{version}.tar.xz") as packed, tarfile.open(fileobj=packed) as tar:
            # Our own archive (package data), but unpacked as untrusted data all the same where Python can.
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        yield Path(tmp) / "templates"
