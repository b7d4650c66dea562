"""Full (unsharded) checkpoints, gathered on rank 0 and written by it: model.safetensors and train_state.pt.

train.py's checkpoint_save and checkpoint_load call the Checkpointer; checkpoint_common.py holds what every
checkpoint style shares (the TrainState, the step-N/ folders, checkpoint.json, the RNG states).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from checkpoint_common import CheckpointerBase, TrainState, checkpoint_info, publish, save_failed, save_hf_checkpoint
from checkpoint_files import file_record
from errors import reason, stop_if_rank0_failed


class Checkpointer(CheckpointerBase):
    """Saves into and resumes from checkpoint_dir/step-N/, one full checkpoint per save, written by rank 0."""

    def save(self, state: TrainState) -> None:
        """Gather full tensors on rank 0, which writes step-N.tmp/ and renames it to step-N/.

        model.safetensors holds the weights; train_state.pt the optimizer, scheduler, step and every rank's
        RNG states. A crash mid-save leaves only a .tmp folder, which resume ignores; a failed write (a full disk)
        removes it and stops every rank in one line.
        """
        config, checkpoint_dir = self.config, self.checkpoint_dir
        model_only = self.model_only_save(state)
        # Collectives, so every rank calls them; with cpu_offload only rank 0 receives the full tensors, in
        # CPU memory (the others get empty dicts), so no GPU ever holds the whole model.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(state.model, options=options)
        train_state = None
        if not model_only:
            optimizer_state = get_optimizer_state_dict(state.model, state.optimizer, options=options)
            rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(state.rng_state(), rngs, dst=0)
            train_state = {"optimizer": optimizer_state, **state.progress(), "rng": rngs}
        staging = checkpoint_dir / f"step-{state.step}.tmp"
        error = None
        if dist.get_rank() == 0:
            try:
                # Leftovers of crashed saves: never complete, never resumed from.
                for leftover in checkpoint_dir.glob("step-*.tmp"):
                    shutil.rmtree(leftover)
                staging.mkdir(parents=True)
                save_file(unshared(model_state), staging / "model.safetensors")
                if train_state is not None:
                    # Right away: the `step` entries of the gathered optimizer state are the optimizer's own
                    # (live) tensors, which the next optimizer step changes. Through a Python file: a failed
                    # write then keeps its OSError (a full disk), which torch.save's own error does not name.
                    with open(staging / "train_state.pt", "wb") as file:
                        torch.save(train_state, file)
                files = {path.name: file_record(path) for path in sorted(staging.iterdir())}
                info = checkpoint_info(state, config, model_only) | {"files": files}
                publish(staging, info, config.checkpoint.keep_last)
            except Exception as exc:
                error = save_failed(staging, exc)
        stop_if_rank0_failed(error)
        if config.checkpoint.save_format == "hf":  # also a Hugging Face folder, outside step-N/
            save_hf_checkpoint(state.model, checkpoint_dir.parent / "hf", state.step, config)

    def load_state(self, path: Path, info: dict, state: TrainState) -> str | None:
        """Load the checkpoint `path` into `state`, on any number of ranks; None, or why its tensors cannot be
        loaded (e.g. weights of another shape than this model's).

        Only rank 0 reads the files; the tensors then go out from it one by one, and every rank keeps
        only its own shards of each (broadcast_from_rank0).
        """
        model_state, train_state, error = {}, {}, None
        if dist.get_rank() == 0:
            try:
                model_state = load_file(path / "model.safetensors")
                train_state = torch.load(path / "train_state.pt", weights_only=True)
                error = mismatch(state.model, model_state)
            except Exception as exc:
                error = reason(exc)
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is not None:
            return shared[0]
        # The small part (scheduler, step, RNG states) goes to every rank as one object.
        shared = [{key: value for key, value in train_state.items() if key != "optimizer"}]
        dist.broadcast_object_list(shared, src=0)
        saved = shared[0]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(state.model, model_state, options=options)
        set_optimizer_state_dict(state.model, state.optimizer, train_state.get("optimizer", {}), options=options)
        state.restore_progress(saved)
        # RNG streams belong to ranks: they continue only if the ranks are the same as when saved.
        if info["world_size"] == dist.get_world_size() and info["device"] == state.device.type:
            state.restore_rng_state(saved["rng"][dist.get_rank()])
        return None


def mismatch(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> str | None:
    """Why the weights `saved` do not fit `model` (other names or shapes), before any is loaded; None if they do."""
    # Named as the save names them (without the prefixes of activation checkpointing's and compile's wrappers);
    # sharded (DTensor) parameters by their whole shape. No collective: the model's own sharded state.
    expected = {name: tuple(value.shape) for name, value in get_model_state_dict(model).items()}
    found = {name: tuple(value.shape) for name, value in saved.items()}
    if found.keys() == expected.keys() and all(found[name] == expected[name] for name in found):
        return None
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    reshaped = [f"{name} {found[name]} (model: {expected[name]})" for name in sorted(found.keys() & expected.keys())
                if found[name] != expected[name]]  # fmt: skip
    parts = (
        [f"missing {', '.join(missing[:3])}"] * bool(missing)
        + [f"unexpected {', '.join(unexpected[:3])}"] * bool(unexpected)
        + [f"other shapes: {', '.join(reshaped[:3])}"] * bool(reshaped)
    )
    return "its weights do not fit the model in its checkpoint.json: " + "; ".join(parts)


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a copy of each tensor whose memory an earlier one uses, for safetensors, which refuses shared
    memory. Tied weights (one parameter, two names) arrive as one tensor when a single rank holds them whole."""
    seen, copies = set(), {}
    for name, tensor in state.items():
        memory = tensor.untyped_storage().data_ptr()
        copies[name] = tensor.clone() if memory in seen else tensor
        seen.add(memory)
    return copies
