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
    """Refuse a destination that is a file, a non-empty folder (without force), or not writable."""
    if dest.is_file() or (dest.exists() and not dest.is_dir()):
        raise DestinationError(f"{dest} exists and is not a folder; choose another DEST")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise DestinationError(f"{dest} exists and is not empty; choose another DEST or pass --force to write into it")
    anchor = _nearest_existing(dest.parent)
    if not anchor.is_dir() or not os.access(anchor, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create {dest}: {anchor} is not writable; choose a DEST you can write to")


def render_project(
    dest: Path, answers: dict[str, Any], *, force: bool = False, dry_run: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Render the template with `answers` into `dest`; return its files (relative) and the recorded answers.

    With `dry_run` the rendered staging folder is discarded and nothing is written.
    """
    import copier  # imported here: it costs ~0.5 s, which --help and errors should not pay

    dest = dest.absolute()
    check_destination(dest, force=force)
    anchor = _nearest_existing(dest.parent)
    try:
        with tempfile.TemporaryDirectory(prefix=".fsdp2gen-", dir=anchor) as tmp:
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
    while not path.exists() and path != path.parent:
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
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_dir() and any(dest.iterdir()):
        # --force into a non-empty folder: files of the project replace same-named ones, others stay.
        shutil.copytree(staging, dest, dirs_exist_ok=True)
    else:
        if dest.is_dir():
            dest.rmdir()
        staging.rename(dest)
