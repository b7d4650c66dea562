"""Export a checkpoint as a Hugging Face model folder, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The folder loads like the model it was trained from:

    model = AutoModelForCausalLM.from_pretrained("exported", dtype=torch.float32)

It holds model.safetensors (the trained fp32 weights, written one tensor at a time so that only one is ever
in memory; tied weights once, as transformers saves them) and the other files of the original model
folder: config.json, generation_config.json, the tokenizer.

open_checkpoint, which reads the weights of any checkpoint style one tensor at a time, is scripts/generate.py's too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from model import ModelArgs, tensor_names  # noqa: E402
from preflight import complete_checkpoints, corrupt_file  # noqa: E402

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
# checkpoint_save stores the weights under "train" -> "model"; DCP flattens the keys with dots.
PREFIX = "train.model."


class CheckpointError(Exception):
    """A step-N folder that cannot be read: not a complete checkpoint, or weight files that cannot be opened."""


class CheckpointMismatch(CheckpointError):
    """A step-N folder whose weights are not those of the model in its checkpoint.json."""


def main() -> None:
    parser = argparse.ArgumentParser(description="Export a checkpoint as a Hugging Face model folder.")
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a step-N folder (default: the newest complete one)")
    parser.add_argument("--checkpoints", type=Path, default=Path("outputs/checkpoints"),
                        help="where to look for the newest checkpoint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=Path("exported"), help="output folder (default: %(default)s)")
    parser.add_argument("--adapter", action="store_true",
                        help="write the LoRA adapter in PEFT's format instead of the merged model")  # fmt: skip
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if checkpoint is None:
        complete = complete_checkpoints(args.checkpoints)
        if not complete:
            parser.error(f"no complete checkpoint (step-N folder) in {args.checkpoints}")
        checkpoint = complete[-1]
    if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
        # Never replace what is there: an earlier export may be the only copy of a model.
        parser.error(f"--output {args.output} exists and is not an empty folder; choose a new --output")
    try:
        export_lora(checkpoint, args.output, adapter_only=args.adapter)
    except CheckpointError as error:
        parser.exit(2, f"{error}\n")
    return


def export_lora(checkpoint: Path, output: Path, adapter_only: bool) -> None:
    """The pretrained model with the checkpoint's LoRA adapters: merged into its weights (a from_pretrained
    folder), or as an adapter folder in PEFT's format (adapter_config.json + adapter_model.safetensors), which
    `PeftModel.from_pretrained(base_model, output)` loads. Holds the whole base model in memory (one CPU process).
    """
    try:
        config = json.loads((checkpoint / "checkpoint.json").read_text())["config"]
        model_args, lora = ModelArgs(**config["model"]), config["lora"]
        found, read = checkpoint_tensors(checkpoint)
    except Exception as error:  # a missing or damaged file: each library raises its own kinds
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint ({type(error).__name__}: {error})") from None
    base = AutoModelForCausalLM.from_pretrained(model_args.folder, dtype=torch.float32)
    settings = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                          target_modules=lora["target_modules"])  # fmt: skip
    model = get_peft_model(base, settings)
    # The checkpoint names the adapters as in the model train.py built (peft's layers injected in place); the
    # PEFT wrapper adds its own prefix.
    adapters = {"base_model.model." + name: read(name) for name in found}
    expected = {name for name, param in model.named_parameters() if param.requires_grad}
    if set(adapters) != expected:
        raise CheckpointError(
            f"{checkpoint} holds other adapters than [lora] in its checkpoint.json describes: missing "
            f"{sorted(expected - set(adapters))[:3]}, unexpected {sorted(set(adapters) - expected)[:3]}"
        )
    model.load_state_dict(adapters, strict=False)
    output.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        model.save_pretrained(output)
    else:
        model.merge_and_unload().save_pretrained(output)
    for source in model_args.folder.iterdir():
        # The tokenizer (and, merged, the generation config) as the model came.
        if source.is_file() and source.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat")):
            shutil.copyfile(source, output / source.name)
    kind = "adapter (PEFT format)" if adapter_only else "merged model"
    print(f"exported {checkpoint} -> {output}: {kind}, {len(adapters)} adapter tensors on {model_args.path}")


def open_checkpoint(checkpoint: Path) -> tuple[dict, dict[str, tuple], Callable[[str], torch.Tensor]]:
    """The config of the run that wrote a step-N folder (its checkpoint.json), {name: (dtype, shape)} of the
    model's weights in it, and a function reading one weight as a whole CPU tensor, so that only one need be in
    memory at a time. Any checkpoint style. Of the names of a tied tensor only the first is listed (the input
    embedding), as in transformers' own files.

    Raises CheckpointError, or CheckpointMismatch when the weights are not those of the model it names.
    """
    try:
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        config = info["config"]
        model_args = ModelArgs(**config["model"])
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint ({error})") from None
    # Every file against the size and checksum recorded at save (checkpoints of older projects have none).
    files = info.get("files", {})
    problem = corrupt_file(checkpoint, files, sorted(files)) if isinstance(files, dict) else "files: not a table"
    if problem is not None:
        raise CheckpointError(f"{checkpoint} is corrupt ({problem}); export an older checkpoint")
    if "lora" in config:
        raise CheckpointError(
            f"{checkpoint} holds LoRA adapters, not the whole model: write the merged model with "
            "scripts/export.py, then use that folder (generate.py --exported)"
        )
    # Names and shapes of the weights: the model built on the meta device, which allocates nothing.
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_args.hf_config)
    except (OSError, ValueError) as error:  # the model folder (or the hub's copy) is gone or damaged
        raise CheckpointError(
            f"{checkpoint}: the config of its model {model_args.path} cannot be read ({error})"
        ) from None
    state = model.state_dict()
    order = {name: index for index, name in enumerate(state)}
    keep = {min(group, key=order.get) for group in tensor_names(model).values()}
    expected = {name: tuple(tensor.shape) for name, tensor in state.items() if name in keep}
    try:
        found, read = checkpoint_tensors(checkpoint)
    except Exception as error:  # a missing or damaged file: each library raises its own kinds
        raise CheckpointError(f"{checkpoint}: its weights cannot be read ({type(error).__name__}: {error})") from None
    missing = sorted(expected.keys() - found.keys())
    reshaped = sorted(name for name in expected.keys() & found.keys() if tuple(found[name][1]) != expected[name])
    if missing or reshaped:
        raise CheckpointMismatch(
            f"{checkpoint} does not match {model_args.path}: missing {missing}, different shapes {reshaped}"
        )
    return config, {name: found[name] for name in expected}, read


def checkpoint_tensors(checkpoint: Path) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor]]:
    """{name: (dtype, shape)} of the checkpoint's weights, and a function reading one full tensor."""
    reader = dcp.FileSystemReader(checkpoint)
    found = {
        key.removeprefix(PREFIX): (entry.properties.dtype, tuple(entry.size))
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    # dcp.load without a process group warns that it assumes a single process, which is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    def read(name: str) -> torch.Tensor:
        dtype, shape = found[name]
        tensor = torch.empty(shape, dtype=dtype)
        # DCP assembles the full tensor from the shards that every rank wrote.
        dcp.load({PREFIX + name: tensor}, storage_reader=reader, no_dist=True)
        return tensor

    return found, read


def write_safetensors(path: Path, entries: dict[str, tuple], read: Callable[[str], torch.Tensor]) -> None:
    """Write the tensors of `entries` ({name: (dtype, shape)}) to `path`, reading and writing one at a time.

    The safetensors format: an 8-byte little-endian header length, a JSON header giving each tensor's
    dtype, shape and byte range, then the raw little-endian bytes in that order.
    """
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in entries.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        span = [offset, offset + size]
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": span}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in entries:
            f.write(read(name).contiguous().reshape(-1).view(torch.uint8).numpy())


if __name__ == "__main__":
    main()
