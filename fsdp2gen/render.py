"""Render the copier template into a new project folder, all or nothing.

copier renders into a temporary folder next to the destination; only a
complete project is moved into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from fsdp2gen import __version__
from fsdp2gen.questions import questions, template_dir

# Where `copier update` fetches newer template versions from. The packaged template is
# rendered offline, so the answers file is stamped with this repository and the version tag.
TEMPLATE_REPOSITORY = "https://github.com/fsdp2gen/fsdp2gen.git"
ANSWERS_FILE = ".copier-answers.yml"


class DestinationError(ValueError):
    """The destination cannot receive a project (the message says why and what to do)."""


def check_destination(dest: Path, *, force: bool) -> None:
    """Refuse a destination that is a file, a non-empty folder (without force), too long a name, or not
    writable: every reason `render_project` could not finish, found before anything is written."""
    try:
        _check_destination(Path(os.path.abspath(dest)), force=force)
    except OSError as error:  # e.g. a path longer than the system allows, or a folder we may not list
        raise DestinationError(f"cannot use {dest}: {error.strerror or error}; choose another DEST") from None


def _check_destination(dest: Path, *, force: bool) -> None:
    anchor = _nearest_existing(dest)
    max_name = _name_max(anchor)
    for part in dest.relative_to(anchor).parts:
        size = len(os.fsencode(part))
        if size > max_name:
            shown = part if len(part) <= 40 else part[:40] + "..."
            raise DestinationError(
                f"DEST name {shown!r} is {size} bytes, more than the {max_name} a file name may have; "
                "choose a shorter DEST"
            )
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"{dest} exists and is not a folder; choose another DEST")
    if dest.is_dir():
        if any(dest.iterdir()) and not force:
            raise DestinationError(
                f"{dest} exists and is not empty; choose another DEST or pass --force to write into it"
            )
        if not os.access(dest, os.W_OK | os.X_OK):
            raise DestinationError(f"cannot write into {dest}: permission denied; choose a DEST you can write to")
        return
    if not anchor.is_dir():
        raise DestinationError(f"cannot create {dest}: {anchor} is a file, not a folder; choose another DEST")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create {dest}: {anchor} is not writable; choose a DEST you can write to")


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # every common Linux and macOS file system


def render_project(
    dest: Path, answers: dict[str, Any], *, force: bool = False, dry_run: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Render the template with `answers` into `dest`; return its files (relative) and the recorded answers.

    With `dry_run` the rendered staging folder is discarded and nothing is written.
    """
    import copier  # imported here: it costs ~0.5 s, which --help and errors should not pay

    dest = Path(os.path.abspath(dest))  # abspath, not absolute(): `.` and `..` must give the folder's name
    check_destination(dest, force=force)
    # Staged on the file system it will live on, so that moving it into place is a rename: inside DEST when
    # DEST exists (its parent may not be writable), else in DEST's nearest existing ancestor.
    # A dry run writes nothing near DEST.
    if dry_run:
        staging_root = None
    else:
        staging_root = dest if dest.is_dir() else _nearest_existing(dest.parent)
    try:
        with tempfile.TemporaryDirectory(prefix=".fsdp2gen-", dir=staging_root) as tmp:
            # The staging folder carries the final name: copier derives project_name from it.
            staging = Path(tmp) / dest.name
            copier.run_copy(
                str(template_dir()), staging, data=answers, defaults=True, unsafe=False, quiet=True, overwrite=True
            )
            recorded = _stamp_answers_file(staging / ANSWERS_FILE)
            written = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
            if not dry_run:
                _move_into_place(staging, dest)
    except OSError as error:
        raise DestinationError(
            f"cannot write {dest}: {error.strerror or error}; choose a DEST you can write to"
        ) from None
    return written, recorded


def _nearest_existing(path: Path) -> Path:
    # os.path.exists, not Path.exists: it is False (not an error) for a name too long to exist.
    while not os.path.exists(path) and path != path.parent:
        path = path.parent
    return path


def _stamp_answers_file(path: Path) -> dict[str, Any]:
    """Record the canonical template repository and version instead of this machine's template path.

    Returns the answers as recorded, in question order.
    """
    text = path.read_text()
    text = re.sub(r"^_src_path: .*$", f"_commit: v{__version__}\n_src_path: {TEMPLATE_REPOSITORY}", text, flags=re.M)
    path.write_text(text)
    recorded = yaml.safe_load(text)
    return {name: recorded[name] for name in questions() if name in recorded}


def _move_into_place(staging: Path, dest: Path) -> None:
    """Move the rendered project to `dest`. An existing folder is kept, never removed and recreated: the
    caller's shell may be in it (`fsdp2gen new .`), and its mode and owner are the user's."""
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(dest)
        return
    if any(child.name != staging.parent.name for child in dest.iterdir()):
        # --force into a non-empty folder: files of the project replace same-named ones, others stay.
        shutil.copytree(staging, dest, dirs_exist_ok=True)
        return
    moved: list[Path] = []
    try:
        for child in sorted(staging.iterdir()):
            child.rename(dest / child.name)
            moved.append(dest / child.name)
    except OSError:
        for path in moved:  # all or nothing: put back what was moved
            path.rename(staging / path.name)
        raise
