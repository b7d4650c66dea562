"""The generated launchers, for real: two torchrun "nodes" on 127.0.0.1, Ray Train workers, and sbatch on a local
SLURM cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, generate, metrics, torchrun_env
from tests.slurm_cluster import free_port, local_slurm_cluster


def test_two_node_hsdp_launch_on_localhost_equals_one_process(tmp_path: Path) -> None:
    # 2 "nodes" x 2 ranks; a 2-node project defaults to HSDP: sharded within a node, replicated across nodes.
    project = generate(tmp_path / "run", "--nodes", "2", "--gpus", "2", "--fp32")
    assert "dp_replicate = 2\n" in (project / "config.toml").read_text()
    reference = subprocess.run(
        [sys.executable, "train.py", *TINY, "--training.steps", "4", "--job.device", "cpu",
         "--job.output_dir", str(tmp_path / "one")],
        cwd=project, env=torchrun_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            ["scripts/launch_multinode.sh", *TINY, "--training.steps", "4", "--job.output_dir", str(tmp_path / "two")],
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **torchrun_env(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "NODE_RANK": str(rank),
                "NPROC": "2",
                "DEVICE": "cpu",
                "RDZV_ID": f"test-{port}",
            },
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert '"world_size": 4' in next((tmp_path / "two" / "checkpoints").glob("step-*/checkpoint.json")).read_text()
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)


def test_ray_workers_run_the_same_training_as_one_process(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--launcher", "ray", "--gpus", "2", "--fp32")
    steps = [*TINY, "--training.steps", "3"]
    reference = subprocess.run(
        [sys.executable, "train.py", *steps, "--job.device", "cpu", "--job.output_dir", str(tmp_path / "one")],
        cwd=project, env=torchrun_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    # A local Ray with 2 CPU workers; RAY_ADDRESS unset, so ray_train.py starts (and stops) its own.
    env = {key: value for key, value in torchrun_env().items() if key != "RAY_ADDRESS"}
    ray = subprocess.run(
        [sys.executable, "ray_train.py", "--workers", "2", "--cpu", *steps, "--job.output_dir", "outputs-ray"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ray.returncode == 0, ray.stdout[-3000:] + ray.stderr[-3000:]
    records = metrics(project / "outputs-ray")
    assert [r["step"] for r in records] == [1, 2, 3]
    for a, b in zip(metrics(tmp_path / "one"), records, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)
    assert (project / "outputs-ray" / "checkpoints" / "step-3" / "checkpoint.json").is_file()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    with local_slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def sbatch(project: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    # The test cluster has 2 CPUs and no GPUs: command-line options override the script's #SBATCH lines.
    options = ["--wait", "--gpus-per-node=0", "--cpus-per-task=2", "--export=ALL,DEVICE=cpu,NPROC=2,OMP_NUM_THREADS=1"]
    command = ["sbatch", *options, "scripts/slurm.sbatch", *TINY, *overrides]
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_sbatch_trains_and_a_resubmission_resumes(slurm: dict[str, str], tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--launcher", "slurm", "--gpus", "2", "--fp32")
    first = sbatch(project, slurm, "--training.steps", "3")
    logs = {p.name: p.read_text() for p in (project / "logs").iterdir() if p.name != ".gitignore"}
    assert first.returncode == 0, (first.stdout, first.stderr, logs)
    assert [m["step"] for m in metrics(project / "outputs")] == [1, 2, 3]
    job_id = first.stdout.split()[-1]
    assert "step      3 | loss" in logs[f"run-{job_id}.out"]
    # A requeued or resubmitted job continues from the newest checkpoint.
    second = sbatch(project, slurm, "--training.steps", "5")
    assert second.returncode == 0, second.stderr
    assert [m["step"] for m in metrics(project / "outputs")] == [1, 2, 3, 4, 5]
    job_id = second.stdout.split()[-1]
    assert "resumed from outputs/checkpoints/step-3 at step 3" in (project / "logs" / f"run-{job_id}.out").read_text()
