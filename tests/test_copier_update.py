"""`fsdp2gen update`: a project made by the previous release's wheel moves to this version offline, keeping the
user's edits; a new answer adds what it needs; conflicts and files no longer generated are reported; what cannot be
updated is refused in one line. And copier itself: `copier copy` / `copier update` of this repository."""

from __future__ import annotations

import difflib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from fsdp2gen import __version__
from fsdp2gen.releases import template_of, versions
from fsdp2gen.render import RESUME_TABLE_MARK, TEMPLATE_REPOSITORY, fill_resume_table
from tests.conftest import REPO, fsdp2gen, tree

COPIER = str(Path(sys.executable).parent / "copier")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
}  # fmt: skip
# No network for anything git (or pip) would fetch: only file:// for git, every proxy a closed local port.
OFFLINE = {
    "GIT_ALLOW_PROTOCOL": "file", "GIT_TERMINAL_PROMPT": "0", "no_proxy": "", "NO_PROXY": "",
    **{name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
}  # fmt: skip


def _release_script():
    spec = importlib.util.spec_from_file_location("release_templates", REPO / "scripts" / "release_templates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RELEASES = _release_script().RELEASES  # version -> commit of each release the package carries
PREVIOUS = max(RELEASES, key=lambda version: tuple(map(int, version.split("."))))


@pytest.fixture(autouse=True)
def git_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests commit in the projects; CI machines may have no git identity.
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)


def git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout


def commit_all(path: Path, message: str) -> None:
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)


def release_source(commit: str, dest: Path) -> Path:
    """The repository at `commit` (git archive), in `dest`."""
    archived = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True)
    assert archived.returncode == 0, (
        f"the release commit {commit} is not in this clone's history ({archived.stderr.decode().strip()}); "
        "the update tests need a full clone (git fetch --unshallow)"
    )
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archived.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release installed from its wheel (built offline from its commit): a folder for PYTHONPATH."""
    root = tmp_path_factory.mktemp("previous-release")
    source = release_source(RELEASES[PREVIOUS], root / "source")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    env = {**os.environ, **OFFLINE}
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "wheel"),
                            str(source)], capture_output=True, text=True, env=env)  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "wheel").glob("fsdp2gen-*.whl")
    installed = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(root / "site"),
                                str(wheel)], capture_output=True, text=True, env=env)  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return root / "site"


def old_fsdp2gen(site: Path, *args: str) -> subprocess.CompletedProcess:
    # Run from the install's folder: `python -m` puts the working directory first on sys.path, and this
    # repository's checkout must not stand in for the release.
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, "-m", "fsdp2gen", *args], capture_output=True, text=True, env=env, cwd=site)


def stable_line(before: bytes, after: bytes) -> str:
    """A line that both versions of a file have, unique in each, 3+ lines away from any difference between them:
    a user's edit there merges cleanly whatever changed elsewhere."""
    old, new = before.decode().splitlines(keepends=True), after.decode().splitlines(keepends=True)
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        for line in old[i1 + 3 : i2 - 3] if tag == "equal" else []:
            if line.strip() and old.count(line) == 1 and new.count(line) == 1:
                return line
    raise AssertionError("no line of the file is untouched by the change")


def replaced_line(before: bytes, after: bytes) -> str | None:
    """A line of `before` that `after` replaces (a user's edit there conflicts), or None."""
    old, new = before.decode().splitlines(keepends=True), after.decode().splitlines(keepends=True)
    for tag, i1, _, _, _ in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag == "replace" and old[i1].strip() and old.count(old[i1]) == 1:
            return old[i1]
    return None


def user_edit(line: str) -> str:
    return line.rstrip("\n") + "  # edited by the user\n"


def edit_line(content: bytes, line: str) -> bytes:
    assert content.decode().count(line) == 1
    return content.decode().replace(line, user_edit(line)).encode()


def project_files(project: Path) -> dict[str, bytes]:
    return {path: content for path, content in tree(project).items() if not path.startswith(".git/")}


def test_update_from_the_previous_release_wheel_offline(previous_release: Path, tmp_path: Path) -> None:
    """The decisive case: a project generated by the previous release (installed from its wheel), committed, edited
    by its user, then `fsdp2gen update` of this version with no git remote and no network. The project becomes this
    version's rendering of its answers, but for the user's edit."""
    assert old_fsdp2gen(previous_release, "--version").stdout == f"fsdp2gen {PREVIOUS}\n"
    options = ("--gpus", "2", "--fp32", "--tensorboard")
    project = tmp_path / "old" / "run"
    made = old_fsdp2gen(previous_release, "new", str(project), "-y", *options)
    assert made.returncode == 0, made.stderr
    git(project, "init", "-q")
    commit_all(project, "generated by the previous release")
    assert git(project, "remote").strip() == ""
    old_files = project_files(project)
    assert yaml.safe_load(old_files[".copier-answers.yml"])["_commit"] == f"v{PREVIOUS}"
    fresh = project_files(fsdp2gen_new(tmp_path / "fresh" / "run", *options))
    line = stable_line(old_files["config.toml"], fresh["config.toml"])
    (project / "config.toml").write_bytes(edit_line(old_files["config.toml"], line))
    commit_all(project, "user edit")

    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "fsdp2gen", "update", str(project), "--json"], capture_output=True,
                            text=True, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["from"], report["to"], report["conflicts"]) == (f"v{PREVIOUS}", f"v{__version__}", [])
    assert project_files(project) == {**fresh, "config.toml": edit_line(fresh["config.toml"], line)}
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert (answers["_commit"], answers["_src_path"]) == (f"v{__version__}", TEMPLATE_REPOSITORY)


def test_the_packaged_templates_are_the_releases(tmp_path: Path) -> None:
    """Each earlier release's template that the package carries is that release's templates/ (from git)."""
    assert versions() == sorted([*RELEASES, __version__], key=lambda v: tuple(map(int, v.split("."))))
    for version, commit in RELEASES.items():
        source = release_source(commit, tmp_path / version)
        with template_of(version) as template:
            assert tree(template) == tree(source / "templates"), version


def fsdp2gen_new(dest: Path, *options: str) -> Path:
    result = fsdp2gen("new", str(dest), "-y", *options)
    assert result.returncode == 0, result.stderr
    return dest


def test_update_with_new_answers_adds_what_they_need_and_keeps_edits(tmp_path: Path) -> None:
    """`update --tensorboard --tp 1 --launcher torchrun` on a tp 2 SLURM project: every file becomes the new answers'
    rendering but for the user's edits: one in a file the change leaves alone (kept), one in a file it changes away
    from the edit (merged), one on a line it changes (a conflict, reported), and an edited file the new answers no
    longer generate (kept, reported); the unedited ones are removed; one the user deleted is not re-created."""
    before_options = ("--gpus", "2", "--tp", "2", "--launcher", "slurm")
    after_options = ("--gpus", "2", "--tensorboard", "--tp", "1", "--launcher", "torchrun")
    before = project_files(fsdp2gen_new(tmp_path / "before" / "run", *before_options))
    after = project_files(fsdp2gen_new(tmp_path / "after" / "run", *after_options))
    project = fsdp2gen_new(tmp_path / "project" / "run", *before_options)
    git(project, "init", "-q")
    commit_all(project, "generated")

    both = sorted(set(before) & set(after) - {".copier-answers.yml"})
    untouched = "train.py" if before["train.py"] == after["train.py"] else [p for p in both if before[p] == after[p]][0]
    touched = sorted((p for p in both if before[p] != after[p]), key=lambda p: p != "config.toml")
    merged = touched[0]
    conflicted = next(p for p in touched[1:] if replaced_line(before[p], after[p]))
    stale = sorted(set(before) - set(after))
    stale_edited = next(p for p in stale if p.endswith(".py"))
    edits = {
        untouched: before[untouched] + b"# user's note\n",
        merged: edit_line(before[merged], stable_line(before[merged], after[merged])),
        conflicted: edit_line(before[conflicted], replaced_line(before[conflicted], after[conflicted])),
        stale_edited: before[stale_edited] + b"# user's note\n",
    }
    for path, content in edits.items():
        (project / path).write_bytes(content)
    deleted = next(p for p in both if p not in edits and p.endswith(".md"))
    (project / deleted).unlink()
    commit_all(project, "user edits")

    result = fsdp2gen("update", str(project), "--tensorboard", "--tp", "1", "--launcher", "torchrun", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["conflicts"], report["kept"]) == ([conflicted], [stale_edited])
    assert report["removed"] == [p for p in stale if p != stale_edited]
    assert (report["changes"][untouched], report["changes"][merged]) == ("kept, edited", "merged")
    assert report["changes"][deleted] == "deleted by you, not re-created"
    files = project_files(project)
    expected = {**after, untouched: edits[untouched], stale_edited: edits[stale_edited]}
    del expected[deleted]
    expected[merged] = edit_line(after[merged], stable_line(before[merged], after[merged]))
    assert sorted(files) == sorted(expected)
    assert [path for path in files if files[path] != expected[path]] == [conflicted]
    marked = files[conflicted].decode()
    edited_line = user_edit(replaced_line(before[conflicted], after[conflicted]))
    assert "<<<<<<< yours\n" in marked and edited_line in marked and ">>>>>>> generated now\n" in marked

    text = fsdp2gen("update", str(project))  # the tree is dirty now: conflicts to resolve, then commit
    assert (text.returncode, text.stderr) == (
        2, f"fsdp2gen: error: {project} has uncommitted changes; commit or stash them, then update\n"
    )  # fmt: skip


def test_update_refuses_what_it_cannot_update(tmp_path: Path) -> None:
    not_git = fsdp2gen_new(tmp_path / "plain", "--gpus", "2")
    result = fsdp2gen("update", str(not_git))
    assert (result.returncode, result.stderr) == (
        2, f"fsdp2gen: error: {not_git} is not a git repository; run `git init && git add -A && git commit -m init` "
        "there first\n",
    )  # fmt: skip
    project = tmp_path / "run"
    shutil.copytree(not_git, project)
    git(project, "init", "-q")
    commit_all(project, "generated")
    (project / "config.toml").write_text("# edited\n")
    dirty = fsdp2gen("update", str(project))
    assert (dirty.returncode, dirty.stderr) == (
        2, f"fsdp2gen: error: {project} has uncommitted changes; commit or stash them, then update\n"
    )  # fmt: skip
    git(project, "checkout", "-q", "--", ".")

    answers_file = project / ".copier-answers.yml"
    recorded = answers_file.read_text()
    listed = ", ".join(f"v{version}" for version in versions())
    for commit, message in (
        ("v0.0.7", f"records template version v0.0.7, which this fsdp2gen ({__version__}) cannot update from (it can "
                   f"from {listed}); restore the _commit fsdp2gen wrote (git log -p -- .copier-answers.yml), or "
                   "update a project of another template with `copier update`"),
        ("v99.0.0", f"records template version v99.0.0, newer than this fsdp2gen ({__version__}); upgrade it "
                    "(pip install -U fsdp2gen) and run again"),
    ):  # fmt: skip
        answers_file.write_text(recorded.replace(f"_commit: v{__version__}", f"_commit: {commit}"))
        commit_all(project, f"recorded version {commit}")
        before = project_files(project)
        result = fsdp2gen("update", str(project))
        assert (result.returncode, result.stderr) == (2, f"fsdp2gen: error: {answers_file} {message}\n")
        assert project_files(project) == before


# copier itself: the repository is a copier template (root copier.yml + templates/), for copier's own users.


@pytest.fixture
def template_repo(tmp_path: Path) -> Path:
    """A git copy of this repository's template (root copier.yml + templates/), tagged with this version."""
    repo = tmp_path / "template"
    repo.mkdir()
    shutil.copy(REPO / "copier.yml", repo / "copier.yml")
    shutil.copytree(REPO / "templates", repo / "templates", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q")
    commit_all(repo, "template")
    git(repo, "tag", f"v{__version__}")
    return repo


def copier_copy(template: Path, dest: Path) -> Path:
    result = subprocess.run(
        [COPIER, "copy", "--defaults", "--data", "gpus=2", "--data", "precision=fp32", str(template), str(dest)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    git(dest, "init", "-q")
    commit_all(dest, "generated")
    return dest


def test_copier_copy_and_update_of_the_repository(template_repo: Path, tmp_path: Path) -> None:
    """`copier copy` of the repository equals `fsdp2gen new` but for the recorded source; `copier update` from it
    keeps a user's edit and brings a template change."""
    copied = copier_copy(template_repo, tmp_path / "copied" / "run")
    answers = yaml.safe_load((copied / ".copier-answers.yml").read_text())
    assert answers["_commit"] == f"v{__version__}" and answers["_src_path"] == str(template_repo)
    from_cli = tree(fsdp2gen_new(tmp_path / "cli" / "run", "--gpus", "2", "--fp32"))
    from_copier = project_files(copied)
    assert sorted(from_copier) == sorted(from_cli)
    assert [p for p in from_cli if from_cli[p] != from_copier[p]] == [".copier-answers.yml", "README.md"]
    # The README's table of what a resume may change is made from the rendered project's schema, which copier alone
    # does not run: it leaves the mark that fsdp2gen fills (render.fill_resume_table). Filled, the two are equal.
    assert RESUME_TABLE_MARK.encode() in from_copier["README.md"]
    fill_resume_table(copied)
    assert (copied / "README.md").read_bytes() == from_cli["README.md"]
    commit_all(copied, "the resume table")

    config = copied / "config.toml"
    line = stable_line(from_copier["config.toml"], from_copier["config.toml"])
    config.write_bytes(edit_line(from_copier["config.toml"], line))
    commit_all(copied, "user edit")
    readme = template_repo / "templates" / "project" / "README.md.jinja"
    readme.write_text(readme.read_text() + "\nA later template's notes.\n")
    commit_all(template_repo, "template change")
    git(template_repo, "tag", "v99.0.0")
    updated = subprocess.run([COPIER, "update", "--defaults"], cwd=copied, capture_output=True, text=True)
    assert updated.returncode == 0, updated.stderr
    assert user_edit(line) in config.read_text()
    assert (copied / "README.md").read_text().endswith("\nA later template's notes.\n")
    assert yaml.safe_load((copied / ".copier-answers.yml").read_text())["_commit"] == "v99.0.0"
