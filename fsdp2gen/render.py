"""Render the copier template into a project folder, all or nothing, never over anyone's work.

The project is rendered completely into a staging folder on DEST's file system first, so a failure while
rendering (a full disk, a bad answer) leaves nothing behind. Then:
- a DEST that does not exist is created by one rename of the staging folder: two runs racing for it, one
  wins and the other's rename fails (a folder is only renamed over an empty one);
- an existing empty DEST receives the staged files, under an exclusive lock on DEST;
- with --force, an existing project that fsdp2gen made (it has .copier-answers.yml) is updated file by file,
  under the same lock, like `copier update` (see _update_in_place); any other non-empty DEST is refused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fsdp2gen import __version__
from fsdp2gen.files import FileInputError
from fsdp2gen.questions import questions, read_answers, template_dir, validate

# Where `copier update` fetches newer template versions from. The packaged template is
# rendered offline, so the answers file is stamped with this repository and the version tag.
TEMPLATE_REPOSITORY = "https://github.com/fsdp2gen/fsdp2gen.git"
ANSWERS_FILE = ".copier-answers.yml"
# Staging folders; one left by a killed run is removed by the next run that holds DEST's lock.
STAGING_PREFIX = ".fsdp2gen-"
# What `new --force` did to each file of the project (reported per file).
WRITTEN, UNCHANGED, MERGED, KEPT, CONFLICT, REMOVED, KEPT_STALE = (
    "written", "unchanged", "merged", "kept, edited", "conflict", "removed", "kept, edited, no longer generated",
)  # fmt: skip


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
    """The folder's entries, but staging folders (this run's, or a killed run's)."""
    return [child for child in folder.iterdir() if not child.name.startswith(STAGING_PREFIX)]


def render_project(
    dest: Path, answers: dict[str, Any], *, force: bool = False, dry_run: bool = False
) -> tuple[list[str], dict[str, Any], dict[str, str]]:
    """Render the template with `answers` into `dest`; return its files (relative), the recorded answers, and
    what --force did to each file of an existing project ({} when the project is new).

    With `dry_run` nothing is written near DEST (the rendering is staged in the system's temporary folder).
    """
    dest = Path(os.path.abspath(dest))  # abspath, not absolute(): `.` and `..` must give the folder's name
    check_destination(dest, force=force)
    try:
        if dry_run:
            with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX) as tmp:
                written, recorded = _render(Path(tmp), dest.name, answers)
                changes = _update_in_place(dest, Path(tmp), dry_run=True) if dest.is_dir() and _entries(dest) else {}
                return written, recorded, changes
        if not dest.is_dir():
            return (*_create(dest, answers), {})
        with _locked(dest):
            check_destination(dest, force=force)  # again: another run may have filled it before we held the lock
            for leftover in dest.glob(STAGING_PREFIX + "*"):  # of a killed run: a live one would hold the lock
                shutil.rmtree(leftover, ignore_errors=True)
            if _entries(dest):
                # Rendered and merged away from DEST: a refusal (bad recorded answers, a colliding path) leaves
                # DEST untouched; only the files to write are then copied into DEST's file system.
                with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX) as tmp:
                    written, recorded = _render(Path(tmp), dest.name, answers)
                    return written, recorded, _update_in_place(dest, Path(tmp), dry_run=False)
            # Staged inside DEST, which is writable (its parent may not be), on DEST's file system.
            with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=dest) as tmp:
                written, recorded = _render(Path(tmp), dest.name, answers)
                _move_into_place(Path(tmp) / dest.name, dest)
                return written, recorded, {}
    except OSError as error:
        raise DestinationError(_write_error(dest, error)) from None


def _write_error(dest: Path, error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return (
            f"cannot write {dest}: {error.strerror} (nothing was written); free some space there (df -h) or "
            "choose a DEST on another disk"
        )
    return f"cannot write {dest}: {error.strerror or error}; choose a DEST you can write to"


def _render(staging: Path, name: str, answers: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Render into `staging`/`name` (copier derives project_name from the folder's name); return the files
    and the recorded answers."""
    import copier  # imported here: it costs ~0.5 s, which --help and errors should not pay

    project = staging / name
    copier.run_copy(str(template_dir()), project, data=answers, defaults=True, unsafe=False, quiet=True, overwrite=True)
    recorded = _stamp_answers_file(project / ANSWERS_FILE)
    return _files(project), recorded


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _create(dest: Path, answers: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Render beside DEST (in its nearest existing ancestor, on the same file system) and rename the complete
    project to DEST: at no time does DEST hold part of a project."""
    with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=_nearest_existing(dest.parent)) as tmp:
        written, recorded = _render(Path(tmp), dest.name, answers)
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
def _locked(dest: Path) -> Iterator[None]:
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


def _update_in_place(dest: Path, staging: Path, *, dry_run: bool) -> dict[str, str]:
    """`new --force` over a project fsdp2gen made: a three-way merge per file, like `copier update`.

    The base is the project as rendered from its recorded answers by this template; for each file:
    unchanged by the user -> the new rendering; changed only by the user -> kept; changed by both -> merged
    with `git merge-file`, conflicts left as inline markers; a file of the old answers the new ones no longer
    produce -> removed only if unchanged by the user. Everything is checked and staged before the first file
    of DEST changes; then each file is placed with one rename. Returns {path: what was done}.
    """
    new = staging / dest.name
    recorded_path = dest / ANSWERS_FILE
    try:
        recorded = read_answers(recorded_path, f"restore it (git log -- {ANSWERS_FILE}) or choose another DEST")
    except FileInputError as error:
        raise DestinationError(str(error)) from None
    base = _render_base(staging / "base", dest.name, recorded)
    paths = sorted(set(_files(new)) | set(_files(base) if base else ()))
    _check_collisions(dest, [path for path in paths if (new / path).is_file()])
    merged_dir = staging / "merged"
    changes = _three_way(dest, new, base, paths, merged_dir)
    if not dry_run:
        _apply(dest, changes, new, merged_dir)
    return changes


def _three_way(dest: Path, new: Path, base: Path | None, paths: list[str], merged_dir: Path) -> dict[str, str]:
    """What `new --force` does with each file of `paths` (see _update_in_place); merged ones staged in merged_dir."""
    changes: dict[str, str] = {}
    for path in paths:
        theirs = _read(new / path)
        old = _read(base / path) if base else None
        target = dest / path
        mine = _read(target) if target.is_file() and not target.is_symlink() else None
        if theirs is None:  # produced by the recorded answers only
            if mine is not None:
                changes[path] = REMOVED if mine == old else KEPT_STALE
            continue
        if mine is None or mine == old or path == ANSWERS_FILE:
            # New, or untouched since it was rendered; the answers file records the answers now used.
            changes[path] = UNCHANGED if mine == theirs else WRITTEN
        elif mine == theirs:
            changes[path] = UNCHANGED
        elif theirs == old:
            changes[path] = KEPT
        else:
            content, clean = _merge(mine, old or b"", theirs, merged_dir)
            staged = merged_dir / path
            staged.parent.mkdir(parents=True, exist_ok=True)
            staged.write_bytes(content)
            shutil.copymode(new / path, staged)
            changes[path] = MERGED if clean else CONFLICT
    return changes


def _apply(dest: Path, changes: dict[str, str], new: Path, merged_dir: Path) -> None:
    """Write, merge and remove in DEST what _three_way decided."""
    writes = [path for path, change in changes.items() if change in (WRITTEN, MERGED, CONFLICT)]
    with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=dest) as tmp:
        # Every file is copied onto DEST's file system first (a full disk fails here, DEST unchanged) ...
        for index, path in enumerate(writes):
            shutil.copy2(new / path if changes[path] == WRITTEN else merged_dir / path, Path(tmp) / str(index))
        # ... then each is placed with one rename: a file of DEST is the old one or the new one, never half.
        for index, path in enumerate(writes):
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(Path(tmp) / str(index), dest / path)
    for path, change in changes.items():
        if change == REMOVED:
            (dest / path).unlink()
            _remove_empty_parents(dest, dest / path)


def _render_base(staging: Path, name: str, recorded: dict[str, Any]) -> Path | None:
    """The project as this template renders the recorded answers; None when they are not answers this
    template accepts (another version's): then every file the user has that differs counts as edited."""
    known = questions()
    answers = {key: known[key].normalise(value) for key, value in recorded.items() if key in known}
    if validate(answers):
        return None
    try:
        _render(staging, name, answers)
    except ValueError:
        return None
    return staging / name


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _check_collisions(dest: Path, paths: list[str]) -> None:
    """Refuse, before anything is written, a DEST where a project file cannot be placed: a file (or link)
    where the project needs a folder, or a folder (or pipe, device, link) where it needs a file."""
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts)):
            folder = dest.joinpath(*parts[:depth])
            if os.path.lexists(folder) and not folder.is_dir():
                raise DestinationError(
                    f"{folder} is a file but the project needs a folder there (for {path}); move it away or "
                    "choose another DEST (nothing was written)"
                )
        target = dest / path
        if os.path.lexists(target) and (target.is_symlink() or not target.is_file()):
            raise DestinationError(
                f"{target} is not a regular file but the project writes one there; move it away or choose "
                "another DEST (nothing was written)"
            )


# Labels of the conflict markers: "<<<<<<< yours", "||||||| generated before", ">>>>>>> generated now".
MERGE_LABELS = ("yours", "generated before", "generated now")


def _merge(mine: bytes, old: bytes, theirs: bytes, scratch: Path) -> tuple[bytes, bool]:
    """Three-way merge with `git merge-file` (edits to different lines both kept); returns the content and
    whether it merged without conflicts. Without git, the user's file is kept whole in the conflict."""
    scratch.mkdir(parents=True, exist_ok=True)
    files = []
    for name, content in zip(("mine", "old", "theirs"), (mine, old, theirs), strict=True):
        (scratch / f".{name}").write_bytes(content)
        files.append(str(scratch / f".{name}"))
    labels = [arg for label in MERGE_LABELS for arg in ("-L", label)]
    try:
        result = subprocess.run(["git", "merge-file", "-p", "--diff3", *labels, *files], capture_output=True)
    except FileNotFoundError:
        result = None
    if result is None or result.returncode < 0 or result.returncode > 127:
        yours, now = MERGE_LABELS[0].encode(), MERGE_LABELS[2].encode()
        return b"<<<<<<< " + yours + b"\n" + mine + b"=======\n" + theirs + b">>>>>>> " + now + b"\n", False
    return result.stdout, result.returncode == 0


def _remove_empty_parents(dest: Path, removed: Path) -> None:
    folder = removed.parent
    while folder != dest:
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return
        folder = folder.parent


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
    try:
        for child in sorted(staging.iterdir()):
            child.rename(dest / child.name)
            moved.append(dest / child.name)
    except OSError:
        for path in moved:  # all or nothing: put back what was moved
            path.rename(staging / path.name)
        raise
