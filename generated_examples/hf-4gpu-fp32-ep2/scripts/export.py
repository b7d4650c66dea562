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

import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from checkpoint_reader import export_checkpoint, export_parser, open_for_export, write_safetensors  # noqa: E402
from model import hub_layout, write_side_files  # noqa: E402
from model_args import ModelArgs  # noqa: E402


def main() -> None:
    parser = export_parser("Export a checkpoint as a Hugging Face model folder.")
    args = parser.parse_args()
    checkpoint = export_checkpoint(parser, args)
    config, weights, read = open_for_export(parser, checkpoint)
    model_args = ModelArgs(**config["model"])
    # The names (and per-expert or fused experts) of the files the model came from, as save_pretrained writes.
    weights, read = hub_layout(model_args, weights, read)

    args.output.mkdir(parents=True, exist_ok=True)
    partial = args.output / "model.safetensors.tmp"
    write_safetensors(partial, weights, read)
    partial.replace(args.output / "model.safetensors")
    # config.json, generation_config.json and the tokenizer, as the model came (no other weights), or the run's.
    write_side_files(args.output, model_args, config["data"]["tokenizer"])
    print(f"exported {checkpoint} -> {args.output} ({len(weights)} tensors; the other files of {model_args.path})")


if __name__ == "__main__":
    main()
