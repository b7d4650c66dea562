"""copier, directly: `copier copy` of this repository and `copier update` / `fsdp2gen update` keeping user edits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, fsdp2gen, torchrun, tree

COPIER = str(Path(sys.executable).parent / "copier")
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
}  # fmt: skip


@pytest.fixture(autouse=True)
def git_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    # copier commits in scratch repositories during update; CI machines may have no git identity.
    for name, value in GIT_IDENTITY.items():
        monkeypatch.setenv(name, value)


def git(path: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout


def commit_all(path: Path, message: str) -> None:
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)


@pytest.fixture
def template_repo(tmp_path: Path) -> Path:
    """A git copy of this repository's template (root copier.yml + templates/), tagged v0.1.0."""
    repo = tmp_path / "template"
    repo.mkdir()
    shutil.copy(REPO / "copier.yml", repo / "copier.yml")
    shutil.copytree(REPO / "templates", repo / "templates", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q")
    commit_all(repo, "template")
    git(repo, "tag", "v0.1.0")
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


def test_copier_copy_of_the_repository_equals_fsdp2gen_new(template_repo: Path, tmp_path: Path) -> None:
    copied = copier_copy(template_repo, tmp_path / "copied" / "run")
    answers = yaml.safe_load((copied / ".copier-answers.yml").read_text())
    assert answers["_commit"] == "v0.1.0" and answers["_src_path"] == str(template_repo)
    assert fsdp2gen("new", str(tmp_path / "cli" / "run"), "-y", "--gpus", "2", "--fp32").returncode == 0
    from_copier, from_cli = tree(copied), tree(tmp_path / "cli" / "run")
    from_copier.pop(".git", None)
    assert sorted(p for p in from_copier if not p.startswith(".git/")) == sorted(from_cli)
    differing = [p for p in from_cli if from_cli[p] != from_copier[p]]
    assert differing == [".copier-answers.yml"]  # only the recorded template source and version


def edit_as_a_user(project: Path) -> None:
    config = project / "config.toml"
    config.write_text(config.read_text().replace("log_every = 10 ", "log_every = 5  "))
    train = project / "train.py"
    anchor = '    """One optimizer step over this rank\'s micro-batches'
    assert anchor in train.read_text()
    train.write_text(train.read_text().replace(anchor, "    # user note: tuned for our cluster\n" + anchor))
    commit_all(project, "user edits")


def release_template_change(template: Path) -> None:
    template_train = template / "templates" / "project" / "train.py.jinja"
    anchor = "        # Started without torchrun: a group of one, no rendezvous needed.\n"
    assert anchor in template_train.read_text()
    template_train.write_text(template_train.read_text().replace(anchor, anchor + "        # template v0.2.0\n"))
    readme = template / "templates" / "project" / "README.md.jinja"
    readme.write_text(readme.read_text() + "\nTemplate v0.2.0 notes.\n")
    commit_all(template, "template change")
    git(template, "tag", "v0.2.0")


def assert_updated(project: Path) -> None:
    train = (project / "train.py").read_text()
    assert "# user note: tuned for our cluster" in train and "# template v0.2.0" in train
    assert "log_every = 5  " in (project / "config.toml").read_text()
    assert "Template v0.2.0 notes." in (project / "README.md").read_text()
    assert "<<<<<<<" not in train
    assert yaml.safe_load((project / ".copier-answers.yml").read_text())["_commit"] == "v0.2.0"


def test_fsdp2gen_update_and_copier_update_keep_user_edits(template_repo: Path, tmp_path: Path) -> None:
    with_fsdp2gen = copier_copy(template_repo, tmp_path / "a" / "run")
    with_copier = copier_copy(template_repo, tmp_path / "b" / "run")
    edit_as_a_user(with_fsdp2gen)
    edit_as_a_user(with_copier)
    release_template_change(template_repo)

    result = fsdp2gen("update", str(with_fsdp2gen), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["conflicts"] == []
    assert_updated(with_fsdp2gen)

    copier_cli = subprocess.run([COPIER, "update", "--defaults"], cwd=with_copier, capture_output=True, text=True)
    assert copier_cli.returncode == 0, copier_cli.stderr
    assert_updated(with_copier)

    # The updated project still trains on 2 CPU ranks.
    torchrun(with_fsdp2gen, "train.py", "--job.device", "cpu", "--training.steps", "2", "--model.n_layers", "1",
             "--training.seq_len", "16", "--training.global_batch_size", "4")  # fmt: skip
    assert len((with_fsdp2gen / "outputs" / "metrics.jsonl").read_text().splitlines()) == 2


def test_update_conflicts_are_reported(template_repo: Path, tmp_path: Path) -> None:
    project = copier_copy(template_repo, tmp_path / "run")
    anchor = "        # Started without torchrun: a group of one, no rendezvous needed.\n"
    train = project / "train.py"
    train.write_text(train.read_text().replace(anchor, "        # user's version of this line\n"))
    commit_all(project, "user edit")
    template_train = template_repo / "templates" / "project" / "train.py.jinja"
    template_train.write_text(template_train.read_text().replace(anchor, "        # template's version of this line\n"))
    commit_all(template_repo, "conflicting change")
    git(template_repo, "tag", "v0.2.0")
    result = fsdp2gen("update", str(project))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"Updated {project} with conflicts to resolve in: train.py\n"
    assert "<<<<<<< before updating" in train.read_text()


def test_update_refuses_what_copier_cannot_update(template_repo: Path, tmp_path: Path) -> None:
    not_git = tmp_path / "plain"
    assert fsdp2gen("new", str(not_git), "-y").returncode == 0
    result = fsdp2gen("update", str(not_git))
    assert result.returncode == 2
    assert result.stderr == (
        f"fsdp2gen: error: {not_git} is not a git repository; run `git init && git add -A && git commit -m init` "
        "there first\n"
    )

    project = copier_copy(template_repo, tmp_path / "run")
    (project / "config.toml").write_text("# edited\n")
    dirty = fsdp2gen("update", str(project))
    assert (dirty.returncode, dirty.stderr) == (
        2, f"fsdp2gen: error: {project} has uncommitted changes; commit or stash them, then update\n"
    )  # fmt: skip

    no_answers = tmp_path / "empty"
    no_answers.mkdir()
    missing = fsdp2gen("update", str(no_answers))
    assert missing.returncode == 2
    assert "has no .copier-answers.yml; only projects generated by fsdp2gen or copier can be updated" in missing.stderr

    untagged = tmp_path / "untagged"
    shutil.copytree(template_repo, untagged)
    git(untagged, "tag", "-d", "v0.1.0")
    project2 = tmp_path / "run2"
    shutil.copytree(project, project2)
    git(project2, "checkout", "-q", "--", ".")
    answers = project2 / ".copier-answers.yml"
    answers.write_text(answers.read_text().replace(str(template_repo), str(untagged)))
    commit_all(project2, "point at the untagged template")
    result = fsdp2gen("update", str(project2))
    assert result.returncode == 2
    assert result.stderr == (
        f"fsdp2gen: error: template repository {untagged} has no version tags; tag a release there, "
        "e.g. `git tag v0.2.0`\n"
    )
    assert os.path.isdir(project2)


def test_update_never_deletes_an_edited_file(template_repo: Path, tmp_path: Path) -> None:
    """A file the new template version drops is removed only if the user never edited it (compared with the old
    version's rendering); an edited one stays and is reported. Both are listed."""
    project = copier_copy(template_repo, tmp_path / "run")
    kill_rank = project / "tests" / "kill_rank.py"
    kill_rank.write_text(kill_rank.read_text() + "# user: our cluster's signal\n")
    commit_all(project, "user edit")
    edited = kill_rank.read_bytes()
    for dropped in ("tests/kill_rank.py", "profiling.py"):
        (template_repo / "templates" / "project" / dropped).unlink()
    commit_all(template_repo, "drop two files")
    git(template_repo, "tag", "v0.2.0")

    result = fsdp2gen("update", str(project), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["removed"], report["kept"], report["conflicts"]) == (["profiling.py"], ["tests/kill_rank.py"], [])
    assert kill_rank.read_bytes() == edited
    assert not (project / "profiling.py").exists()
    assert yaml.safe_load((project / ".copier-answers.yml").read_text())["_commit"] == "v0.2.0"
