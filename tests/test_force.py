"""`fsdp2gen new` never destroys (issue 24, data path 6): --force over a project fsdp2gen made behaves like an
update (edits kept or merged, stale files removed only if unedited, every change reported), anything else in DEST
is refused; creating DEST is atomic and exclusive; a write that fails mid-render leaves nothing."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fsdp2gen import __version__
from fsdp2gen.questions import questions, validate
from fsdp2gen.render import TEMPLATE_REPOSITORY
from tests.conftest import fsdp2gen, generate, invoke, tree

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.invalid"}  # fmt: skip

TRAIN_ANCHOR = '    """One optimizer step over this rank\'s micro-batches'
USER_NOTE = "    # user note: tuned for our cluster\n"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh `new run --gpus 2`, rendered once: the tests edit copies of it (copy_of) or compare with it."""
    return generate(tmp_path_factory.mktemp("clean") / "run", "--gpus", "2")


def copy_of(project: Path, dest: Path) -> Path:
    """A copy of `project` at `dest` (same name: the project's name), files, modes and all, as `new` left it."""
    assert dest.name == project.name
    return shutil.copytree(project, dest, symlinks=True)


def clean_render(tmp_path: Path, name: str, *options: str) -> dict[str, bytes]:
    """The files of a fresh `new` with these options, into a folder of the same name (the project's name)."""
    return tree(generate(tmp_path / "clean" / name, *options))


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `root` with its mode and content (folders: empty content)."""
    return {
        str(p.relative_to(root)): (p.lstat().st_mode, b"" if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def test_force_keeps_edited_train_and_config(two_gpus: Path, tmp_path: Path) -> None:
    project = copy_of(two_gpus, tmp_path / "run")
    edit(project / "train.py", TRAIN_ANCHOR, USER_NOTE + TRAIN_ANCHOR)
    edit(project / "config.toml", "log_every = 10 ", "log_every = 5  ")
    readme = (project / "README.md").read_bytes()

    same = fsdp2gen("new", str(project), "-y", "--gpus", "2", "--force", "--json")
    assert same.returncode == 0, same.stderr
    changes = json.loads(same.stdout)["changes"]
    assert changes["train.py"] == "kept, edited" and changes["config.toml"] == "kept, edited"
    assert set(changes.values()) == {"unchanged", "kept, edited"}
    assert USER_NOTE in (project / "train.py").read_text()
    assert "log_every = 5  " in (project / "config.toml").read_text()
    assert (project / "README.md").read_bytes() == readme

    # Other answers change both files: each edit is merged with the new rendering, and the report says so.
    other = fsdp2gen("new", str(project), "-y", "--gpus", "4", "--fp32", "--force")
    assert other.returncode == 0, other.stderr
    assert "  merged: config.toml\n" in other.stdout and "  merged: train.py\n" in other.stdout, other.stdout
    assert USER_NOTE in (project / "train.py").read_text()
    config = (project / "config.toml").read_text()
    assert "log_every = 5  " in config and "# 4 GPU(s) shard" in config and "reduce_dtype = " not in config
    # Only the user's edits differ from a clean render of the new answers.
    clean = clean_render(tmp_path, "run", "--gpus", "4", "--fp32")
    assert sorted(tree(project)) == sorted(clean)
    assert [path for path in clean if tree(project)[path] != clean[path]] == ["config.toml", "train.py"]


def test_force_conflicting_edit_is_marked_not_lost(two_gpus: Path, tmp_path: Path) -> None:
    project = copy_of(two_gpus, tmp_path / "run")
    edit(project / "config.toml", "# 2 GPU(s) shard one FSDP group.", "# our 2 GPUs: mine")
    result = fsdp2gen("new", str(project), "-y", "--gpus", "4", "--force")
    assert result.returncode == 0, result.stderr
    assert "  conflict: config.toml\n" in result.stdout and "Resolve the conflicts" in result.stdout
    config = (project / "config.toml").read_text()
    assert "<<<<<<< yours\n# our 2 GPUs: mine" in config and "\n# 4 GPU(s) shard one FSDP group." in config


def test_force_removes_stale_files_only_when_unedited(two_gpus: Path, tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--gpus", "2", "--tp", "2", "--launcher", "slurm")
    edit(project / "tensor_parallel.py", "import", "# mine\nimport")
    edited_tp = (project / "tensor_parallel.py").read_bytes()

    # The recorded answers are kept unless given: --tp 1 and --launcher torchrun drop what tp 2 and slurm made.
    result = fsdp2gen("new", str(project), "-y", "--tp", "1", "--launcher", "torchrun", "--force")
    assert result.returncode == 0, result.stderr
    assert "  removed: scripts/slurm.sbatch\n" in result.stdout
    assert "  kept, edited, no longer generated: tensor_parallel.py\n" in result.stdout
    assert not (project / "scripts" / "slurm.sbatch").exists() and not (project / "logs").exists()
    assert (project / "tensor_parallel.py").read_bytes() == edited_tp
    clean = tree(two_gpus)
    assert sorted(tree(project)) == sorted([*clean, "tensor_parallel.py"])


def test_force_refuses_a_folder_that_fsdp2gen_did_not_make(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    dest.mkdir()
    (dest / "train.py").write_text("my own training script\n")
    result = fsdp2gen("new", str(dest), "-y", "--force")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "holds no project fsdp2gen made" in result.stderr and "choose another DEST or empty it" in result.stderr
    assert tree(dest) == {"train.py": b"my own training script\n"}


def test_force_over_a_colliding_file_writes_nothing(two_gpus: Path, tmp_path: Path) -> None:
    project = copy_of(two_gpus, tmp_path / "run")
    shutil.rmtree(project / "scripts")
    (project / "scripts").write_text("a file where the project has a folder\n")
    before = snapshot(project)
    result = fsdp2gen("new", str(project), "-y", "--gpus", "2", "--force")
    assert result.returncode == 2, result.stdout
    assert result.stderr == (
        f"fsdp2gen: error: {project / 'scripts'} is a file but the project needs a folder there (for "
        "scripts/evaluate.py); move it away or choose another DEST (nothing was written)\n"
    )
    assert snapshot(project) == before


def _race(tmp_path: Path, dest: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """Two `fsdp2gen new DEST` started together."""
    command = [sys.executable, "-m", "fsdp2gen", "new", str(dest), "-y", "--gpus", "2", *extra]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    return [subprocess.CompletedProcess(run.args, run.wait(120), *run.communicate()) for run in runs]


def test_two_concurrent_new_into_one_dest(two_gpus: Path, tmp_path: Path) -> None:
    """Exactly one creates the project; the other exits 2 with one line; the project is one run's."""
    clean = tree(two_gpus)
    for round_, existing_empty in enumerate((False, True, False, True)):
        dest = tmp_path / f"race{round_}" / "run"
        if existing_empty:
            dest.mkdir(parents=True)
        runs = _race(tmp_path, dest)
        codes = sorted(run.returncode for run in runs)
        assert codes == [0, 2], [(run.returncode, run.stderr) for run in runs]
        winner, loser = sorted(runs, key=lambda run: run.returncode)
        assert winner.stdout.startswith(f"Created {dest} ")
        assert loser.stdout == "" and len(loser.stderr.splitlines()) == 1, loser.stderr
        assert tree(dest) == clean
        assert sorted(p.name for p in dest.parent.iterdir()) == ["run"]  # no staging folder left


def _limit_file_size() -> None:
    # Any file written past 16 KiB fails with EFBIG, as a write on a full disk fails with ENOSPC (no root needed).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**10, 16 * 2**10))


def _new_with_a_full_disk(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "fsdp2gen", "new", *args], capture_output=True, text=True,
                          env=env, preexec_fn=_limit_file_size, timeout=120)  # fmt: skip


def test_a_write_failing_mid_render_leaves_nothing(two_gpus: Path, tmp_path: Path) -> None:
    # The template renders a file over 16 KiB (train.py): the failure comes after other files were written.
    assert max(len(content) for content in tree(two_gpus).values()) > 16 * 2**10
    for dest in (tmp_path / "new" / "run", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        result = _new_with_a_full_disk(str(dest), "-y", "--gpus", "2")
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"fsdp2gen: error: cannot write {dest}: File too large (nothing was written)")
        assert len(result.stderr.splitlines()) == 1
        assert not (tmp_path / "new").exists() and (not dest.exists() or list(dest.iterdir()) == [])

    # --force over a project: the failure leaves the previous project as it was.
    project = copy_of(two_gpus, tmp_path / "run")
    edit(project / "config.toml", "log_every = 10 ", "log_every = 5  ")
    before = snapshot(project)
    result = _new_with_a_full_disk(str(project), "-y", "--gpus", "4", "--force")
    assert result.returncode == 2 and "File too large" in result.stderr, result.stdout + result.stderr
    assert snapshot(project) == before


def test_a_run_holding_dest_refuses_a_second(two_gpus: Path, tmp_path: Path) -> None:
    """While one run holds DEST's lock (flock on the folder), another `new --force` (or `new` into the empty
    folder) is refused in one line and changes nothing."""
    project = copy_of(two_gpus, tmp_path / "run")
    empty = tmp_path / "empty"
    empty.mkdir()
    for dest, force in ((project, ["--force"]), (empty, [])):
        before = snapshot(dest)
        fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            result = fsdp2gen("new", str(dest), "-y", "--gpus", "4", *force)
        finally:
            os.close(fd)
        assert (result.returncode, result.stderr) == (
            2, f"fsdp2gen: error: another fsdp2gen run is writing into {dest}; wait for it to finish, then run again\n"
        )  # fmt: skip
        assert snapshot(dest) == before


# Valid answer sets: the everyday answers drawn freely, at most one parallelism or feature option on (most pairs of
# them are refused together), hf's own answers with family hf; those the template refuses are dropped.
EVERYDAY = {
    "family": st.sampled_from(["llama", "hf", "custom"]), "gpus": st.sampled_from([1, 2, 4, 8]),
    "nodes": st.sampled_from([1, 2]), "reshard_after_forward": st.sampled_from(["true", "false"]),
    "tokenizer": st.sampled_from(["", "gpt2"]), "pretrained": st.booleans(),
    **{name: st.sampled_from(questions()[name].choice_values)
       for name in ("precision", "checkpoint", "launcher", "activation_checkpointing")},
    **{name: st.booleans() for name in ("compile", "cpu_offload", "prefetch", "tensorboard", "wandb")},
}  # fmt: skip
FEATURES = [{}, {"tp": 2}, {"moe": True}, {"moe": True, "ep": 2}, {"cp": 2}, {"pp": 2}, {"float8": True},
            {"lora": True}, {"task": "sft"}]  # fmt: skip


def _valid(drawn: dict) -> dict:
    """Every question answered: the drawn answers over the defaults."""
    defaults = {name: question.default for name, question in questions().items() if name != "project_name"}
    answers = {**defaults, **drawn}
    if answers["family"] == "hf":
        answers["hf_model"] = "meta-llama/Llama-3.2-1B"
    else:  # llama asks hf_model too (its default, "": from scratch); pretrained is hf's alone
        del answers["pretrained"]
        if answers["family"] != "llama":
            del answers["hf_model"]
    return answers


RECORDED = st.builds(lambda everyday, feature: _valid({**everyday, **feature}), st.fixed_dictionaries(EVERYDAY),
                     st.sampled_from(FEATURES)).filter(lambda answers: not validate(answers))  # fmt: skip
CHANGES = st.sampled_from([
    ("nodes", 4), ("tensorboard", True), ("wandb", True), ("prefetch", False), ("checkpoint", "full"),
    ("activation_checkpointing", "layer"), ("launcher", "slurm"),
])  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
@given(RECORDED, CHANGES, st.sampled_from(["new --force", "update"]))
def test_a_rerender_keeps_every_recorded_answer_it_is_not_given(recorded: dict, change: tuple, command: str) -> None:
    """`new --force` and `update` with one answer given: every other recorded answer is the one used (none falls
    back to its default: `new --force --nodes 4` on an hf + LoRA project stays hf + LoRA)."""
    name, value = change
    assume(recorded[name] != value and not validate({**recorded, name: value}))
    flag = questions()[name].flag
    option = ([flag] if value else [f"--no-{flag[2:]}"]) if isinstance(value, bool) else [flag, str(value)]
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "run"
        project.mkdir()
        stamped = {"_commit": f"v{__version__}", "_src_path": TEMPLATE_REPOSITORY, "project_name": "run", **recorded}
        (project / ".copier-answers.yml").write_text(yaml.safe_dump(stamped, sort_keys=False))
        if command == "update":
            for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "generated"]):
                subprocess.run(["git", "-C", str(project), *args], check=True, capture_output=True, env=GIT_ENV)
            result = invoke("update", str(project), *option)
        else:
            result = invoke("new", str(project), "--force", *option)
        assert result.exit_code == 0, result.output
        used = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert used == {**stamped, name: value}
