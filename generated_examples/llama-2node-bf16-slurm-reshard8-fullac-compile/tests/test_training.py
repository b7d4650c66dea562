"""End-to-end tests of training: real torchrun processes, gloo on CPU (or nccl on every visible GPU).

Run with `pytest`. Each test trains a tiny model for a few steps; test_checkpoint.py covers checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runs import DEVICE, GLOBAL_BATCH, NPROC, launch, metrics, refused, train, train_several

# 1 process vs NPROC processes: equal up to float rounding, looser when computing in low precision.
PARITY_TOLERANCE = 2e-2
# training.loss_chunks 4 vs 1: the same sums in another order (the output layer's gradient adds the chunks'
# parts in the compute dtype).
CHUNKED_TOLERANCE = 2e-2


def test_loss_decreases_on_a_repeated_batch(tmp_path: Path) -> None:
    # synthetic_samples == global_batch_size: every step sees the same samples.
    repeated = ["--data.synthetic_samples", str(GLOBAL_BATCH)]
    metrics = train(tmp_path, "--training.steps", "8", "--training.lr", "1e-2", *repeated)
    losses = [m["loss"] for m in metrics]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert losses[-1] < 0.8 * losses[0], losses
    tokens_per_step = GLOBAL_BATCH * 32  # the tests' seq_len
    for record in metrics:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s_per_gpu", "peak_mem_mib"} <= record.keys()
        # The allocator reserves at least what it allocated (on CPU both are the resident peak).
        assert record["peak_reserved_mib"] >= record["peak_mem_mib"], record
        assert record["tokens_per_s"] == pytest.approx(tokens_per_step / record["step_time_s"], rel=1e-9)
        assert record["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_s"] / NPROC, rel=1e-9)
    # A peak never falls from one step to the next.
    peaks = [record["peak_mem_mib"] for record in metrics]
    assert peaks == sorted(peaks) and peaks[0] > 0, peaks


# One sharded run and the same run in one process, read by the next two tests: 2 micro-batches a step, a validation
# pass at the last step, the loss computed 4 sequence chunks at a time.
SHARDED_RUN = [
    "--training.steps", "3", "--training.grad_accum_steps", "2", "--eval.every", "3", "--eval.batches", "1",
    "--training.loss_chunks", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("sharded")
    train(output_dir, *SHARDED_RUN)
    return output_dir


@pytest.fixture(scope="module")
def sharded(sharded_dir: Path) -> list[dict]:
    return metrics(sharded_dir)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    # One launch of one process: that run, and the same with the loss of the whole logits (loss_chunks 1).
    runs = {"chunked": [], "whole": ["--training.loss_chunks", "1"]}
    return train_several(tmp_path_factory.mktemp("single"), runs, *SHARDED_RUN, nproc=1)


def test_ranks_match_one_process(sharded: list[dict], single: dict[str, list[dict]]) -> None:
    # The global batch is fixed, so the number of ranks must not change the numbers.
    single = single["chunked"]
    assert "val_loss" in single[-1] and "val_loss" in sharded[-1]
    for a, b in zip(single, sharded, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= PARITY_TOLERANCE * max(1.0, abs(a[key])), (key, a, b)


def test_chunked_loss_equals_the_loss_of_the_whole_logits(single: dict[str, list[dict]]) -> None:
    # The logits computed 4 sequence chunks at a time, each recomputed in backward (chunked_loss.py), give the
    # training loss, the gradients (their norm, and the next steps' losses) and the validation loss of the whole;
    # with 2 micro-batches, each one's chunks add into the same gradients. Both in one process: chunking is each
    # rank's own arithmetic, and test_ranks_match_one_process shows the chunked run the same on NPROC ranks.
    whole, chunked = single["whole"], single["chunked"]
    assert "val_loss" in whole[-1] and "val_loss" in chunked[-1]
    for a, b in zip(whole, chunked, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= CHUNKED_TOLERANCE * max(1.0, abs(a[key])), (key, a, b)


def test_meta_init_matches_eager_init(tmp_path: Path) -> None:
    result = launch("tests/check_init.py", tmp_path)
    assert "MISMATCH" not in result.stdout
    assert result.stdout.count("tensors equal") == NPROC


# Each option trades memory for speed or the reverse; none may change the numbers.
OPTIONS = [
    ("activation_checkpointing", "selective"),
    ("activation_checkpointing", "layer"),
    ("activation_checkpointing", "full"),
    ("reshard_after_forward", "false"),
]
OPTIONS_OFF = [
    "--parallel.activation_checkpointing", "none",
    "--parallel.reshard_after_forward", "true",
]  # fmt: skip
OPTION_STEPS = ["--training.steps", "4", "--model.n_layers", "4"]


@pytest.fixture(scope="module")
def option_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    # The run without the options and one with each, in one launch: an option changes how the parameters are held,
    # gathered or recomputed, not the ranks' mesh.
    runs = {"without": [], **{"-".join(option): [f"--parallel.{option[0]}", option[1]] for option in OPTIONS}}
    return train_several(tmp_path_factory.mktemp("options"), runs, *OPTION_STEPS, *OPTIONS_OFF)


@pytest.mark.parametrize("option", OPTIONS, ids="-".join)
def test_option_changes_memory_or_speed_not_numbers(
    option_runs: dict[str, list[dict]], option: tuple[str, str]
) -> None:
    for a, b in zip(option_runs["without"], option_runs["-".join(option)], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (a, b)


# Enough ranks that groups of 2 (or of the configured size) are smaller than the group a parameter is sharded over.
RESHARD_RANKS = max(NPROC, 4)


@pytest.mark.skipif(DEVICE == "cuda" and NPROC < RESHARD_RANKS, reason=f"needs {RESHARD_RANKS} GPUs")
def test_resharding_to_groups_changes_memory_not_numbers(tmp_path: Path) -> None:
    # reshard_after_forward = N keeps parameters sharded over groups of N ranks between forward and backward. It
    # applies only where N divides the ranks a parameter is sharded over and is smaller (train.py reshards fully
    # otherwise), so the test takes groups that do: 8 if these ranks allow it, else 2.
    shard_ranks = RESHARD_RANKS
    configured = 8
    group = configured if configured < shard_ranks and shard_ranks % configured == 0 else 2
    assert group < shard_ranks and shard_ranks % group == 0, (group, shard_ranks)
    # One shard group over all ranks (no HSDP replicas), 2 micro-batches a step (the groups are gathered again for
    # each backward): the grouped ranks give the numbers of one process, which shards nothing.
    layout = [*OPTION_STEPS, *OPTIONS_OFF, "--parallel.dp_replicate", "1", "--training.grad_accum_steps", "2"]
    single = train(tmp_path / "one", *layout, nproc=1)
    grouped = train(tmp_path / "grouped", *layout, "--parallel.reshard_after_forward", str(group), nproc=RESHARD_RANKS)
    for a, b in zip(single, grouped, strict=True):
        assert abs(a["loss"] - b["loss"]) <= PARITY_TOLERANCE * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= PARITY_TOLERANCE * max(1.0, a["grad_norm"]), (a, b)


def test_compiled_blocks_match_eager(tmp_path: Path) -> None:
    # Slow on CPU (each process compiles the block for ~20 s), so the other tests run eagerly. Both runs in one launch.
    runs = {"eager": ["--parallel.compile", "false"], "compiled": ["--parallel.compile", "true"]}
    numbers = train_several(tmp_path, runs, "--training.steps", "2")
    for a, b in zip(numbers["eager"], numbers["compiled"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a, b)


def test_unknown_config_key_is_rejected(tmp_path: Path) -> None:
    # `python train.py`, run in this process (runs.refused): it stops while parsing, before anything is built.
    result = refused(tmp_path, "--training.stepz", "3")
    assert result.returncode == 2
    assert "unknown key training.stepz" in result.stderr
