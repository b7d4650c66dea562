"""Context parallelism (`fsdp2gen new --cp N`, llama): every sequence split over cp ranks, ring attention.

CPU ranks cannot run it as torch ships it (no ring attention for the CPU attention kernel): these runs put
tests/helpers/cp_cpu_shim on PYTHONPATH, whose sitecustomize.py gives torch's ring attention the CPU kernel. The
generated project's code path is the GPU one; the shim supplies only that kernel. Real torchrun, gloo, fp32, the
tiny model, projects rendered by the CLI.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2gen.plan_layout import layout_module
from tests.conftest import HELPERS, TINY, generate, metrics, preflight_cases, torchrun_env
from tests.helpers.scripts import captured_in_this_process
from tests.helpers.several_runs import launch_several

SHIM = HELPERS / "cp_cpu_shim"
# 4 steps of 2 micro-batches per rank, validation after steps 2 and 4, checkpoints at steps 2 and 4.
RUN = [*TINY, "--job.device", "cpu", "--training.steps", "4", "--training.grad_accum_steps", "2", "--eval.every",
       "2", "--eval.batches", "1", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2"]  # fmt: skip
TOLERANCE = 1e-5
ParallelLayout = layout_module().ParallelLayout
LayoutError = layout_module().LayoutError


def train(project: Path, output_dir: Path, *args: str, nproc: int, shim: bool = True) -> subprocess.CompletedProcess:
    """train.py on `nproc` gloo ranks under torchrun (1: a plain process), the CPU shim on PYTHONPATH or not."""
    command = [sys.executable, "train.py", *RUN, "--job.output_dir", str(output_dir), *args]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    path = f"{SHIM}:{project}" if shim else str(project)
    return subprocess.run(command, cwd=project, env={**torchrun_env(), "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def numbers(output_dir: Path) -> dict[int, dict[str, float]]:
    """step -> loss, grad_norm (and val_loss where validated), the last row of each step."""
    keys = ("loss", "grad_norm", "val_loss")
    return {row["step"]: {key: row[key] for key in keys if key in row} for row in metrics(output_dir)}


def assert_close(got: dict[int, dict[str, float]], expected: dict[int, dict[str, float]], steps: list[int]) -> None:
    for step in steps:
        assert got[step].keys() == expected[step].keys(), step
        for key, value in expected[step].items():
            assert abs(got[step][key] - value) <= TOLERANCE, (step, key, got[step][key], value)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("cp") / "cp2", "--gpus", "4", "--cp", "2", "--precision", "fp32")


@pytest.fixture(scope="module")
def one_process(project: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, float]]:
    """The same run in one process: no mesh, whole sequences (the reference)."""
    output_dir = tmp_path_factory.mktemp("one-process")
    ran(train(project, output_dir, nproc=1, shim=False))
    return numbers(output_dir)


@pytest.fixture(scope="module")
def cp2_dp2(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cp 2 x dp_shard 2 on 4 ranks: FSDP over the 4 ranks (dp_shard x cp), each sequence split over 2."""
    output_dir = tmp_path_factory.mktemp("cp2-dp2")
    ran(train(project, output_dir, nproc=4))
    return output_dir


def test_cp2_x_dp_shard2_on_4_ranks_equals_one_process(cp2_dp2: Path, one_process: dict) -> None:
    # Loss (the mean over every token of the step, logged as the mean over the ranks), gradient norm (FSDP's
    # average over dp_shard x cp) and validation loss, over 4 steps of 2 accumulated micro-batches.
    assert sorted(numbers(cp2_dp2)) == [1, 2, 3, 4]
    assert_close(numbers(cp2_dp2), one_process, [1, 2, 3, 4])


@pytest.fixture(scope="module")
def two_rank_runs(
    project: Path, cp2_dp2: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Path], str]:
    """The runs on 2 ranks, in ONE torchrun launch (tests/helpers/several_runs.py: torch imported and the process
    group joined once, then train.train() per run, each with its own config, mesh and output folder), the CPU shim on
    PYTHONPATH: "resumed", cp2_dp2's run resumed from its step-2 checkpoint with cp 1 (dp_shard 2), and "mutated",
    the cp 2 run (dp_shard 1) of a copy of the project whose ranks number the positions of their pieces as if each
    were the sequence's start (test_the_rotary_positions_...). Run -> output folder, and the launch's stdout."""
    root = tmp_path_factory.mktemp("cp-two-ranks")
    mutated = root / "mutated-project"
    shutil.copytree(project, mutated)
    source = (mutated / "context_parallel.py").read_text()
    assert source.count("yield MicroBatch(inputs, targets, positions)\n") == 1
    mutation = source.replace("yield MicroBatch(inputs, targets, positions)\n", "yield MicroBatch(inputs, targets)\n")
    (mutated / "context_parallel.py").write_text(mutation)
    folders = {"resumed": root / "resumed", "mutated": root / "mutated"}
    runs = [
        {"args": [*RUN, "--job.output_dir", str(folders["resumed"]), "--parallel.cp", "1"],
         "interrupted": {"from": str(cp2_dp2), "remove": ["checkpoints/step-4"]}},
        {"args": [*RUN, "--job.output_dir", str(folders["mutated"])], "project": str(mutated)},
    ]  # fmt: skip
    result = launch_several(project, runs, root / "runs.json", nproc=2, env={"PYTHONPATH": f"{SHIM}:{project}"})
    return folders, result.stdout


def test_a_checkpoint_saved_with_cp2_resumes_with_cp1_as_the_uninterrupted_run(
    two_rank_runs: tuple[dict[str, Path], str], one_process: dict
) -> None:
    # The DCP checkpoint of step 2, sharded over 4 ranks with cp 2, loaded by 2 ranks without cp (two_rank_runs'
    # "resumed": a copy of cp2_dp2's run without its step-4 checkpoint).
    folders, stdout = two_rank_runs
    run = folders["resumed"]
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    assert_close(numbers(run), one_process, [3, 4])


def test_hsdp_2_x_cp2_x_tp2_on_8_ranks_equals_one_process(one_process: dict, tmp_path: Path) -> None:
    # The user's node of 8 GPUs with every dimension in use: each cp rank's share of the sequence is split again
    # over the tp ranks between the blocks (sequence parallelism), and two replicas each shard over their
    # dp_shard x cp = 1 x 2 ranks: FSDP's mesh is (dp_replicate, dp_shard_cp). (FSDP over dp_shard 2 x cp 2:
    # test_cp2_x_dp_shard2_on_4_ranks_equals_one_process.) The model and its initialisation are the cp project's,
    # so is the reference.
    project = generate(tmp_path / "cp2-tp2", "--gpus", "8", "--cp", "2", "--tp", "2", "--precision", "fp32")
    ran(train(project, tmp_path / "out", "--training.steps", "2", "--parallel.dp_replicate", "2", nproc=8))
    assert_close(numbers(tmp_path / "out"), one_process, [1, 2])


def test_the_rotary_positions_of_a_ranks_pieces_matter(
    two_rank_runs: tuple[dict[str, Path], str], one_process: dict
) -> None:
    # The equality above is not blind to positions: each rank holds an early and a late piece of every sequence
    # (load balancing), and a model that numbers them 0..seq_len/cp-1, as if they were the sequence's start, does
    # not equal the one-process run. (Checked once more by hand: the same mutation makes the test above fail.)
    # cp 2 on 2 ranks (dp_shard 1) is enough: each rank's pieces are what is numbered wrong (two_rank_runs'
    # "mutated").
    got = numbers(two_rank_runs[0]["mutated"])
    # Far outside the tolerance (measured: 1.3e-5 at step 1, the model still nearly blind to order, 1.8e-2 in
    # step 3's gradient norm).
    differences = [abs(got[step][key] - value) for step, row in one_process.items() for key, value in row.items()]
    assert max(differences) > 100 * TOLERANCE, differences


REFUSALS = {
    "cpu": ((), False, "parallel.cp = 2 needs CUDA GPUs: torch's ring attention has no CPU attention kernel; run with "
                       "--parallel.cp 1 on CPU"),
    "document-mask": (("--data.document_mask", "true"), True,
                      "parallel.cp = 2 cannot mask documents (ring attention is causal over the whole sequence); run "
                      "with --data.document_mask false, or --parallel.cp 1 to keep documents apart"),
    "seq-len": (("--training.seq_len", "30", "--training.loss_chunks", "1"), True,
                "training.seq_len (30) must be divisible by 2 x parallel.cp (2): context parallelism gives each rank "
                "an early and a late piece of every sample; e.g. --training.seq_len 28"),
    "loss-chunks": (("--training.seq_len", "24", "--training.loss_chunks", "8"), True,
                    "training.loss_chunks (8) must divide the 12 tokens of a sample each context-parallel rank holds "
                    "(training.seq_len / parallel.cp); e.g. --training.loss_chunks 4"),
}  # fmt: skip


@pytest.fixture(scope="module")
def refusals(project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    """Every case of REFUSALS run by the project's own preflight.main() as `python preflight.py --world-size 4 ARGS`
    runs it: the cases with the CPU shim all in one process (tests/helpers/preflight_driver.py), the one without it
    (cpu) as `python preflight.py` itself (in this process). The folder of their output dirs, and case -> [exit code,
    stdout, stderr]."""
    root = tmp_path_factory.mktemp("refusals")
    argv = {case: ["--world-size", "4", *RUN, "--job.output_dir", str(root / case), *args]
            for case, (args, _, _) in REFUSALS.items()}  # fmt: skip
    shimmed = {case: argv[case] for case, (_, shim, _) in REFUSALS.items() if shim}
    results = preflight_cases(project, shimmed, root, pythonpath=f"{SHIM}:{project}")
    for case in REFUSALS.keys() - shimmed.keys():
        # Without the shim, as `python preflight.py` runs: its __main__ in this process (captured_in_this_process;
        # nothing distributed, and torch is imported here already), not a process of its own.
        results[case] = list(captured_in_this_process(project, "preflight.py", *argv[case]))
    return root, results


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_cp_cannot_run_is_refused_in_one_line_before_the_model_is_built(
    case: str, refusals: tuple[Path, dict[str, list]]
) -> None:
    root, results = refusals
    code, _, stderr = results[case]
    assert (code, stderr) == (2, f"preflight.py: error: {REFUSALS[case][2]}\n")
    assert not (root / case).exists()  # nothing written


def test_train_py_refuses_too_on_every_rank_with_one_line(project: Path, tmp_path: Path) -> None:
    # Started by torchrun directly (no launch script): rank 0's preflight stops every rank, one line, exit 2.
    result = train(project, tmp_path / "o", nproc=2, shim=False)
    assert result.returncode != 0
    lines = re.findall(r"^.*error: .*$", result.stderr, flags=re.M)
    assert lines == ["train.py: error: " + REFUSALS["cpu"][2]], result.stderr[-2000:]


# The generator's refusals of --cp (family, GPUs it cannot divide) are cases of test_bad_input_generator.py.


def test_cp_exists_only_in_projects_generated_with_it(project: Path, tmp_path: Path) -> None:
    plain = generate(tmp_path / "plain", "--gpus", "4")
    assert not (plain / "context_parallel.py").exists() and (project / "context_parallel.py").is_file()
    assert "\ncp = 2\n" in (project / "config.toml").read_text()
    assert "\ncp = " not in (plain / "config.toml").read_text()
    assert "sequence_shards" not in (plain / "train.py").read_text()
    assert "cp: int" not in (plain / "config.py").read_text()


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(2, 128),
    cp=st.integers(1, 8),
    tp=st.integers(1, 4),
    seq_len=st.integers(1, 4096),
    loss_chunks=st.integers(1, 16),
)
def test_the_cp_layout_splits_every_sequence_evenly_or_says_why_in_one_line(
    world_size: int, cp: int, tp: int, seq_len: int, loss_chunks: int
) -> None:
    config = SimpleNamespace(dp_replicate=1, dp_shard=-1, cp=cp, tp=tp, reshard_after_forward=True)
    training = SimpleNamespace(global_batch_size=world_size * 4, grad_accum_steps=1, seq_len=seq_len,
                               loss_chunks=loss_chunks)  # fmt: skip
    model = SimpleNamespace(n_heads=8 * tp, n_kv_heads=4 * tp, ffn_dim=64 * tp)
    layout = ParallelLayout.of(config, world_size)
    try:
        layout.check(training, model)
    except LayoutError as error:
        assert "\n" not in str(error) and "; " in str(error)
        assert error.problem in ("ranks", "tp_seq_len", "cp_seq_len", "cp_loss_chunks", "batch"), error.problem
        if error.problem == "cp_seq_len":
            assert seq_len % (2 * cp * tp)
            fitting = int(str(error).rsplit(" ", 1)[1])
            assert fitting % (2 * cp * tp) == 0  # the suggested length splits
        if error.problem == "cp_loss_chunks":
            fitting = int(str(error).rsplit(" ", 1)[1])
            assert (seq_len // cp) % fitting == 0 and fitting <= loss_chunks
        return
    assert math.prod(layout.sizes.values()) == world_size
    if cp > 1:
        assert seq_len % (2 * cp * tp) == 0 and (seq_len // cp) % loss_chunks == 0
    # FSDP shards over dp_shard x cp; the cp x tp ranks of a group (consecutive ranks) read the same samples.
    assert layout.shard_ranks == layout.dp_shard * cp and layout.data_ranks * cp * tp == world_size
    readers = [layout.data_rank(rank) for rank in range(world_size)]
    assert all(readers[rank] == readers[rank - rank % (cp * tp)] for rank in range(world_size))
    assert sorted(readers) == sorted(list(range(layout.data_ranks)) * cp * tp)
