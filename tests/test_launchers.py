"""The generated launchers, for real: two torchrun "nodes" on 127.0.0.1, Ray Train workers, and sbatch on a local
SLURM cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, generate, metrics, torchrun_env
from tests.helpers.in_process import script_in_this_process
from tests.helpers.slurm_cluster import ENABLE, free_port, local_slurm_cluster, unavailable, wait_for_job


def start_two_nodes(
    project: Path, output_dirs: tuple[Path, Path], nproc: int, *args: str, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start scripts/launch_multinode.sh as node 0 and node 1 on 127.0.0.1 (node i writing to output_dirs[i])."""
    port = str(free_port())
    return [
        subprocess.Popen(
            ["scripts/launch_multinode.sh", *TINY, *args, "--job.output_dir", str(output_dirs[rank])],
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **torchrun_env(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "NODE_RANK": str(rank),
                "NPROC": str(nproc),
                "DEVICE": "cpu",
                "RDZV_ID": f"test-{port}",
                **(env or {}),
            },
        )
        for rank in (0, 1)
    ]


def launch_two_nodes(project: Path, output_dirs: tuple[Path, Path], nproc: int, *args: str) -> list[tuple[int, str]]:
    """Run scripts/launch_multinode.sh as node 0 and node 1 on 127.0.0.1; return each node's exit code and output."""
    nodes = start_two_nodes(project, output_dirs, nproc, *args)
    return [(node.wait(timeout=600), node.communicate()[0]) for node in nodes]


def train_in_this_process(project: Path, *args: str) -> None:
    """`python train.py ARGS` (one process, no torchrun) run in the test's own process: the one-process reference,
    which needs no launch of its own (torch is imported here already)."""
    script_in_this_process(project, "train.py", *args)
    assert (Path(args[args.index("--job.output_dir") + 1]) / "metrics.jsonl").is_file()


@pytest.fixture(scope="module")
def two_node_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("two-nodes") / "run", "--nodes", "2", "--gpus", "2", "--fp32")


# 8 steps, a checkpoint every 2: the crash below lands after a checkpoint, far enough from the end.
TWO_NODE_RUN = ["--training.steps", "8", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def uninterrupted(two_node_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of an uninterrupted run on 2 "nodes" x 2 ranks."""
    out = tmp_path_factory.mktemp("uninterrupted") / "two"
    nodes = launch_two_nodes(two_node_project, (out, out), 2, *TWO_NODE_RUN)
    assert [code for code, _ in nodes] == [0, 0], nodes
    return out


def test_two_node_hsdp_launch_on_localhost_equals_one_process(
    two_node_project: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    # 2 "nodes" x 2 ranks, as 2 small GPU nodes would run; a 2-node project defaults to HSDP: sharded within a
    # node, replicated across nodes. (8 ranks on one node: tests/test_context_parallel.py, test_expert_parallel.py.)
    project = two_node_project
    assert "dp_replicate = 2\n" in (project / "config.toml").read_text()
    # The one-process reference runs in this test's own process (no launch of its own: nothing distributed in it).
    train_in_this_process(
        project, *TINY, *TWO_NODE_RUN, "--job.device", "cpu", "--job.output_dir", str(tmp_path / "one")
    )
    info = json.loads((uninterrupted / "checkpoints" / "step-8" / "checkpoint.json").read_text())
    assert info["world_size"] == 4 and info["config"]["parallel"]["dp_replicate"] == 2
    for a, b in zip(metrics(tmp_path / "one"), metrics(uninterrupted), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)


def ranks_under(launcher: int) -> dict[int, int]:
    """The ranks (train.py processes) started under the launch script `launcher`: {LOCAL_RANK: pid}."""
    parents, ranks = {}, {}
    for proc in Path("/proc").iterdir():
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"train.py" in (proc / "cmdline").read_bytes():
                environ = dict(
                    line.split(b"=", 1) for line in (proc / "environ").read_bytes().split(b"\0") if b"=" in line
                )
                if b"LOCAL_RANK" in environ:
                    ranks[int(proc.name)] = int(environ[b"LOCAL_RANK"])
        except (OSError, ValueError):
            continue
    found = {}
    for pid, local_rank in ranks.items():
        ancestor = pid
        while ancestor in parents and ancestor not in (launcher, 0, 1):
            ancestor = parents[ancestor]
        if ancestor == launcher:
            found[local_rank] = pid
    return found


def final_state(output_dir: Path, target: Path) -> dict:
    """The final checkpoint's (step-8) tensors, model and optimizer, by name; read through DCP's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(output_dir / "checkpoints" / "step-8", target)
    flat = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(target, weights_only=False))
    return flat


def steps_logged(output_dir: Path) -> int:
    try:
        return len((output_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_a_rank_killed_on_node_1_restarts_both_nodes_and_the_run_ends_as_the_uninterrupted_one(
    two_node_project: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    # The launch script's restart loop across nodes (issue 40): a rank of node 1 is killed (SIGKILL) after the
    # checkpoint of step 2; its torchrun fails, node 0's ranks lose their peer and fail too, and each node's
    # launch script starts its torchrun again. They meet at the same rendezvous, resume from the newest complete
    # checkpoint, and end with the weights and losses of the uninterrupted run, bit for bit.
    out = tmp_path / "two"
    nodes = start_two_nodes(two_node_project, (out, out), 2, *TWO_NODE_RUN, env={"MAX_RESTARTS": "1"})
    deadline = time.monotonic() + 300
    while not ((out / "checkpoints" / "step-2" / "checkpoint.json").exists() and steps_logged(out) >= 3):
        assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "3 steps: not reached"
        time.sleep(0.02)
    os.kill(ranks_under(nodes[1].pid)[1], signal.SIGKILL)
    logged = steps_logged(out)
    outputs = [(node.wait(timeout=600), node.communicate()[0]) for node in nodes]
    assert [code for code, _ in outputs] == [0, 0], [output[-3000:] for _, output in outputs]
    for _, output in outputs:
        assert "training failed (exit code 1); restart 1 of 1, from the newest checkpoint" in output, output[-3000:]
    resumed = int(re.search(r"resumed from \S+/step-(\d+) at step", "".join(o for _, o in outputs)).group(1))
    # One row per step; the rows the crashed attempt logged past its checkpoint kept aside, in order. (The count
    # above is a lower bound: a row, even a checkpoint, may have come between the kill and the count.)
    expected, rows = metrics(uninterrupted), metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    aside = metrics(out, "metrics.rewound.jsonl") if (out / "metrics.rewound.jsonl").exists() else []
    assert [r["step"] for r in aside] == list(range(resumed + 1, resumed + 1 + len(aside)))
    assert 2 <= resumed and logged <= resumed + len(aside) < 8, (resumed, logged, len(aside))
    # The same numbers as the uninterrupted run: the crashed attempt's rows and the resumed run's, bit for bit.
    numbers = [(r["step"], r["loss"], r["grad_norm"]) for r in expected]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows] == numbers
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in aside] == numbers[resumed : resumed + len(aside)]
    weights = final_state(out, tmp_path / "resumed.pt")
    reference = final_state(uninterrupted, tmp_path / "uninterrupted.pt")
    assert weights.keys() == reference.keys() and any("/model/" in name for name in weights)
    assert all(weights[name].equal(reference[name]) for name in reference), [
        name for name in reference if not weights[name].equal(reference[name])
    ]


def test_a_node_local_output_dir_stops_the_run(two_node_project: Path, tmp_path: Path) -> None:
    # Node 1 writes to a folder node 0 does not see (as a node-local disk would): the run stops before training.
    # One rank per node: the check counts the ranks that do not see rank 0's file, wherever they are.
    node0, node1 = tmp_path / "node0-outputs", tmp_path / "node1-outputs"
    nodes = launch_two_nodes(two_node_project, (node0, node1), 1, "--training.steps", "2")
    assert all(code != 0 for code, _ in nodes), nodes
    # The c10d rendezvous numbers the nodes in the order they join, so rank 0 may be on either launcher: the one
    # line comes from the node of rank 0 and names its folder.
    lines = [line for _, output in nodes for line in re.findall(r"^train\.py: error: .*$", output, flags=re.M)]
    messages = [
        f"train.py: error: job.output_dir {folder} is not shared by all nodes: 1 rank(s) do not see the file rank 0 "
        "wrote there; put it on a filesystem every node mounts (NFS, Lustre, ...)"
        for folder in (node0, node1)
    ]
    assert len(lines) == 1 and lines[0] in messages, [output[-3000:] for _, output in nodes]
    assert not (node0 / "metrics.jsonl").exists() and not (node1 / "metrics.jsonl").exists()


def test_bare_torchrun_restarts_across_nodes_into_a_shared_store_are_refused(
    two_node_project: Path, tmp_path: Path
) -> None:
    # `torchrun --nnodes 2 --max-restarts 1` by hand: torch keeps one rendezvous store for every attempt, and each
    # node counts only its own restarts, so the first restart would reconnect to the dead attempt's addresses and
    # fail (tests/test_hf_parallel.py's 3-D kill restarts in place with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    # train.py refuses it in one line before the rendezvous; nothing is written.
    port = str(free_port())
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", "--node-rank"]  # fmt: skip
    run = [*TINY, "--job.device", "cpu", "--training.steps", "2", "--job.output_dir", str(tmp_path / "out")]
    nodes = [
        subprocess.Popen(
            [*node, str(rank), "train.py", *run],
            cwd=two_node_project,
            env=torchrun_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    results = [(process.wait(timeout=600), process.communicate()[0]) for process in nodes]
    assert all(code != 0 for code, _ in results), results
    lines = [line for _, output in results for line in re.findall(r"^train\.py: error: .*$", output, flags=re.M)]
    assert lines == [
        "train.py: error: torchrun --max-restarts 1 over 2 nodes would restart the ranks into the dead attempt's "
        "rendezvous store (each node counts its own restarts); give every node's torchrun "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per attempt), or use the launch scripts"
    ], [output[-3000:] for _, output in results]
    assert not (tmp_path / "out").exists()


def test_ray_workers_run_the_same_training_as_one_process(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--launcher", "ray", "--gpus", "2", "--fp32")
    steps = [*TINY, "--training.steps", "3"]
    # The one-process reference runs in this test's own process (no launch of its own: nothing distributed in it).
    train_in_this_process(project, *steps, "--job.device", "cpu", "--job.output_dir", str(tmp_path / "one"))
    # A local Ray with 2 CPU workers; RAY_ADDRESS unset, so ray_train.py starts (and stops) its own. Without the
    # idle workers Ray prestarts for the first driver: ray_train.py's runtime_env (its env_vars) keeps Ray from
    # handing its actors to them, so they only import Ray, on the cores the cluster starts on, and are stopped.
    env = {key: value for key, value in torchrun_env().items() if key != "RAY_ADDRESS"}
    env["RAY_prestart_worker_first_driver"] = "0"
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
    if reason := unavailable():
        # CI (.ci/run) installs the daemons and sets FSDP2GEN_REQUIRE_SLURM=1: there a missing SLURM is a failure.
        if os.environ.get("FSDP2GEN_REQUIRE_SLURM") == "1":
            pytest.fail(f"FSDP2GEN_REQUIRE_SLURM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    with local_slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def sbatch(project: Path, env: dict[str, str], *overrides: str) -> tuple[int, str]:
    """Submit scripts/slurm.sbatch and wait for the job to end: its exit code and job id."""
    # The test cluster has 2 CPUs and no GPUs: command-line options override the script's #SBATCH lines.
    options = ["--parsable", "--gpus-per-node=0", "--cpus-per-task=2",
               "--export=ALL,DEVICE=cpu,NPROC=2,OMP_NUM_THREADS=1"]  # fmt: skip
    command = ["sbatch", *options, "scripts/slurm.sbatch", *TINY, *overrides]
    submitted = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    return wait_for_job(job_id, env), job_id


def test_sbatch_trains_a_requeued_job_continues_itself_and_a_resubmission_resumes(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    # One job, requeued mid-run, then a resubmission: the job trains, and both ways back into a run land in it.
    # checkpoint.resume = "never": a new run. SLURM requeues the job mid-run (as after a preemption): the requeued
    # job keeps its id, which is the launch id run.json records, so it continues its own run from the newest
    # checkpoint instead of being refused as a new run in a folder that holds one (issue 40). Its rows past that
    # checkpoint are kept aside: metrics.jsonl has one row per step.
    project = generate(tmp_path / "run", "--launcher", "slurm", "--gpus", "2", "--fp32")
    options = ["--parsable", "--gpus-per-node=0", "--cpus-per-task=2",
               "--export=ALL,DEVICE=cpu,NPROC=2,OMP_NUM_THREADS=1"]  # fmt: skip
    interval = ["--checkpoint.interval", "10"]
    run = ["--training.steps", "80", *interval, "--checkpoint.resume", "never"]
    submitted = subprocess.run(["sbatch", *options, "scripts/slurm.sbatch", *TINY, *run], cwd=project, env=slurm,
                               capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    out = project / "outputs" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (out.exists() and len(out.read_text().splitlines()) >= 25):
        assert time.monotonic() < deadline, "25 steps: not within 300 s"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], env=slurm, check=True, capture_output=True, timeout=60)
    # SLURM holds a requeued job back for a while (its begin time): let it start again as soon as it can.
    while "BeginTime" not in subprocess.run(["squeue", "-h", "-o", "%r", "-j", job_id], env=slurm,
                                            capture_output=True, text=True).stdout:  # fmt: skip
        assert time.monotonic() < deadline + 60, "the job was not requeued within 60 s"
        time.sleep(0.25)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm, check=True, timeout=60)
    code = wait_for_job(job_id, slurm, timeout=300)  # TimeoutError: the requeued job did not end within 300 s
    log = (project / "logs" / f"run-{job_id}.out").read_text()
    errors = (project / "logs" / f"run-{job_id}.err").read_text()
    assert code == 0, (log[-2000:], errors[-2000:])
    assert re.search(r"resumed from outputs/checkpoints/step-\d+ at step", log), (log[-2000:], errors[-2000:])
    records = metrics(project / "outputs")
    assert [r["step"] for r in records] == list(range(1, 81)), errors[-2000:]
    assert {r["run_id"] for r in records} == {json.loads((project / "outputs" / "run.json").read_text())["run_id"]}
    # SLURM's own lines about the requeue only: no refusal, no restart of a usage error.
    assert not re.search(r"^\S+\.(py|sh|sbatch): error:", errors, flags=re.M), errors[-2000:]
    assert re.search(r"^step +80/80 \| loss", log, flags=re.M), log[-2000:]
    # The rendezvous port comes from the job id (two jobs on one head node do not collide), and the CPUs given to
    # sbatch reach torchrun's task.
    port = 20000 + int(job_id) % 20000
    assert f"job {job_id}: 1 node(s) x 2 rank(s), rendezvous localhost:{port}, 2 CPUs per node" in log, log[-2000:]
    # A resubmitted job (a job id of its own, checkpoint.resume auto) continues the run from the newest checkpoint.
    code, job_id = sbatch(project, slurm, "--training.steps", "82", *interval)
    assert code == 0, (project / "logs" / f"run-{job_id}.err").read_text()[-3000:]
    assert [m["step"] for m in metrics(project / "outputs")] == list(range(1, 83))
    log = (project / "logs" / f"run-{job_id}.out").read_text()
    assert "resumed from outputs/checkpoints/step-80 at step 80" in log, log[-2000:]


@pytest.mark.parametrize("required", [False, True])
def test_without_slurm_the_sbatch_test_skips_saying_how_to_enable_it_or_fails_in_ci(
    tmp_path: Path, required: bool
) -> None:
    # A machine without SLURM's daemons: an empty PATH (the tests never install anything, so nothing is found).
    env = {**torchrun_env(), "PATH": str(tmp_path), "COLUMNS": "1000"}
    env["FSDP2GEN_REQUIRE_SLURM"] = "1" if required else ""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rsf", "-k", "test_sbatch_trains",
         "tests/test_launchers.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tools = "slurmctld, slurmd, sbatch, sinfo, munged, munge, unmunge"
    reason = f"SLURM tests need {tools} (not on PATH); to run them: {ENABLE}"
    if required:
        assert result.returncode == 1 and f"FSDP2GEN_REQUIRE_SLURM=1 but {reason}" in result.stdout, result.stdout
    else:
        assert result.returncode == 0 and "1 skipped" in result.stdout, result.stdout
        assert "SKIPPED [1] tests/test_launchers.py" in result.stdout and reason in result.stdout, result.stdout
