"""Export a checkpoint as one safetensors file + config.json, in one CPU process (no GPU, no torchrun).

    python scripts/export.py                                    # the newest checkpoint in outputs/checkpoints
    python scripts/export.py outputs/checkpoints/step-1000 --output exported

The weights then load into a plain, non-distributed model:

    model = Model(ModelArgs(**json.loads(Path("exported/config.json").read_text())))
    model.init_weights(seed=0)  # fills the buffers the model computes (rotary tables); then the weights
    model.load_state_dict(safetensors.torch.load_file("exported/model.safetensors"))

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


def main() -> None:
    parser = export_parser("Export a checkpoint as model.safetensors + config.json.")
    parser.add_argument("--format", choices=["native", "hf"], default="native",
                        help="native: this project's names and config.json (default); hf: a Hugging Face "
                        "transformers folder (the built-in llama only)")  # fmt: skip
    args = parser.parse_args()
    if args.format == "hf":
        # Mixtral routes as this model does only with softmax scores, no shared experts, no dense first blocks,
        # route_scale 1 and routing biases left at 0 (expert_bias_rate 0); Qwen3-MoE adds q/k norms to attention and
        # DeepSeek-V3 (sigmoid scores, biases, shared experts) uses latent attention.
        parser.exit(2, f"{parser.prog}: error: --format hf: no transformers class has this model's experts and "
                    "routing (load-balancing biases that choose experts, shared experts, sigmoid scores); Mixtral "
                    "matches only softmax routing without them, and that conversion is not built; export "
                    "--format native\n")  # fmt: skip
    checkpoint = export_checkpoint(parser, args)
    config, weights, read = open_for_export(parser, checkpoint)

    args.output.mkdir(parents=True, exist_ok=True)
    target = args.output / "model.safetensors"
    partial = args.output / "model.safetensors.tmp"
    write_safetensors(partial, weights, read)
    partial.replace(target)
    (args.output / "config.json").write_text(json.dumps(config["model"], indent=2) + "\n")
    print(f"exported {checkpoint} -> {target} ({len(weights)} tensors) + {args.output / 'config.json'}")


if __name__ == "__main__":
    main()
