"""Export a checkpoint as one safetensors file + config.json, or (--format hf) as a Hugging Face transformers
folder, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported
    python scripts/export.py --format hf --output exported-hf   # AutoModelForCausalLM.from_pretrained loads it

The weights then load into a plain, non-distributed model:

    model = Model(ModelArgs(**json.loads(Path("exported/config.json").read_text())))
    model.init_weights(seed=0)  # fills the buffers the model computes (rotary tables); then the weights
    model.load_state_dict(safetensors.torch.load_file("exported/model.safetensors"))

--format hf writes LlamaForCausalLM's folder: model.safetensors under transformers' names (hf_checkpoint.py maps
them), config.json, generation_config.json and the tokenizer's files, which transformers, vLLM, lm-eval and the
Hub read as they are.

open_checkpoint (checkpoint_reader.py) reads the weights of any checkpoint style one tensor at a time, as for
scripts/generate.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))
from checkpoint_reader import export_checkpoint, export_parser, open_for_export, write_safetensors  # noqa: E402
from hf_checkpoint import hf_layout, write_hf_side_files  # noqa: E402
from model_args import ModelArgs  # noqa: E402


def main() -> None:
    parser = export_parser("Export a checkpoint as model.safetensors + config.json.")
    parser.add_argument("--format", choices=["native", "hf"], default="native",
                        help="native: this project's names and config.json (default); hf: a Hugging Face "
                        "transformers folder")  # fmt: skip
    args = parser.parse_args()
    checkpoint = export_checkpoint(parser, args)
    config, weights, read = open_for_export(parser, checkpoint)

    args.output.mkdir(parents=True, exist_ok=True)
    target = args.output / "model.safetensors"
    partial = args.output / "model.safetensors.tmp"
    if args.format == "hf":
        model_args = ModelArgs(**config["model"])
        # transformers' names (hf_checkpoint.py), one tensor in memory at a time.
        layout, read_key = hf_layout(weights, read, model_args.tie_embeddings)
        write_safetensors(partial, layout, read_key)
        partial.replace(target)
        hf_source = config["model"].get("hf_checkpoint", "")
        write_hf_side_files(args.output, model_args, config["data"]["tokenizer"], hf_source)
        architecture = json.loads((args.output / "config.json").read_text())["architectures"][0]
        print(f"exported {checkpoint} -> {args.output} (Hugging Face {architecture}, {len(layout)} tensors)")
        return
    write_safetensors(partial, weights, read)
    partial.replace(target)
    (args.output / "config.json").write_text(json.dumps(config["model"], indent=2) + "\n")
    print(f"exported {checkpoint} -> {target} ({len(weights)} tensors) + {args.output / 'config.json'}")


if __name__ == "__main__":
    main()
