"""Find every mistake in the configuration, the data and the output folder before any rank starts.

The launch scripts run this once, in one process, before torchrun: `python preflight.py --world-size 8 --config
config.toml --training.steps 100`. A mistake prints one line naming it and the fix, and exits with
errors.USAGE_ERROR (2): torchrun never starts, so nothing is printed once per rank, and nothing is retried by
--max-restarts, which stays for real faults (a killed process, a lost node). train.py runs the same checks on rank 0
before it builds the model, for runs started some other way (`torchrun train.py`, Ray).

This module orders the checks. The modules whose files or settings they are check them, and their errors become
that one line here: data.py, checkpoint_files.py, run_folder.py, profiling.py.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    gc.disable()  # until torch's import-time objects are frozen in main(): as in train.py, which says why

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

import run_folder
from checkpoint_files import CheckpointFolderError, check_free_space
from config import Config, parse_args
from data import DataError, check_token_data
from errors import reason, stop
from layout import LayoutError, ParallelLayout
from model import block_classes, build_model, document_mask_error
from profiling import ProfileError, check_profile
from run_folder import RunFolderError
from schema import total_memory

# The errors of the rooms above, each a line that names the mistake and its fix.
ROOM_ERRORS = (
    LayoutError,
    DataError,
    CheckpointFolderError,
    RunFolderError,
    ProfileError,
)


class PreflightError(Exception):
    """A mistake in what the user gave: the message is one line that names it and the fix."""


def preflight(config: Config, world_size: int) -> None:
    """Raise PreflightError for the first mistake that would stop (or silently spoil) a run on `world_size` ranks."""
    with one_line():
        check_environment(config)
        vocab_size, max_seq_len = model_limits(config)
        check_layout(config, world_size, max_seq_len)
        model = meta_model(config)
        check_memory(config, world_size, vocab_size, model)
        check_shard_modules(config, model)
        check_document_mask(config, world_size, model)
        check_data(config, vocab_size)
        output_dir = Path(config.job.output_dir)
        run_folder.check_not_inside_a_run(output_dir)  # before check_output_dir creates it
        run_folder.check_output_dir(output_dir)
        run_folder.check_not_in_use(output_dir)
        run_folder.check_run_folder(config)
        check_free_space([*model.parameters(), *model.buffers()], output_dir / "checkpoints")


def start_run(output_dir: Path, config: Config, launch_ids: list[str]) -> str:
    """run_folder.start_run (rank 0, after preflight(): lock, check again, record the run) raising PreflightError."""
    with one_line():
        return run_folder.start_run(output_dir, config, launch_ids)


@contextmanager
def one_line() -> Iterator[None]:
    """A room's error as PreflightError: its message is already the one line."""
    try:
        yield
    except ROOM_ERRORS as exc:
        raise PreflightError(str(exc)) from None


def check_environment(config: Config) -> None:
    """What the job asks of this machine and its Python packages."""
    if config.job.device == "cuda" and not torch.cuda.is_available():
        raise PreflightError("job.device = 'cuda' but no CUDA device is visible; use --job.device cpu")
    check_profile(config.profile, config.training.steps, config.job.device)


def model_limits(config: Config) -> tuple[int, int]:
    """The model's vocabulary size and longest sequence; a failure to load its config (hf) as one line."""
    try:
        return config.model.vocab_size, config.model.max_seq_len
    except Exception as exc:  # whatever the model's loader raises: a missing folder, a bad hub id, no network
        settings = ", ".join(f"{key}={value!r}" for key, value in asdict(config.model).items())
        message = f"the model ({settings}) cannot be loaded ({reason(exc)}); fix the [model] section"
        raise PreflightError(message) from None


def meta_model(config: Config) -> torch.nn.Module:
    """config's model built on the meta device: its classes and sizes for the checks below, nothing allocated."""
    try:
        with torch.device("meta"):
            return build_model(config)
    except Exception as exc:  # a shape the model's own code refuses
        raise PreflightError(f"the model cannot be built ({reason(exc)}); fix the [model] section") from None


def check_layout(config: Config, world_size: int, max_seq_len: int) -> None:
    """The batch, the sequence length and the mesh must fit the number of ranks."""
    training = config.training
    if training.seq_len > max_seq_len:
        raise PreflightError(
            f"training.seq_len ({training.seq_len}) exceeds config.json's max_position_embeddings ({max_seq_len}); "
            f"use --training.seq_len {max_seq_len} or less"
        )
    # The mesh, the model and batch split over it, tp groups inside a node: layout.py's arithmetic, as train.py's.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's (the launch scripts' for rank 0's)
    ParallelLayout.of(config.parallel, world_size).check(training, config.model, per_node)


def check_memory(config: Config, world_size: int, vocab_size: int, model: torch.nn.Module) -> None:
    """What each rank must hold at least, against what this machine has (its RAM plus one GPU's memory), before
    anything is allocated: a shape or batch that cannot fit is one line here, not an out-of-memory crash on every rank.
    A lower bound, so it never refuses a run that fits: 16 bytes per model value (fp32 weights, gradients and Adam's
    two moments) split over the ranks, and 8 bytes per logit of one micro-batch (fp32 logits and log-probabilities)."""
    training = config.training
    available = total_memory()
    if config.job.device != "cpu" and torch.cuda.is_available():
        available += torch.cuda.get_device_properties(0).total_memory
    values = sum(tensor.numel() for tensor in [*model.parameters(), *model.buffers()])
    model_bytes = 16 * values // world_size
    micro_batch = -(-training.global_batch_size // (world_size * training.grad_accum_steps))
    logit_bytes = 8 * micro_batch * training.seq_len * vocab_size
    if model_bytes + logit_bytes > available:
        raise PreflightError(
            f"each of the {world_size} ranks needs at least {model_bytes / 2**30:.1f} GiB for the model and its "
            f"optimizer state and {logit_bytes / 2**30:.1f} GiB for a micro-batch's logits, more than this "
            f"machine's {available / 2**30:.1f} GiB; use a smaller [model], --training.global_batch_size or "
            "--training.seq_len, more --training.grad_accum_steps, or more ranks"
        )


def check_shard_modules(config: Config, model: torch.nn.Module) -> None:
    """parallel.shard_modules names classes of the model (`model`: built on the meta device)."""
    names = block_classes(model, config.parallel.shard_modules)
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    modules = [module for module in model.modules() if not isinstance(module, containers)]
    classes = sorted({type(module).__name__ for module in modules})
    unmatched = [name for name in names if name not in classes]
    if unmatched or not names:
        raise PreflightError(
            f"parallel.shard_modules: no module of class {', '.join(unmatched or names) or '(none listed)'} in the "
            f"model; list the class(es) of its repeated blocks (classes in the model: {', '.join(classes)})"
        )


def check_document_mask(config: Config, world_size: int, model: torch.nn.Module) -> None:
    """With data.document_mask, transformers must mask attention between the documents packed in a row, for this
    model and attention implementation (model.document_mask_error's probe). Checked once, here, on the meta model."""
    if config.data.document_mask and config.data.path:  # synthetic tokens have no documents
        layout = ParallelLayout.of(config.parallel, world_size)
        rows = config.training.global_batch_size // (layout.data_ranks * config.training.grad_accum_steps)
        error = document_mask_error(model, rows)
        if error:
            raise PreflightError(error)


def check_data(config: Config, vocab_size: int) -> None:
    """data.path (and, with eval.every, its validation split) holds enough valid samples for this run."""
    if not config.data.path:
        return  # synthetic tokens: always valid, and validation has its own held-out synthetic samples
    val_samples = config.eval.batches * config.training.global_batch_size if config.eval.every else 0
    documents = config.data.document_mask  # the data must record where documents start
    check_token_data(Path(config.data.path), config.training.seq_len, vocab_size, val_samples, documents)


def main() -> None:
    gc.freeze()  # torch's import-time objects outlive the check: the collector's full passes skip them
    gc.enable()
    # --world-size first, then exactly train.py's arguments, read by train.py's parser: one parser for both.
    argv = sys.argv[1:]
    world_size = argv[1] if argv[:1] == ["--world-size"] and len(argv) > 1 else ""
    if not (world_size.isascii() and world_size.isdigit() and int(world_size) >= 1):
        stop(f"the first arguments must be --world-size N (the run's ranks, at least 1), got {shlex.join(argv[:2])}")
    try:
        preflight(parse_args(argv[2:]), int(world_size))
    except PreflightError as exc:
        stop(str(exc))


if __name__ == "__main__":
    main()
