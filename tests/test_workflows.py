"""This repository's CI workflow and the GPU smoke script it runs (whose CPU path is exercised here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO, torchrun_env

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
    env = {**torchrun_env(), "DEVICE": "cpu", "NPROC": "2", "TINY": "1", "EXAMPLES": "llama-2node-bf16"}
    env["PYTHON"] = sys.executable
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(
        r"PASS llama-2node-bf16 device=cpu nproc=2 tokens/s [\d,]+ loss ([\d.]+)->([\d.]+) peak .*", line
    )
    assert match, line
    assert float(match[2]) < 0.9 * float(match[1])


def test_gpu_smoke_script_refuses_without_a_gpu() -> None:
    env = {**torchrun_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    result = subprocess.run(["bash", "scripts/gpu_smoke.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "gpu_smoke: no GPU visible; run with DEVICE=cpu NPROC=2 TINY=1\n"
