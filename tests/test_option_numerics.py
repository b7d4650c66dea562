"""Training options, proven numerically on CPU ranks with real torchrun processes.

- Sharded runs (2 ranks; HSDP 2 x 2; TP 2 x FSDP 2; 2 ranks x 4 accumulated micro-batches; 4 ranks resharding
  to groups of 2 after forward) equal plain single-process PyTorch (tests/helpers/reference_loop.py, no FSDP)
  step by step and in their final parameters, with clipping active on every step. Every 4-rank run shares one
  launch, every 2-rank run another.
- A project generated with every memory/speed option passes its own tests, which check that each option
  (CPU offload, explicit prefetch, no resharding; activation checkpointing: test_op_level_ac.py) leaves the
  numbers unchanged, that compiled blocks match eager, and that TensorBoard gets the metrics.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import HELPERS, TINY, generate, metrics, run_own_tests
from tests.helpers.scripts import captured_in_this_process, run_in_this_process
from tests.helpers.several_runs import launch_several

STEPS = 10
# max_norm far below the gradient norms (~1): every step is clipped, so clipping must be right everywhere.
RUN = [*TINY, "--training.steps", str(STEPS), "--training.max_norm", "1e-3", "--job.device", "cpu"]
TOLERANCE = 1e-5


def reference_run(project: Path, out: Path, options: list[str]) -> tuple[list[dict], dict]:
    """tests/helpers/reference_loop.py (plain PyTorch, one process) with the run's options: metrics, final weights.
    Nothing distributed: it runs in this process (run_in_this_process), not a process of its own."""
    run_in_this_process(project, str(HELPERS / "reference_loop.py"), str(out), *RUN, *options)
    return metrics(out), torch.load(out / "final.pt")


@pytest.fixture(scope="module")
def reference(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    return reference_run(projects["fp32"], tmp_path_factory.mktemp("reference"), [])


def final_parameters(output_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the run's final (model-only) DCP checkpoint, as full tensors in this process."""
    dcp_to_torch_save(output_dir / "checkpoints" / f"step-{STEPS}", output_dir / "final.pt")
    return torch.load(output_dir / "final.pt")["train"]["model"]


@pytest.fixture(scope="module")
def tp_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("tp") / "run-tp", "--gpus", "4", "--fp32", "--tp", "2")


SHARDED = {
    "2-ranks": (2, []),
    # HSDP: 2 replicas, each sharded over 2 ranks.
    "4-ranks-hsdp-2x2": (4, ["--parallel.dp_replicate", "2"]),
    # An int reshard_after_forward: parameters stay sharded over groups of 2 (of the 4 ranks a parameter is sharded
    # over) between forward and backward, gathered again for each of 2 micro-batches' backward. (The generated
    # project's own test_resharding_to_groups_changes_memory_not_numbers checks the same against one process.)
    "4-ranks-reshard-groups-of-2": (4, ["--parallel.dp_replicate", "1", "--parallel.reshard_after_forward", "2",
                                        "--training.grad_accum_steps", "2"]),
    # 4 micro-batches of 1 sample per rank must add up to the reference's one batch of 8: reduce-scattered
    # after every micro-batch (the default), and held unsharded until the last one.
    "2-ranks-accumulate-4": (2, ["--training.grad_accum_steps", "4"]),
    "2-ranks-accumulate-4-sync-last": (2, ["--training.grad_accum_steps", "4", "--training.grad_sync",
                                           "last_micro_batch"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def sharded_runs(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 2-rank cases of SHARDED in ONE torchrun launch (tests/helpers/several_runs.py: torch imported and the
    process group joined once, then train.train() per case, each with its own config, seed and output folder; a
    launch costs ~8 CPU-s before it trains): case -> output folder."""
    root = tmp_path_factory.mktemp("sharded")
    cases = {case: options for case, (nproc, options) in SHARDED.items() if nproc == 2}
    several_runs(projects["fp32"], {root / case: options for case, options in cases.items()}, nproc=2)
    return {case: root / case for case in cases}


def several_runs(project: Path, runs: dict[Path, list[str]], nproc: int, other: dict[Path, Path] | None = None) -> None:
    """train.py's run of RUN + options into each output folder, all in one launch of `nproc` ranks; a folder in
    `other` is run by that project's train.py (several_runs.py's "project") instead of `project`'s."""
    argv = [[*RUN, *options, "--checkpoint.model_only_final", "true", "--job.output_dir", str(output_dir)]
            for output_dir, options in runs.items()]  # fmt: skip
    argv = [{"args": args, "project": str((other or {})[folder])} if folder in (other or {}) else args
            for folder, args in zip(runs, argv, strict=True)]  # fmt: skip
    launch_several(project, argv, next(iter(runs)).parent / "runs.json", nproc)


@pytest.mark.parametrize("case", list(SHARDED))
def test_sharded_run_equals_plain_pytorch(
    projects: dict[str, Path],
    reference: tuple[list[dict], dict],
    sharded_runs: dict[str, Path],
    four_rank_runs: dict[bool | str, Path],
    case: str,
) -> None:
    nproc, options = SHARDED[case]
    if "--training.grad_sync" in options:
        # The option reaches train_step (not only the config): the default is the other mode, and train_step
        # reads it from the config it is given. tests/test_plan.py measures that last_micro_batch holds the
        # whole model.
        source = (projects["fp32"] / "train.py").read_text()
        assert (
            'grad_sync: Literal["every_micro_batch", "last_micro_batch"] = setting("every_micro_batch", '
            in (projects["fp32"] / "config.py").read_text()
        )
        sync = 'set_requires_gradient_sync(training.grad_sync == "every_micro_batch" or index == len(batches) - 1)'
        assert source.count(sync) == 1 and source.count("train_step(state, batches, config)") == 1
    # 2 ranks: sharded_runs' launch; 4 ranks: four_rank_runs' launch (the fp32 project's train.py).
    assert_equals_reference(sharded_runs[case] if nproc == 2 else four_rank_runs[case], reference)


TIED = ["--model.tie_embeddings", "true"]


@pytest.fixture(scope="module")
def four_rank_runs(
    tp_project: Path, projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[bool | str, Path]:
    """Every 4-rank run in ONE launch (as sharded_runs): the untied and the tied tp run (tied -> output folder),
    then the 4-rank cases of SHARDED, run by the fp32 project's train.py (case -> output folder)."""
    root = tmp_path_factory.mktemp("four-ranks")
    cases = {case: options for case, (nproc, options) in SHARDED.items() if nproc == 4}
    runs = {root / "untied": [], root / "tied": TIED} | {root / case: options for case, options in cases.items()}
    several_runs(tp_project, runs, nproc=4, other={root / case: projects["fp32"] for case in cases})
    return {False: root / "untied", True: root / "tied"} | {case: root / case for case in cases}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_tensor_parallel_run_equals_plain_pytorch(
    tp_project: Path,
    reference: tuple[list[dict], dict],
    four_rank_runs: dict[bool | str, Path],
    tmp_path: Path,
    tied: bool,
) -> None:
    """4 ranks, tp 2 x FSDP 2, torchtitan's layout: sequence-parallel norms, vocabulary-split embedding and
    output, loss_parallel, block linears split; all parameters on the 2-D mesh, clipping on every step. Tied:
    the embedding and output share one vocabulary-split parameter (train.py re-ties them after TP)."""
    assert "tp = 2\n" in (tp_project / "config.toml").read_text()
    expected = reference_run(tp_project, tmp_path / "reference", TIED) if tied else reference
    worst = assert_equals_reference(four_rank_runs[tied], expected)
    print(f"\ntp 2 x dp 2, tied={tied}: max |diff| vs plain PyTorch {worst}")


def test_tensor_parallel_needs_seq_len_divisible_by_tp(tp_project: Path, tmp_path: Path) -> None:
    """Sequence parallelism splits every sample's tokens over the tp ranks: preflight refuses an odd seq_len.
    (`python preflight.py` involves nothing distributed: run in this process, captured_in_this_process.)"""
    result = captured_in_this_process(
        tp_project, "preflight.py", "--world-size", "4", *TINY, "--training.seq_len", "31", "--training.loss_chunks",
        "1", "--job.device", "cpu", "--job.output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    expected = (
        "preflight.py: error: training.seq_len (31) must be divisible by parallel.tp (2), which splits each "
        "sample's tokens; e.g. --training.seq_len 30\n"
    )
    assert result == (2, "", expected)


def assert_equals_reference(tmp_path: Path, reference: tuple[list[dict], dict]) -> dict[str, float]:
    """Fail unless the run in `tmp_path` equals the reference within TOLERANCE; the largest differences seen."""
    expected_metrics, expected_params = reference
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for ours, plain in zip(records, expected_metrics, strict=True):
        assert abs(ours["loss"] - plain["loss"]) <= TOLERANCE, (ours, plain)
        # The norm before clipping, over the full gradients: the sharded norm reduced across ranks.
        assert abs(ours["grad_norm"] - plain["grad_norm"]) <= TOLERANCE * plain["grad_norm"], (ours, plain)
        assert plain["grad_norm"] > 100 * 1e-3  # so clipping really happened
    params = final_parameters(tmp_path)
    assert params.keys() == expected_params.keys()
    for name, tensor in expected_params.items():
        assert (params[name] - tensor).abs().max().item() <= TOLERANCE, name
    return {
        "loss": max(abs(ours["loss"] - plain["loss"]) for ours, plain in zip(records, expected_metrics, strict=True)),
        "grad_norm": max(
            abs(ours["grad_norm"] - plain["grad_norm"]) for ours, plain in zip(records, expected_metrics, strict=True)
        ),
        "parameters": max((params[name] - tensor).abs().max().item() for name, tensor in expected_params.items()),
    }


ALL_OPTIONS = [
    "--gpus", "2", "--fp32", "--activation-checkpointing", "selective", "--compile", "--cpu-offload", "--prefetch",
    "--tensorboard", "--reshard-after-forward", "false",
]  # fmt: skip


def test_project_with_every_option_passes_its_own_training_tests(tmp_path: Path) -> None:
    project = generate(tmp_path / "run-options", *ALL_OPTIONS)
    # -q -vv: one line per test. With every option on: 2 ranks == 1 process (with a validation pass), the chunked
    # loss == the whole logits' (the one-process runs that the ranks are compared with: no run of its own), meta
    # init == eager init (CPU offload initialises on CPU); 3 options equal to the run without them (CPU offload,
    # prefetch of 2 blocks, no resharding); compiled == eager; TensorBoard. These 2-ranks, chunked-loss and meta-init
    # tests are the llama template's, run here and not again in the fp32 project's own suite (test_training_runs.py
    # says what runs where). (The other base tests do not depend on options: test_training_runs.py runs them. This
    # project's 3 activation checkpointing cases, op-level selective, layer and full vs none on 2 fp32 ranks, are
    # test_op_level_ac.py's test_every_ac_mode_trains_to_the_numbers_of_no_ac, at 1e-6.)
    selected = ["-k", "ranks_match_one_process or chunked_loss or meta_init or (option_changes and not "
                "activation_checkpointing) or compiled or tensorboard"]  # fmt: skip
    stdout = run_own_tests(project, "-vv", "tests/test_training.py", *selected)
    assert re.search(r" 8 passed, 5 deselected in ", stdout), stdout[-2000:]
    for test in ("ranks_match_one_process", "chunked_loss_equals_the_loss_of_the_whole_logits",
                 "meta_init_matches_eager_init",
                 "option_changes_memory_or_speed_not_numbers[cpu_offload-true]",
                 "option_changes_memory_or_speed_not_numbers[prefetch_blocks-2]",
                 "option_changes_memory_or_speed_not_numbers[reshard_after_forward-false]",
                 "compiled_blocks_match_eager", "tensorboard_logs_the_metrics"):  # fmt: skip
        assert f"tests/test_training.py::test_{test} PASSED" in stdout, stdout[-2000:]
