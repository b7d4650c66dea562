"""Render the copier template into a project folder, all or nothing, never over anyone's work.

The project is rendered completely into a staging folder on DEST's file system first, so a failure while
rendering (a full disk, a bad answer) leaves nothing behind. Then:
- a DEST that does not exist is created by one rename of the staging folder: two runs racing for it, one
  wins and the other's rename fails (a folder is only renamed over an empty one);
- an existing empty DEST receives the staged files, under an exclusive lock on DEST (a run killed while moving
  them is undone by the next run, which then places the whole project);
- with --force, an existing project that fsdp2gen made (it has .copier-answers.yml) is re-rendered file by file,
  under the same lock, like `fsdp2gen update` (update.py); any other non-empty DEST is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fsdp2gen import __version__
from fsdp2gen.questions import questions, template_dir

# The template's home, recorded as `_src_path` with the version tag as `_commit` (the packaged template is rendered
# from site-packages, a path worth nothing to the project): `fsdp2gen update` renders that version from the package
# (releases.py), `copier update` fetches it from here.
TEMPLATE_REPOSITORY = "https://github.com/fsdp2gen/fsdp2gen.git"
ANSWERS_FILE = ".copier-answers.yml"
# Staging folders; one left by a killed run is removed by the next run that holds DEST's lock.
STAGING_PREFIX = ".fsdp2gen-"
# In a staging folder inside DEST: the staged project's name, then the entries being moved into DEST.
PLACING = "placing"


class DestinationError(ValueError):
    """The destination cannot receive a project (the message says why and what to do)."""


def check_destination(dest: Path, *, force: bool) -> None:
    """Refuse a destination that is a file, a non-empty folder (with --force: one that holds no project
    fsdp2gen made), too long a name, or not writable: every reason `render_project` could not finish, found
    before anything is written."""
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
        if _entries(dest):
            if not is_project(dest):
                raise DestinationError(
                    f"{dest} exists, is not empty and holds no project fsdp2gen made (no {ANSWERS_FILE}); "
                    "choose another DEST or empty it"
                )
            if not force:
                raise DestinationError(
                    f"{dest} already holds an fsdp2gen project; choose another DEST, or pass --force to "
                    "re-render it with these answers (your edits are kept or shown as conflicts)"
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


def is_project(dest: Path) -> bool:
    """Whether `dest` holds a project fsdp2gen (or copier) made: its answers file is there."""
    answers = dest / ANSWERS_FILE
    return answers.is_file() and not answers.is_symlink()


def _entries(folder: Path) -> list[Path]:
    """The folder's entries, but staging folders (this run's, or a killed run's) and what a run killed while
    placing a project into it had placed (the next run puts it back: _undo_placing)."""
    placed = {path for _, moved in _killed_placings(folder) for path in moved}
    return [child for child in folder.iterdir() if not child.name.startswith(STAGING_PREFIX) and child not in placed]


def _killed_placings(dest: Path) -> list[tuple[Path, list[Path]]]:
    """(staged project, the entries of it already in `dest`) of each run killed while _move_into_place moved a
    project into `dest` (its staging folder holds the list of what it was moving, PLACING)."""
    found = []
    for staging in dest.glob(STAGING_PREFIX + "*"):
        try:
            names = (staging / PLACING).read_text().splitlines()
        except OSError:
            continue  # killed before it moved anything (or not a staging folder of ours)
        project = staging / names[0]
        found.append((project, [dest / name for name in names[1:] if not os.path.lexists(project / name)]))
    return found


def _undo_placing(dest: Path) -> None:
    """Put what a killed run had placed in `dest` back into its staging folder, and remove that (under the lock):
    `dest` is as empty as before that run, never left holding part of a project."""
    for project, moved in _killed_placings(dest):
        for path in moved:
            path.rename(project / path.name)
    for leftover in dest.glob(STAGING_PREFIX + "*"):  # of a killed run: a live one would hold the lock
        shutil.rmtree(leftover, ignore_errors=True)


def render_project(dest: Path, answers: dict[str, Any], *, dry_run: bool = False) -> tuple[list[str], dict[str, Any]]:
    """Render the template with `answers` into `dest`, which does not exist or is empty; return its files (relative)
    and the recorded answers. (`new --force` over a project is update.rerender.)

    With `dry_run` nothing is written near DEST (the rendering is staged in the system's temporary folder).
    """
    dest = Path(os.path.abspath(dest))  # abspath, not absolute(): `.` and `..` must give the folder's name
    check_destination(dest, force=False)
    try:
        if dry_run:
            with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX) as tmp:
                return render(Path(tmp), dest.name, answers)
        if not dest.is_dir():
            return _create(dest, answers)
        with locked(dest):
            _undo_placing(dest)
            if _entries(dest):  # filled by another run before this one held the lock
                raise DestinationError(
                    f"{dest} was filled by another run while this one rendered (nothing written); choose another DEST"
                )
            # Staged inside DEST, which is writable (its parent may not be), on DEST's file system.
            with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=dest) as tmp:
                written, recorded = render(Path(tmp), dest.name, answers)
                _move_into_place(Path(tmp) / dest.name, dest)
                return written, recorded
    except OSError as error:
        raise DestinationError(write_error(dest, error)) from None


def write_error(dest: Path, error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (
            f"cannot write {dest}: {error.strerror} (nothing was written); free some space there (df -h) or "
            "choose a DEST on another disk"
        )
    return f"cannot write {dest}: {error.strerror or error}; choose a DEST you can write to"


def render(
    staging: Path, name: str, answers: dict[str, Any], *, template: Path | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Render `template` (default: this version's) into `staging`/`name` (copier derives project_name from the
    folder's name); return the files and the recorded answers."""
    import copier  # imported here: it costs ~0.5 s, which --help and errors should not pay

    project = staging / name
    source = str(template or template_dir())
    copier.run_copy(source, project, data=answers, defaults=True, unsafe=False, quiet=True, overwrite=True)
    fill_resume_table(project)
    recorded = _stamp_answers_file(project / ANSWERS_FILE)
    return files(project), recorded


# README.md's line that fill_resume_table replaces with the project's table of what a resume may change.
RESUME_TABLE_MARK = "<!-- fsdp2gen: the resume table of schema.py -->\n"
RESUME_TABLE_CODE = (
    "import config, model_args, schema\n"
    "print(schema.resume_table(config.Config, model_args.RESUME_MAY_CHANGE), end='')\n"
)


def fill_resume_table(project: Path) -> None:
    """Write into the rendered project's README what a resume may change, made from its own schema (config.py's
    dataclasses, each key's declaration): one source, never typed twice. The project's config modules import no
    torch; they run in a subprocess, so the generator imports none of the project's code. (Templates of older
    versions have no mark: nothing to do.)"""
    readme = project / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if RESUME_TABLE_MARK not in text:
        return
    table = subprocess.run([sys.executable, "-c", RESUME_TABLE_CODE], cwd=project, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(project)}, check=True).stdout  # fmt: skip
    readme.write_text(text.replace(RESUME_TABLE_MARK, table))


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _create(dest: Path, answers: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Render beside DEST (in its nearest existing ancestor, on the same file system) and rename the complete
    project to DEST: at no time does DEST hold part of a project."""
    with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=_nearest_existing(dest.parent)) as tmp:
        written, recorded = render(Path(tmp), dest.name, answers)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            # rename(2) replaces only an empty folder: if another run created DEST meanwhile, this one loses.
            (Path(tmp) / dest.name).rename(dest)
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            raise DestinationError(
                f"{dest} was created by another run while this one rendered (nothing written); choose another DEST"
            ) from None
    return written, recorded


@contextmanager
def locked(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder DEST itself (flock on its descriptor, no lock file to leave behind;
    the kernel releases it when the process dies). A second run is refused rather than queued: it would find
    DEST changed under it."""
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DestinationError(
                f"another fsdp2gen run is writing into {dest}; wait for it to finish, then run again"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


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
    """Move the rendered project into the empty folder `dest` (under its lock). The folder is kept, never
    removed and recreated: the caller's shell may be in it (`fsdp2gen new .`), and its mode and owner are the
    user's."""
    moved: list[Path] = []
    # The answers file last: a folder that has it holds a whole project (is_project). What is moved is listed
    # first, in the staging folder: a run killed in between is undone by the next one (_undo_placing).
    children = sorted(staging.iterdir(), key=lambda child: (child.name == ANSWERS_FILE, child.name))
    (staging.parent / PLACING).write_text("\n".join([staging.name, *(child.name for child in children)]) + "\n")
    try:
        for child in children:
            child.rename(dest / child.name)
            moved.append(dest / child.name)
    except OSError:
        for path in moved:  # all or nothing: put back what was moved
            path.rename(staging / path.name)
        raise
