"""Family llama: model.size presets and model.tie_embeddings (one matrix for the embedding and the output layer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, generate, metrics, project_modules, torchrun, torchrun_env
from tests.helpers.scripts import run_in_this_process


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("llama") / "run", "--gpus", "2", "--fp32")


def test_size_presets_have_the_parameter_counts_config_toml_states(project: Path) -> None:
    # Built on the meta device: nothing is allocated, so even 8b is counted in a moment (in this process).
    import torch

    with project_modules(project):
        from model import SIZES, ModelArgs, Transformer

        counts = {}
        for size in SIZES:
            for tied in (False, True):
                with torch.device("meta"):
                    model = Transformer(ModelArgs(size=size, tie_embeddings=tied))
                counts[f"{size} {tied}"] = sum(p.numel() for p in model.parameters())
    assert counts["1b True"] == 1_235_814_400  # Llama 3.2 1B, as published (tied)
    assert counts["8b False"] == 8_030_261_248  # Llama 3.1 8B, as published
    comment = re.search(r'^size = "debug" +# (.*)$', (project / "config.toml").read_text(), flags=re.M)[1]
    assert comment == "debug (3.2M parameters, runs anywhere), 125m (125M), 1b (1.50B), 8b (8.03B)"
    assert [round(counts[f"{size} False"], -5) for size in ("debug", "125m", "1b", "8b")] == [
        3_200_000, 124_700_000, 1_498_500_000, 8_030_300_000]  # fmt: skip


def test_tied_embeddings_train_on_two_ranks_and_export(project: Path, tmp_path: Path) -> None:
    tied = [*TINY, "--model.tie_embeddings", "true", "--job.device", "cpu"]
    # Meta init of the tied model on 2 ranks equals the eager one (both names of the tied matrix included).
    init = torchrun(project, "tests/check_init.py", *tied)
    assert init.stdout.count("tensors equal") == 2 and "MISMATCH" not in init.stdout

    steps = ["--training.steps", "5", "--data.synthetic_samples", "8", "--job.output_dir", str(tmp_path)]
    run = torchrun(project, "train.py", *tied, *steps)
    # dim 64, vocab 128: the tied model has one 128 x 64 matrix fewer than the untied one.
    untied = 128 * 64 * 2 + 2 * (2 * 64 + 64 * 64 * 2 + 2 * 32 * 64 + 3 * 64 * 172) + 64
    assert f"model: {untied - 128 * 64:,} parameters" in run.stdout
    losses = [record["loss"] for record in metrics(tmp_path)]
    assert losses[-1] < 0.8 * losses[0], losses

    # Export and load: nothing distributed, so in this process (run_in_this_process, project_modules), no process
    # of their own.
    exported = tmp_path / "exported"
    run_in_this_process(
        project, "scripts/export.py", str(tmp_path / "checkpoints" / "step-5"), "--output", str(exported)
    )
    from safetensors.torch import load_file

    with project_modules(project):
        from model import ModelArgs, Transformer

        model = Transformer(ModelArgs(**json.loads((exported / "config.json").read_text())))
        model.load_state_dict(load_file(exported / "model.safetensors"))
        assert model.output.weight is model.tok_embeddings.weight


def test_tied_embeddings_in_a_full_checkpoint_on_one_rank(checkpoint_projects: dict[str, Path], tmp_path: Path) -> None:
    # On one rank the gathered state holds the tied matrix once under both names; safetensors refuses shared
    # memory, so checkpoint.py (unshared) writes a copy for the second name, and the resume loads both into one
    # parameter.
    project = checkpoint_projects["full"]
    tied = [*TINY, "--model.tie_embeddings", "true", "--job.device", "cpu", "--job.output_dir", str(tmp_path)]
    for steps in ("2", "3"):
        run = subprocess.run([sys.executable, "train.py", *tied, "--training.steps", steps, "--checkpoint.interval",
                              "1"], cwd=project, env=torchrun_env(), capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints'}/step-2 at step 2" in run.stdout
    assert [record["step"] for record in metrics(tmp_path)] == [1, 2, 3]
