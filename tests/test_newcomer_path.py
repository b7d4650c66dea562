"""The newcomer's path, as printed: the README's main command, then every command that `fsdp2gen new` and the
generated README print as next steps, in order, each parsed from the printed text (never copied here) and each
exiting 0. And W&B's mode on a machine with and without credentials.

What is not run as printed, and why:
- `pip install ...`: this suite runs in the environment the README's test command installed; installing into it
  would change it (and needs the network). The project's `pip install -e '.[test]'` is resolved offline
  (`--dry-run --no-index`): its extra exists and every requirement is installed.
- GPU commands (no `DEVICE=cpu`): this machine has no GPU; the test checks instead that the folder they write
  is still empty, so they would start a run of their own instead of resuming the CPU run with other sizes.
- `pytest` (the project's own suite, 8 minutes on 2 cores; test_training_runs.py runs it): collected only.
- The launches get a tiny model appended (--model.*), the same for every launch so that they resume each other:
  the default model in bf16 is ~10x slower on CPUs without bf16 instructions. The batch size, sequence length
  and steps stay those printed: they are what decides whether a printed command fits the run before it.
train.py's output prints no command to run next (it names scripts/prepare_data.py, whose input is the user's).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, generate, metrics, torchrun_env

TINY_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.vocab_size", "128", "--model.ffn_dim", "172"]  # fmt: skip


def bash_blocks(markdown: str) -> list[list[str]]:
    """The commands of each ```bash block: one per line, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)\n```", markdown, flags=re.S)
    commands = [[re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()] for block in blocks]
    return [[command for command in block if command and not command.startswith("#")] for block in commands]


def printed_next(stdout: str) -> list[str]:
    """The commands under `fsdp2gen new`'s "Next:", their `# why` comments dropped."""
    lines = stdout.split("\nNext:\n", 1)[1].splitlines()
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines if line.strip()]


class Shell:
    """Runs printed commands one after another, as a user's shell would (`cd` included), and logs them."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        # The CLI from this checkout, the Python of this suite; no GPU; W&B off the network.
        self.env = {**torchrun_env(), "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"
        self.ran: list[str] = []

    def run(self, command: str) -> str:
        words = shlex.split(command)
        self.ran.append(command)
        if words[0] == "cd":
            self.cwd = self.cwd / words[1]
            assert self.cwd.is_dir(), command
            return ""
        if words[0] == "pip":
            if "-e" in words and words[words.index("-e") + 1] == ".":  # fsdp2gen itself: this suite's own install
                return ""
            words = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                     *words[2:]]  # fmt: skip
        elif words[0] == "pytest":
            words = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *words[1:]]
        elif any(word.endswith("launch_local.sh") for word in words):
            if "DEVICE=cpu" not in words:
                return "skipped: needs GPUs"
            words = [*words, *TINY_MODEL]
        env_words = [word for word in words if re.fullmatch(r"[A-Z_]+=\S*", word)]
        words = words[len(env_words) :]
        env = {**self.env, **dict(word.split("=", 1) for word in env_words)}
        result = subprocess.run(words, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{command} (in {self.cwd}) exited {result.returncode}:\n" + (
            result.stdout[-3000:] + result.stderr[-3000:]
        )
        return result.stdout


def test_every_printed_command_runs_in_order_after_the_readme_main_command(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    main_command = bash_blocks(readme)[0][0]
    shell = Shell(tmp_path)
    cli_next: list[str] = []
    for step in main_command.split(" && "):
        stdout = shell.run(step)
        if step.startswith("fsdp2gen new"):
            cli_next = printed_next(stdout)
    project = shell.cwd
    assert project == tmp_path / "my-run" and cli_next, shell.ran
    assert [m["step"] for m in metrics(project / "outputs")] == [1, 2, 3, 4, 5]

    generated = (project / "README.md").read_text()
    run_block = bash_blocks(generated.split("\n## Run\n", 1)[1])[0]
    printed = {command: shell.run(command) for command in [*cli_next, *run_block]}
    # The CPU commands continued the README's run (one run: each step logged once, the batch size it started with);
    # the GPU command would start its own run in a folder nothing wrote.
    records = metrics(project / "outputs")
    assert [m["step"] for m in records] == list(range(1, 21)) and len({m["run_id"] for m in records}) == 1
    gpu = [c for c in [*cli_next, *run_block] if "launch_local.sh" in c and "DEVICE=cpu" not in c]
    assert gpu and all("--job.output_dir outputs-gpu" in c for c in gpu) and not (project / "outputs-gpu").exists()
    # The generated README's generate.py line ran on this synthetic-data run (no tokenizer) and printed token ids.
    generate_line = next(c for c in run_block if "scripts/generate.py" in c)
    assert "--prompt-ids" in generate_line
    assert re.fullmatch(r"\d+(,\d+){9,}", printed[generate_line].strip().splitlines()[-1]), printed[generate_line]


@pytest.fixture(scope="module")
def wandb_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("wandb")
    return generate(tmp_path_factory.mktemp("wandb") / "run", "--gpus", "2", "--fp32", "--wandb")


def launch_without_credentials(project: Path, home: Path, output_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """scripts/launch_local.sh on 2 CPU ranks, 2 steps, with a HOME of its own (no ~/.netrc) and no W&B key."""
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in torchrun_env().items() if not k.startswith("WANDB_") and k != "NETRC"}
    base |= {"HOME": str(home), "NPROC": "2", "DEVICE": "cpu", "PATH": f"{Path(sys.executable).parent}:{base['PATH']}"}
    return subprocess.run(
        ["scripts/launch_local.sh", *TINY, "--training.steps", "2", "--job.output_dir", str(output_dir)],
        cwd=project, env=base | env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_wandb_mode_offline_from_the_environment_alone(wandb_project: Path, tmp_path: Path) -> None:
    assert 'mode = ""' in (wandb_project / "config.toml").read_text()
    out = tmp_path / "out"
    result = launch_without_credentials(wandb_project, tmp_path / "home", out, WANDB_MODE="offline")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [m["step"] for m in metrics(out)] == [1, 2]
    # The offline run's files, under output_dir/wandb, named by the run id.
    run_id = metrics(out)[0]["run_id"]
    assert glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb")), os.listdir(out)


def test_wandb_online_without_credentials_is_refused_by_preflight(wandb_project: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = launch_without_credentials(wandb_project, tmp_path / "home", out)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "preflight.py: error: W&B logs online (job.wandb = true, wandb.mode / WANDB_MODE) but this machine has no "
        "W&B credentials (no WANDB_API_KEY, no api.wandb.ai entry in ~/.netrc); run `wandb login`, set "
        "WANDB_API_KEY, or run with --wandb.mode offline"
    ]
    assert not out.exists()
    # The same with credentials in the fake HOME's ~/.netrc (as `wandb login` writes them): preflight lets it pass
    # (the run then needs the network, so it is not started here: --wandb.mode offline only skips this check).
    home = tmp_path / "home"
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (home / ".netrc").chmod(0o600)
    check = subprocess.run(
        [sys.executable, "-c", "from preflight import check_environment; from config import parse_args; "
         "check_environment(parse_args(['--job.device', 'cpu'])); print('ok')"],
        cwd=wandb_project, env={**torchrun_env(), "HOME": str(home), "WANDB_API_KEY": "", "WANDB_MODE": ""},
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.stdout == "ok\n", check.stderr
