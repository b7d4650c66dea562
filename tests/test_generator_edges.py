"""Generator edges of issue 40: `new` killed while it places a project into an existing empty folder, and
`new --force` into a project with a folder on another file system.

The staged project is moved into the folder entry by entry (a folder the user's shell may be in is kept, not
replaced); a SIGKILL between two moves used to leave part of a project there, which the next `new` refused as a
non-empty folder. The next run now puts the part back and places the whole project.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import fsdp2gen, generate, tree

# `python -m fsdp2gen ARGS`, except that the process SIGKILLs itself just before its K-th rename into DEST:
# a real kill at a point where the project's files are being placed.
KILLED_WHILE_PLACING = """
import os, runpy, signal, sys
from pathlib import Path

dest, k = Path(sys.argv[1]).resolve(), int(sys.argv[2])
real_rename, moves = Path.rename, 0

def rename(self, target):
    global moves
    if Path(target).parent == dest:
        moves += 1
        if moves == k:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(self, target)

Path.rename = rename
sys.argv = ["fsdp2gen", *sys.argv[3:]]
runpy.run_module("fsdp2gen", run_name="__main__")
"""


def test_a_new_killed_while_placing_files_is_undone_by_the_next_new(tmp_path: Path) -> None:
    dest = tmp_path / "work" / "proj"
    dest.mkdir(parents=True)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_PLACING, str(dest), "4", "new", str(dest), "--yes"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr
    placed = [path.name for path in dest.iterdir() if not path.name.startswith(".fsdp2gen-")]
    assert len(placed) == 3, placed  # part of a project: what the next run must not leave there
    again = fsdp2gen("new", str(dest), "--yes")
    assert again.returncode == 0, again.stderr
    # The whole project, as a run that was never killed writes it (same folder name: the same project name), and
    # nothing of the killed run left beside it.
    reference = generate(tmp_path / "reference" / "proj")
    assert tree(dest) == tree(reference)
    assert sorted(path.name for path in dest.iterdir()) == sorted(path.name for path in reference.iterdir())


def test_force_re_renders_into_a_folder_on_another_file_system(tmp_path: Path) -> None:
    # The project's scripts/ is a symlink to a folder on another file system (here tmpfs): a file staged in the
    # project cannot be renamed there (EXDEV), which used to stop `new --force` after it had replaced the files
    # before scripts/ (a project half re-rendered). Now the file is staged beside its target and renamed there.
    other_fs = Path("/dev/shm")
    assert other_fs.is_dir() and other_fs.stat().st_dev != tmp_path.stat().st_dev, "no second file system to test"
    project = generate(tmp_path / "proj", "--gpus", "2")
    elsewhere = Path(tempfile.mkdtemp(dir=other_fs)) / "scripts"
    try:
        shutil.move(project / "scripts", elsewhere)
        (project / "scripts").symlink_to(elsewhere)
        result = fsdp2gen("new", str(project), "--yes", "--gpus", "4", "--force")
        assert result.returncode == 0, result.stderr
        reference = generate(tmp_path / "reference" / "proj", "--gpus", "4")
        # The same files as a fresh render with these answers, scripts/ still the user's symlink, nothing staged
        # left beside the files there.
        assert tree(elsewhere) == tree(reference / "scripts")
        assert tree(project) == {
            name: data for name, data in tree(reference).items() if not name.startswith("scripts/")
        }
        assert (project / "scripts").is_symlink()
    finally:
        shutil.rmtree(elsewhere.parent)
