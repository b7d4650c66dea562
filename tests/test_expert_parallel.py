"""Expert parallelism (`fsdp2gen new --moe --ep N`, llama): each MoE layer's experts shared out over ep ranks
borrowed from dp_shard, tokens sent to their experts' ranks and back by all-to-all (expert_parallel.py).

Real torchrun, gloo, fp32, a tiny debug-moe model (8 experts, top 2, two MoE layers), projects rendered by the CLI;
every run is compared with one process (no mesh, every expert local): losses, gradient norms, the load figures and
the final weights.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp2gen.plan_layout import layout_module
from tests.conftest import generate, metrics, preflight_cases
from tests.helpers.several_runs import launch_several

# A debug-moe model small enough for 4 CPU ranks on 2 cores: 3 blocks, the last two MoE (8 experts of hidden 32,
# top 2, one shared expert). 4 steps of 2 micro-batches per rank, validation and checkpoints after steps 2 and 4.
# lr 1e-3: at 1e-2 Adam turns the fp32 rounding of any sharded run (FSDP alone, without EP, too) into weight
# differences of 2e-5.
RUN = [
    "--job.device", "cpu", "--model.dim", "64", "--model.n_layers", "3", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.moe_ffn_dim", "32",
    "--model.max_seq_len", "64", "--training.seq_len", "32", "--training.global_batch_size", "8",
    "--training.grad_accum_steps", "2", "--training.warmup_steps", "2", "--training.lr", "1e-3",
    "--training.loss_chunks", "1", "--job.log_every", "1", "--training.steps", "4", "--eval.every", "2",
    "--eval.batches", "1", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2",
]  # fmt: skip
AUX_LOSS = ["--model.aux_loss_coef", "0.01", "--model.expert_bias_rate", "0"]
TOLERANCE = 1e-5
ParallelLayout = layout_module().ParallelLayout
LayoutError = layout_module().LayoutError


def numbers(output_dir: Path) -> dict[int, dict[str, float]]:
    """step -> loss, grad_norm, the load-balance figures (and val_loss where validated), the last row of each step."""
    keys = ("loss", "grad_norm", "val_loss", "moe_load_max_mean", "moe_load_min_mean", "moe_bias_abs_max",
            "moe_aux_loss")  # fmt: skip
    return {row["step"]: {key: row[key] for key in keys if key in row} for row in metrics(output_dir)}


def weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model's weights in the DCP checkpoint of `step`, as full tensors in this process."""
    dcp_to_torch_save(output_dir / "checkpoints" / f"step-{step}", output_dir / f"step-{step}.pt")
    return torch.load(output_dir / f"step-{step}.pt")["train"]["model"]


def differences(got: Path, expected: Path, steps: list[int]) -> dict[str, float]:
    """The largest |difference| of each logged number over `steps`, and of the final weights."""
    mine, theirs = numbers(got), numbers(expected)
    diffs: dict[str, float] = {}
    for step in steps:
        assert mine[step].keys() == theirs[step].keys(), step
        for key, value in theirs[step].items():
            diffs[key] = max(diffs.get(key, 0.0), abs(mine[step][key] - value))
    final = max(steps)
    mine_weights, their_weights = weights(got, final), weights(expected, final)
    assert mine_weights.keys() == their_weights.keys()
    assert any(".experts.w1" in name for name in their_weights)  # the stacked expert weights are compared too
    diffs["weights"] = max((mine_weights[name] - their_weights[name]).abs().max().item() for name in their_weights)
    return diffs


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("ep") / "ep2", "--gpus", "4", "--moe", "--ep", "2", "--precision", "fp32")


# 2 experts (each token to 1) over ep 2 x dp_shard_mod_ep 2: each rank holds 1 expert, its 2 FSDP ranks shard its
# rows (test_ep2_x_dp_shard2_with_experts_split_by_rows_equals_one_process).
ROWS = ["--model.n_experts", "2", "--model.top_k", "1", "--training.steps", "2", "--training.grad_accum_steps", "1"]
# The project's runs, by launch: the one-process references in ONE plain process, the 4-rank runs in ONE torchrun
# launch (tests/helpers/several_runs.py: torch imported and the process group joined once, then train.train() per
# run, each with its own config, mesh, seed and output folder; a 4-rank launch costs ~14 CPU-s before it trains).
ONE_PROCESS_RUNS = {
    # Every expert local, no all-to-all (the reference), balanced by the auxiliary-loss-free bias updates (the
    # default).
    "one-process": [],
    # The reference balanced by the sequence-wise balance loss alone.
    "one-process-aux-loss": AUX_LOSS,
    "rows-one-process": ROWS,
}
FOUR_RANK_RUNS = {
    # ep 2 borrowed from dp_shard 4 on 4 ranks: the mesh is dp_shard_mod_ep 2 x ep 2, each rank holds 4 experts of
    # every MoE layer, sharded over the 2 ranks that hold the same ones.
    "ep2-dp2": [],
    # One process's step-2 checkpoint (of one-process-aux-loss) resumed with hsdp 2 x ep 2.
    "hsdp-resume": [*AUX_LOSS, "--parallel.dp_replicate", "2"],
    "rows-four-ranks": ROWS,
}


@pytest.fixture(scope="module")
def runs(project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], str]:
    """Every run of ONE_PROCESS_RUNS and FOUR_RANK_RUNS, in two launches: run -> output folder, and the 4-rank
    launch's stdout. The hsdp-resume run starts from a copy of one-process-aux-loss without its step-4 checkpoint."""
    root = tmp_path_factory.mktemp("ep-runs")
    folders = {name: root / name for name in [*ONE_PROCESS_RUNS, *FOUR_RANK_RUNS]}

    def argv(table: dict[str, list[str]]) -> list[list[str]]:
        return [[*RUN, "--job.output_dir", str(folders[name]), *args] for name, args in table.items()]

    launch_several(project, argv(ONE_PROCESS_RUNS), root / "one-process.json", nproc=1)
    shutil.copytree(folders["one-process-aux-loss"], folders["hsdp-resume"])
    shutil.rmtree(folders["hsdp-resume"] / "checkpoints" / "step-4")
    result = launch_several(project, argv(FOUR_RANK_RUNS), root / "four-ranks.json", nproc=4)
    return folders, result.stdout


@pytest.fixture(scope="module")
def one_process(runs: tuple[dict[str, Path], str]) -> Path:
    return runs[0]["one-process"]


@pytest.fixture(scope="module")
def ep2_dp2(runs: tuple[dict[str, Path], str]) -> Path:
    return runs[0]["ep2-dp2"]


def test_ep2_x_dp_shard2_on_4_ranks_equals_one_process(ep2_dp2: Path, one_process: Path) -> None:
    # Loss (the mean over every target of the step), gradient norm (the experts' gradients sit on another mesh
    # than the rest's: clip_grad_norm combines the two), the load figures and every final weight; with the bias
    # updates (the balance loss: the hsdp 2 x ep 2 resume below).
    assert sorted(numbers(ep2_dp2)) == [1, 2, 3, 4]
    diffs = differences(ep2_dp2, one_process, [1, 2, 3, 4])
    assert max(diffs.values()) <= TOLERANCE, diffs


@pytest.fixture(scope="module")
def two_rank_runs(
    project: Path, ep2_dp2: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Path], str]:
    """The runs on 2 ranks, in ONE torchrun launch as FOUR_RANK_RUNS are: "resumed", ep2_dp2's run resumed from its
    step-2 checkpoint with ep 1 (dp_shard 2), and "mutated", the ep 2 run (dp_shard_mod_ep 1) of 2 steps of a copy
    of the project whose dispatch leaves the tokens in arrival order (test_the_dispatch_is_what_makes_it_equal).
    Run -> output folder, and the launch's stdout."""
    root = tmp_path_factory.mktemp("ep-two-ranks")
    mutated = root / "mutated-project"
    shutil.copytree(project, mutated)
    source = (mutated / "expert_parallel.py").read_text()
    assert source.count("return arrived[self.order], counts.sum(dim=0)") == 1
    (mutated / "expert_parallel.py").write_text(source.replace("arrived[self.order]", "arrived"))
    folders = {"resumed": root / "resumed", "mutated": root / "mutated"}
    runs = [
        {"args": [*RUN, "--job.output_dir", str(folders["resumed"]), "--parallel.ep", "1"],
         "interrupted": {"from": str(ep2_dp2), "remove": ["checkpoints/step-4"]}},
        # ep 2 on 2 ranks (dp_shard_mod_ep 1) is enough: the all-to-all between the 2 ep ranks is what is broken.
        {"args": [*RUN, "--job.output_dir", str(folders["mutated"]), "--training.steps", "2"],
         "project": str(mutated)},
    ]  # fmt: skip
    result = launch_several(project, runs, root / "runs.json", nproc=2)
    return folders, result.stdout


def test_a_checkpoint_saved_with_ep2_resumes_with_ep1_as_the_uninterrupted_run(
    two_rank_runs: tuple[dict[str, Path], str], one_process: Path
) -> None:
    # The DCP checkpoint of step 2, experts sharded over ep 2 x dp_shard_mod_ep 2, loaded by 2 ranks without EP
    # (two_rank_runs' "resumed": a copy of ep2_dp2's run without its step-4 checkpoint).
    folders, stdout = two_rank_runs
    run = folders["resumed"]
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    diffs = differences(run, one_process, [3, 4])
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_a_checkpoint_saved_by_one_process_resumes_with_hsdp_2_x_ep2_as_the_uninterrupted_run(
    runs: tuple[dict[str, Path], str],
) -> None:
    folders, stdout = runs
    one_process, run = folders["one-process-aux-loss"], folders["hsdp-resume"]
    # Whole stacked experts in the checkpoint of step 2, each of 4 ranks loading its share: two replicas of
    # dp_shard 2, all of it lent to ep (dp_shard_mod_ep = 1), so each rank loads half the experts whole, and their
    # gradients are all-reduced across the replicas. Balanced by the sequence-wise balance loss alone (its value,
    # summed over the ranks' sequences, is one of the compared figures). Steps 3 and 4, validated and checkpointed,
    # equal one process: the HSDP x EP layout's proof. (FOUR_RANK_RUNS)
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    assert all("moe_aux_loss" in numbers(run)[step] for step in (3, 4))
    # The loss acted and the biases stayed still: the run exercised the balancing it compares.
    assert numbers(run)[4]["moe_bias_abs_max"] == 0 and 0 < numbers(run)[4]["moe_aux_loss"] < 0.1, numbers(run)[4]
    diffs = differences(run, one_process, [3, 4])
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_the_dispatch_is_what_makes_it_equal(two_rank_runs: tuple[dict[str, Path], str], one_process: Path) -> None:
    # The equality above is not blind to the dispatch: tokens left in arrival order (by sender, not by expert)
    # reach the wrong experts, and the run no longer equals one process (two_rank_runs' "mutated").
    diffs = differences(two_rank_runs[0]["mutated"], one_process, [1, 2])
    # Far outside the tolerance (measured over 2 steps: loss 3.1e-4, final weights 3.0e-3, moe_load_max_mean 0.05).
    assert diffs["loss"] > 10 * TOLERANCE and diffs["weights"] > 100 * TOLERANCE, diffs


def test_ep2_x_dp_shard2_with_experts_split_by_rows_equals_one_process(runs: tuple[dict[str, Path], str]) -> None:
    # ep 2 x dp_shard_mod_ep 2 on 4 ranks, and 2 experts (each token to 1): each rank holds 1 expert and its 2 FSDP
    # ranks shard its rows (Shard(1), as torchtitan does when experts are fewer than their shard ranks; the user's
    # node of 8 GPUs with ep 4 and 4 experts is the same layout). (Across 2 launched nodes, and at 8 ranks in one
    # node: test_pipeline_parallel.py's pp x tp, test_launchers.py's HSDP and test_context_parallel.py's cp x tp.)
    folders = runs[0]
    diffs = differences(folders["rows-four-ranks"], folders["rows-one-process"], [1, 2])
    assert max(diffs.values()) <= TOLERANCE, diffs


PREFLIGHT_REFUSALS = {
    "ep-not-dividing-dp-shard": (("--parallel.ep", "3"),
                                 "parallel.ep (3) must divide parallel.dp_shard (4): expert parallelism borrows its "
                                 "ranks from the shard group; e.g. --parallel.ep 2"),
    "experts-not-divisible": (("--parallel.ep", "4", "--model.n_experts", "6"),
                              "model.n_experts (6) must be divisible by parallel.ep (4), which shares them out "
                              "equally; e.g. --parallel.ep 2"),
    "no-experts": (("--parallel.ep", "2", "--model.size", "debug"),
                   "parallel.ep = 2 needs a mixture-of-experts model, but model.n_experts is 0; use --parallel.ep 1 or "
                   "a model with experts (e.g. --model.size debug-moe)"),
}  # fmt: skip


@pytest.fixture(scope="module")
def refusals(project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    """Every case of PREFLIGHT_REFUSALS run by the project's own preflight.main() as `python preflight.py
    --world-size 4 ARGS` runs it, all in one process (tests/helpers/preflight_driver.py): the folder of their output
    dirs, and case -> [exit code, stdout, stderr]. (`torchrun train.py` runs the same preflight() on rank 0 and stops
    every rank with its one line: test_bad_input_runtime.py's test_torchrun_without_the_launcher_prints_the_error_once,
    and test_context_parallel.py's test_train_py_refuses_too_on_every_rank_with_one_line for a layout's own
    refusal.)"""
    root = tmp_path_factory.mktemp("refusals")
    argv = {case: ["--world-size", "4", *RUN, "--job.output_dir", str(root / case), *args]
            for case, (args, _) in PREFLIGHT_REFUSALS.items()}  # fmt: skip
    return root, preflight_cases(project, argv, root)


@pytest.mark.parametrize("case", sorted(PREFLIGHT_REFUSALS))
def test_what_ep_cannot_run_is_refused_in_one_line_before_the_model_is_built(
    case: str, refusals: tuple[Path, dict[str, list]]
) -> None:
    root, results = refusals
    code, _, stderr = results[case]
    assert (code, stderr) == (2, f"preflight.py: error: {PREFLIGHT_REFUSALS[case][1]}\n")
    assert not (root / case).exists()  # nothing written


# The generator's refusals of --ep (without --moe, not dividing the GPUs per node, 0) are cases of
# test_bad_input_generator.py.


def test_ep_exists_only_in_moe_projects(project: Path, tmp_path: Path) -> None:
    plain = generate(tmp_path / "plain", "--gpus", "4")
    moe = generate(tmp_path / "moe", "--gpus", "4", "--moe")
    assert (project / "expert_parallel.py").is_file() and (moe / "expert_parallel.py").is_file()
    assert not (plain / "expert_parallel.py").exists()
    assert "\nep = 2\n" in (project / "config.toml").read_text()
    assert "\nep = 1\n" in (moe / "config.toml").read_text()
    assert "\nep = " not in (plain / "config.toml").read_text()
    assert "\n    ep: int" not in (plain / "config.py").read_text()
    assert "expert_parallel" not in (plain / "train.py").read_text()


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(2, 128),
    dp_replicate=st.integers(1, 4),
    ep=st.integers(1, 16),
    n_experts=st.integers(0, 64),
)
def test_the_ep_layout_shares_out_the_experts_evenly_or_says_why_in_one_line(
    world_size: int, dp_replicate: int, ep: int, n_experts: int
) -> None:
    config = SimpleNamespace(dp_replicate=dp_replicate, dp_shard=-1, ep=ep, reshard_after_forward=True)
    training = SimpleNamespace(global_batch_size=world_size * 4, grad_accum_steps=1, seq_len=64, loss_chunks=1)
    layout = ParallelLayout.of(config, world_size)
    try:
        layout.check(training, SimpleNamespace(n_experts=n_experts))
    except LayoutError as error:
        assert "\n" not in str(error) and "; " in str(error)
        assert error.problem in ("ranks", "batch", "ep_ranks", "ep_experts"), error.problem
        if error.problem == "ep_ranks":
            assert layout.dp_shard % ep
        if error.problem in ("ep_ranks", "ep_experts") and "e.g. --parallel.ep" in str(error):
            fitting = int(str(error).rsplit(" ", 1)[1])  # the suggestion itself works
            assert layout.dp_shard % fitting == 0 and n_experts % fitting == 0 and fitting <= ep
        if error.problem == "ep_experts" and not n_experts:
            assert ep > 1
        return
    assert math.prod(layout.sizes.values()) == world_size
    mesh = layout.mesh_sizes
    if ep > 1:
        # EP borrows from dp_shard: the mesh has dp_shard_mod_ep x ep in its place, and the same number of ranks.
        assert n_experts % ep == 0 and "dp_shard" not in mesh
        assert mesh["dp_shard_mod_ep"] * mesh["ep"] == layout.dp_shard and math.prod(mesh.values()) == world_size
    # ep ranks read different samples: the same data ranks as without EP.
    plain = ParallelLayout.of(SimpleNamespace(dp_replicate=dp_replicate, dp_shard=-1), world_size)
    assert [layout.data_rank(rank) for rank in range(world_size)] == [plain.data_rank(r) for r in range(world_size)]
