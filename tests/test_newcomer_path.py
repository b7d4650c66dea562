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
- A printed command that changes nothing (the pip dry run, pytest's collection) printed twice for the same folder
  runs once: the second time would print the same. `python scripts/generate.py` and `scripts/export.py` (one
  process on a checkpoint, nothing distributed) run in the test's own process, not a process of their own.
- The launches get a tiny model appended (--model.*), the same for every launch so that they resume each other:
  the default model in bf16 is ~10x slower on CPUs without bf16 instructions. The batch size, sequence length
  and steps stay those printed: they are what decides whether a printed command fits the run before it.
train.py's output prints no command to run next (it names scripts/prepare_data.py, whose input is the user's).

The README's second command is the Hugging Face path: a project for a hub checkpoint, then the generated README's
Run section (a CPU run, export, lm-eval). Two things differ from the printed commands, and why: the hub id becomes a
tiny Llama saved here (no network), and the lm-eval task name (whose dataset is downloaded) a local multiple-choice
task of five items, made here as a JSONL file and a YAML task definition.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, generate, metrics, project_modules, save_tiny_llama, torchrun_env
from tests.helpers.scripts import captured_in_this_process

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
        self.tiny = TINY_MODEL  # appended to the launches (a Hugging Face model is tiny already: none)
        # What a command that changes nothing printed, by folder and command: printed again, the same command in the
        # same folder prints the same (pip's --dry-run resolution, pytest's --collect-only).
        self.unchanging: dict[tuple[Path, str], str] = {}

    def run(self, command: str) -> str:
        words = shlex.split(command)
        self.ran.append(command)
        if words[0] == "cd":
            self.cwd = self.cwd / words[1]
            assert self.cwd.is_dir(), command
            return ""
        if (self.cwd, command) in self.unchanging:
            return self.unchanging[self.cwd, command]
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
            words = [*words, *self.tiny]
        env_words = [word for word in words if re.fullmatch(r"[A-Z_]+=\S*", word)]
        words = words[len(env_words) :]
        if words[:2] in (["python", "scripts/generate.py"], ["python", "scripts/export.py"]) and not env_words:
            # One process on a checkpoint, nothing distributed: run in this process, not a process of its own that
            # imports torch (and, on the hub path, transformers, which this test imports anyway) again.
            code, stdout, stderr = captured_in_this_process(self.cwd, *words[1:])
            assert code == 0, f"{command} (in {self.cwd}) exited {code}:\n{stdout[-3000:]}{stderr[-3000:]}"
            return stdout
        env = {**self.env, **dict(word.split("=", 1) for word in env_words)}
        result = subprocess.run(words, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"{command} (in {self.cwd}) exited {result.returncode}:\n" + (
            result.stdout[-3000:] + result.stderr[-3000:]
        )
        if "--dry-run" in words or "--collect-only" in words:
            self.unchanging[self.cwd, command] = result.stdout
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


# The Hugging Face path (the README's second block): a tiny Llama saved here stands in for the hub id (no network),
# and a multiple-choice task of a few items in a local JSONL (YAML task made here) for the lm-eval task by name.
HUB_TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "red green blue yellow, cat dog bird fish. " * 20
ITEMS = [
    {"question": "The quick brown fox", "choices": ["jumps", "cat", "blue"], "answer": 0},
    {"question": "over the lazy", "choices": ["dog", "fish", "red"], "answer": 1},
    {"question": "red green", "choices": ["blue", "dog", "the quick"], "answer": 0},
    {"question": "cat dog", "choices": ["bird", "quick", "lazy fox"], "answer": 2},
    {"question": "yellow", "choices": [", cat", "brown", "over"], "answer": 0},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def log_likelihoods_by_hand(folder: Path) -> list[list[float]]:
    """Each item's log-likelihood of each choice (" " + choice after the question), with transformers, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = []
    for item in ITEMS:
        context = tokenizer(item["question"], add_special_tokens=False).input_ids
        row = []
        for choice in item["choices"]:
            whole = tokenizer(item["question"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
            row.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context), len(whole))))
        scores.append(row)
    return scores


def test_the_hub_path_trains_exports_and_evaluates_in_order(tmp_path: Path) -> None:
    """The README's Hugging Face command, then the generated README's Run section: a CPU run, export, lm-eval on the
    newest checkpoint (one evaluate.py process: importing lm_eval costs ~5 CPU-seconds), whose per-item
    log-likelihoods are transformers' by hand on the exported folder (1e-5) and whose accuracy is in its results."""
    hub = save_tiny_llama(tmp_path / "hub-model", HUB_TEXT, max_position_embeddings=128)  # the printed seq_len
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tasks / "tiny_mc.yaml").write_text(TASK.format(items=tasks / "items.jsonl"))
    command = next(block[0] for block in bash_blocks((REPO / "README.md").read_text()) if "--hf-model" in block[0])
    assert "--family hf --hf-model " in command
    shell = Shell(tmp_path)
    shell.env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    shell.tiny = []
    for step in command.split(" && "):
        shell.run(re.sub(r"--hf-model \S+", f"--hf-model {hub}", step))
    project = shell.cwd
    run_block = bash_blocks((project / "README.md").read_text().split("\n## Run\n", 1)[1])[0]
    printed = {}
    for line in run_block:
        printed[line] = shell.run(re.sub(r"--tasks \S+", f"--tasks {tasks / 'tiny_mc.yaml'}", line))
    records = metrics(project / "outputs")
    # The printed warm-up (2 steps, not config.toml's 100) lets 20 CPU steps train: the learning rate peaks at step
    # 3, and the loss falls by 0.1 (measured; 100 warm-up steps would keep the rate below a fifth of its peak).
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[2]["lr"] == max(r["lr"] for r in records) and records[-1]["loss"] < records[0]["loss"] - 0.05
    evaluate = next(line for line in run_block if "scripts/evaluate.py" in line)
    (folder,) = (project / "outputs" / "evaluations").iterdir()
    samples = sorted((json.loads(x) for x in (folder / "samples_tiny_mc.jsonl").read_text().splitlines()),
                     key=lambda sample: sample["doc_id"])  # fmt: skip
    lm_eval = [[choice[0] for choice in sample["filtered_resps"]] for sample in samples]
    reference = log_likelihoods_by_hand(project / "exported")
    assert len(lm_eval) == len(ITEMS)
    for ours, theirs in zip(lm_eval, reference, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5, rel=0)
    # The trained model, not the hub's: training moved the log-likelihoods.
    untrained = [value for row in log_likelihoods_by_hand(hub) for value in row]
    assert max(abs(a - b) for a, b in zip(untrained, sum(reference, []), strict=True)) > 1e-3
    accuracy = sum(row.index(max(row)) == item["answer"] for row, item in zip(reference, ITEMS, strict=True)) / 5
    results = json.loads((folder / "results.json").read_text())
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(accuracy)
    # Logged with the run: evaluations.jsonl names the run and the checkpoint's step; lm-eval's progress bar ran.
    (row,) = [json.loads(x) for x in (project / "outputs" / "evaluations.jsonl").read_text().splitlines()]
    assert (row["run_id"], row["step"], row["metrics"]["acc"]) == (records[0]["run_id"], 20, pytest.approx(accuracy))
    assert f"results in {folder}" in printed[evaluate]
    assert sorted(p.name for p in folder.iterdir()) == ["results.json", "samples_tiny_mc.jsonl"]


@pytest.fixture(scope="module")
def wandb_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("wandb")
    return generate(tmp_path_factory.mktemp("wandb") / "run", "--gpus", "2", "--fp32", "--wandb")


def launch_without_credentials(project: Path, home: Path, output_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """scripts/launch_local.sh on 1 CPU rank, 2 steps, with a HOME of its own (no ~/.netrc) and no W&B key. (W&B's
    mode and credentials do not depend on the number of ranks: a second rank would only cost its imports.)"""
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in torchrun_env().items() if not k.startswith("WANDB_") and k != "NETRC"}
    base |= {"HOME": str(home), "NPROC": "1", "DEVICE": "cpu", "PATH": f"{Path(sys.executable).parent}:{base['PATH']}"}
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


def test_wandb_online_without_credentials_is_refused_by_preflight(
    wandb_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    # (In this process, no process of its own: preflight's checks of this machine involve nothing distributed.)
    with monkeypatch.context() as patch, project_modules(wandb_project), contextlib.chdir(wandb_project):
        patch.setenv("HOME", str(home))
        patch.setenv("WANDB_API_KEY", "")
        patch.setenv("WANDB_MODE", "")
        patch.delenv("NETRC", raising=False)
        from config import parse_args
        from preflight import check_environment

        check_environment(parse_args(["--job.device", "cpu"]))  # raises PreflightError if it refuses
