"""Export a checkpoint as a Hugging Face model folder, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The folder loads like the model it was trained from:

    model = AutoModelForCausalLM.from_pretrained("exported", dtype=torch.float32)

It holds model.safetensors (the trained fp32 weights, written one tensor at a time so that only one is ever
in memory; tied weights once, as transformers saves them), under the names of the files the model came from
(a mixture-of-experts model's fused experts as per-expert weights again, by transformers' reverse conversion:
model.hub_layout), and the other files of the original model folder: config.json, generation_config.json, the
tokenizer. The tokenizer is the run's: data.tokenizer's when the run named one (its files replace the model
folder's), else the model's own.

open_checkpoint (checkpoint_reader.py) reads the weights of any checkpoint style one tensor at a time, as for
scripts/generate.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from checkpoint_reader import CheckpointError, checkpoint_tensors, export_checkpoint, export_parser  # noqa: E402
from model import save_run_tokenizer  # noqa: E402
from model_args import ModelArgs  # noqa: E402


def main() -> None:
    parser = export_parser("Export a checkpoint as a Hugging Face model folder.")
    parser.add_argument("--adapter", action="store_true",
                        help="write the LoRA adapter in PEFT's format instead of the merged model")  # fmt: skip
    args = parser.parse_args()
    checkpoint = export_checkpoint(parser, args)
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
    save_run_tokenizer(config["data"]["tokenizer"], output)
    kind = "adapter (PEFT format)" if adapter_only else "merged model"
    print(f"exported {checkpoint} -> {output}: {kind}, {len(adapters)} adapter tensors on {model_args.path}")


if __name__ == "__main__":
    main()
