"""This repository's CI workflow and the GPU smoke script it runs (whose CPU path is exercised here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO, generate, torchrun_env

WORKFLOW = REPO / ".github" / "workflows" / "ci.yml"


def readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), flags=re.S)
    return blocks[1].strip()


def test_ci_script_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert readme_test_command() == "pip install torch==2.13.0 -e '.[test]' && python -m pytest"
    assert readme_test_command() in ci.splitlines()


def test_workflow_has_a_cpu_job_and_a_gpu_job_running_the_smoke_script() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert {"push", "pull_request", "workflow_dispatch"} <= set(triggers)
    default_labels = triggers["workflow_dispatch"]["inputs"]["gpu_runner_labels"]["default"]
    assert yaml.safe_load(default_labels) == ["self-hosted", "linux", "gpu"]
    jobs = workflow["jobs"]
    assert set(jobs) == {"cpu", "gpu"}
    cpu_commands = [step["run"] for step in jobs["cpu"]["steps"] if "run" in step]
    assert any(command.endswith(readme_test_command()) for command in cpu_commands)
    assert jobs["gpu"]["runs-on"] == '${{ fromJSON(inputs.gpu_runner_labels || \'["self-hosted", "linux", "gpu"]\') }}'
    gpu_commands = [step["run"] for step in jobs["gpu"]["steps"] if "run" in step]
    assert "bash scripts/gpu_smoke.sh" in gpu_commands
    for job in jobs.values():
        assert job["steps"][0]["uses"].startswith("actions/checkout@")


def test_gpu_smoke_script_cpu_path_passes(tmp_path: Path) -> None:
    # One example, an hf one: the script saves a random Llama into its model.path (models/tiny-llama) first, the
    # branch a GPU run takes too; then every step a GPU runs (render from the answers, train, resume, compare,
    # host syncs per step). A llama example adds only TINY's --model.* overrides (a GPU run has none) and three
    # more torchrun launches: what it would prove of a llama project (it trains, its loss falls, a resume
    # reproduces it) test_training_runs.py and the projects' own tests prove.
    examples = ["hf-2gpu-bf16"]
    # 10 steps (the script's STEPS; 20 by default, for GPUs): a resume from step 5 reproduces steps 6-10 as one
    # from step 10 would 11-20, and the tiny model's loss falls by 12% in 8 steps already (the check asks 10%).
    # NPROC=1: the script only hands NPROC to torchrun, and each rank of its 3 launches (train, resume, syncs) costs
    # ~6 CPU-s of an hf project's imports. Sharded runs on 2+ ranks, their resumes and their host syncs per step are
    # proven by test_training_runs.py (the projects' own tests) and test_no_host_sync_in_step.py.
    env = {**torchrun_env(), "DEVICE": "cpu", "NPROC": "1", "TINY": "1", "EXAMPLES": " ".join(examples), "STEPS": "10"}
    env["PYTHON"] = sys.executable
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    # Two lines per example: the training run, then its host syncs per step (none on steps that do not report).
    assert len(lines) == 2 * len(examples), lines
    for name, line, syncs in zip(examples, lines[::2], lines[1::2], strict=True):
        match = re.fullmatch(rf"PASS {name} device=cpu nproc=1 tokens/s [\d,]+ loss ([\d.]+)->([\d.]+) peak .*", line)
        assert match, line
        assert float(match[2]) < 0.9 * float(match[1])
        assert re.fullmatch(rf"PASS {name} syncs on rank 0: .*\(CUDA sync debug mode: .*\)", syncs), syncs


def test_gpu_smoke_script_refuses_without_a_gpu() -> None:
    env = {**torchrun_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "gpu_smoke: no GPU visible; run with DEVICE=cpu NPROC=2 TINY=1\n"


def schema_check(path: Path) -> subprocess.CompletedProcess:
    # check-jsonschema ships GitHub's workflow schema, so this runs offline.
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           str(path)], capture_output=True, text=True)  # fmt: skip


def test_workflows_are_valid_github_actions(tmp_path: Path) -> None:
    assert schema_check(WORKFLOW).returncode == 0
    project = generate(tmp_path / "run", "--gpus", "2")
    generated = project / ".github" / "workflows" / "ci.yml"
    result = schema_check(generated)
    assert result.returncode == 0, result.stdout
    # The check can fail: a job without runs-on is rejected.
    broken = tmp_path / "broken.yml"
    broken.write_text(generated.read_text().replace("    runs-on: ubuntu-latest\n", ""))
    assert schema_check(broken).returncode != 0


def test_generated_workflow_runs_the_tests_on_cpu_and_gpu(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--gpus", "2")
    workflow = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text())
    jobs = workflow["jobs"]
    assert set(jobs) == {"cpu", "gpu"}
    assert jobs["gpu"]["runs-on"] == '${{ fromJSON(inputs.gpu_runner_labels || \'["self-hosted", "linux", "gpu"]\') }}'
    default = workflow[True]["workflow_dispatch"]["inputs"]["gpu_runner_labels"]["default"]
    assert yaml.safe_load(default) == ["self-hosted", "linux", "gpu"]
    cpu_runs = [step["run"] for step in jobs["cpu"]["steps"] if "run" in step]
    gpu_runs = [step["run"] for step in jobs["gpu"]["steps"] if "run" in step]
    assert "pytest -q" in cpu_runs and "python -m pytest -q" in gpu_runs
    smoke = next(run for run in gpu_runs if "scripts/launch_local.sh" in run)
    assert "--training.steps 20" in smoke and "losses[-1] < 0.9 * losses[0]" in smoke
    for run in cpu_runs + gpu_runs:
        assert subprocess.run(["bash", "-n"], input=run, text=True).returncode == 0, run
