"""Family custom: the user's own model in model.py, sharded by the class names in parallel.shard_modules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import generate, metrics, torchrun, torchrun_env
from tests.helpers.scripts import captured_in_this_process

TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.vocab_size", "128",
        "--model.max_seq_len", "64", "--training.seq_len", "32", "--training.global_batch_size", "8",
        "--training.warmup_steps", "2", "--training.lr", "1e-2", "--job.log_every", "1", "--job.device", "cpu",
        "--data.synthetic_samples", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("custom") / "run", "--family", "custom", "--gpus", "2", "--fp32")


def test_custom_project_is_lint_clean_and_marks_the_user_model(project: Path) -> None:
    for args in (["check"], ["format", "--check"]):
        lint = subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=project,
                              capture_output=True, text=True)  # fmt: skip
        assert lint.returncode == 0, lint.stdout
    model = (project / "model.py").read_text()
    assert "# ---- Your model: edit from here" in model and "# ---- Your model: end" in model
    assert "def init_weights(self, seed: int)" in model
    assert 'shard_modules = ["Block"]' in (project / "config.toml").read_text()
    assert "transformers" not in (project / "pyproject.toml").read_text()


def test_a_user_edited_model_trains_on_two_ranks(project: Path, tmp_path: Path) -> None:
    edited = tmp_path / "edited"
    subprocess.run(["cp", "-r", str(project), str(edited)], check=True)
    # The user's own block: another name, SiLU instead of GELU, and a gate of its own.
    model = (edited / "model.py").read_text()
    for old, new in (
        ("class Block(", "class GatedBlock("),
        ("Block(args) for _", "GatedBlock(args) for _"),
        ("self.mlp_norm = nn.LayerNorm(args.dim)\n",
         "self.mlp_norm = nn.LayerNorm(args.dim)\n        self.gate = nn.Linear(args.dim, args.dim)\n"),
        ("return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))",
         "return x + torch.sigmoid(self.gate(x)) * self.mlp_out(F.silu(self.mlp_in(self.mlp_norm(x))))"),
    ):  # fmt: skip
        assert old in model, old
        model = model.replace(old, new)
    (edited / "model.py").write_text(model)
    config = (edited / "config.toml").read_text().replace('shard_modules = ["Block"]', 'shard_modules = ["GatedBlock"]')
    (edited / "config.toml").write_text(config)

    result = torchrun(edited, "train.py", *TINY, "--training.steps", "6", "--job.output_dir", str(tmp_path / "out"))
    losses = [record["loss"] for record in metrics(tmp_path / "out")]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    # dim 64, 2 blocks with the gate, tied output: every parameter is counted once.
    blocks = 2 * (
        2 * 2 * 64 + 3 * 64 * 64 + 3 * 64 + 64 * 64 + 64 + 4 * 64 * 64 + 4 * 64 + 4 * 64 * 64 + 64 + 64 * 64 + 64
    )
    assert f"model: {128 * 64 + 64 * 64 + blocks + 2 * 64:,} parameters" in result.stdout

    # A class name that matches no module stops before training, naming the classes there are. (`python train.py`,
    # one process: run in this process, captured_in_this_process.)
    wrong = captured_in_this_process(edited, "train.py", *TINY, "--parallel.shard_modules", "GatedBlok",
                                         "--job.output_dir", str(tmp_path / "wrong"))  # fmt: skip
    assert wrong[0] == 2
    assert wrong[2] == (
        "train.py: error: parallel.shard_modules: no module of class GatedBlok in the model; list the class(es) of "
        "its repeated blocks (classes in the model: Embedding, GatedBlock, LayerNorm, Linear, Model)\n"
    )
    assert not (tmp_path / "wrong" / "metrics.jsonl").exists()


def test_generated_custom_projects_own_training_tests_pass(project: Path) -> None:
    # 2 ranks equal 1 process (and chunked loss the whole), meta init equals eager init. The loss falling on a
    # repeated batch is test_a_user_edited_model_trains_on_two_ranks above (8 samples, the global batch, every step),
    # on the user's edited block; the metrics' fields that its own test checks too are metrics.py's, the same in every
    # family (the `full` project's own loss_decreases, test_training_runs.py). test_unknown_config_key_is_rejected is
    # the same test of config.py's parser, whose code is the llama projects' (only the block class's default
    # differs): the fp32 project's own suite runs it (test_training_runs.py).
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_training.py",
                             "-k", "not loss_decreases and not unknown_config_key"], cwd=project, env=torchrun_env(),
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert re.search(r"^3 passed, 2 deselected in ", result.stdout, flags=re.M), result.stdout[-2000:]


# The user's block computes its linear layers with einsum (aten.bmm), where op-level AC looks for aten.mm/addmm.
EINSUM_LINEARS = (
    ("class Block(nn.Module):",
     'def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:\n    return torch.einsum("bsi,oi->bso", x, '
     "layer.weight) + layer.bias\n\n\nclass Block(nn.Module):"),
    ("self.qkv(self.attention_norm(x))", "linear(self.qkv, self.attention_norm(x))"),
    ("self.attention_out(out.transpose(1, 2)", "linear(self.attention_out, out.transpose(1, 2)"),
    ("self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))", "linear(self.mlp_out, F.gelu(linear(self.mlp_in, "
     "self.mlp_norm(x))))"),
)  # fmt: skip
UNCLASSIFIED = (
    "parallel.activation_checkpointing = 'selective' keeps the outputs of linear layers (aten.mm/addmm), "
    "but block Block has none (its matrix products run as aten.bmm): it would recompute nearly all of the block; use "
    "--parallel.activation_checkpointing layer or full, or make the block's linear layers nn.Linear"
)


def test_op_level_ac_on_a_block_without_linear_layers_stops_with_one_line(tmp_path: Path) -> None:
    project = generate(tmp_path / "sac", "--family", "custom", "--gpus", "2", "--fp32", "--activation-checkpointing",
                       "selective")  # fmt: skip
    # The generated block passes the check (its linear layers are aten.addmm): preflight accepts it. (`python
    # preflight.py` involves nothing distributed: run in this process, captured_in_this_process.)
    env = {**torchrun_env(), "NPROC": "2", "DEVICE": "cpu"}
    preflight = ["preflight.py", "--world-size", "2", *TINY]
    accepted = captured_in_this_process(project, *preflight, "--job.output_dir", str(tmp_path / "ok"))
    assert (accepted[0], accepted[2]) == (0, ""), accepted[2]
    model = (project / "model.py").read_text()
    for old, new in EINSUM_LINEARS:
        assert old in model, old
        model = model.replace(old, new)
    (project / "model.py").write_text(model)

    # The launch script: one line from preflight.py, before torchrun starts; nothing written.
    out = tmp_path / "out"
    result = subprocess.run(["scripts/launch_local.sh", *TINY, "--job.output_dir", str(out)], cwd=project, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"preflight.py: error: {UNCLASSIFIED}\n")
    assert not out.exists()
    # (Started without the launcher, train.py runs the same preflight.preflight() on rank 0, which says it once
    # before building the model: test_bad_input_runtime.py's test_torchrun_without_the_launcher_prints_the_error_once
    # [data-missing] shows it for check_data, the check preflight() runs after this one.)
    # The fixes the line names: block-level modes need no op to classify.
    for mode in ("layer", "full"):
        args = ["--parallel.activation_checkpointing", mode, "--job.output_dir", str(tmp_path / mode)]
        fixed = captured_in_this_process(project, *preflight, *args)
        assert (fixed[0], fixed[2]) == (0, ""), (mode, fixed[2])
