"""Run under torchrun in a generated llama project made with --hf-model (test_hf_llama.py): the sharded model that
train.py builds (any layout: FSDP, tensor and pipeline parallel) must hold transformers' weights of
model.hf_checkpoint bit for bit, and give transformers' logits.

    torchrun ... hf_llama_probe.py [--train] [--layouts LAYOUTS.json] [--section.key VALUE ...]

Rank 0 prints "weights: N equal" (or "weights differ: NAMES"), "sharded logits max |diff| D" (layouts without
pipeline stages: the sharded model's own forward) and "plain logits max |diff| D" (the gathered weights in a plain
Model, whose forward is the one every layout runs). --train: then train.py's own train() runs with the same config.
--layouts: the check once per layout of LAYOUTS.json ({name: [--section.key VALUE ...] added to the arguments}), each
with its own config and mesh, in one launch; rank 0 prints "layout NAME" before each one's lines.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from config import parse_args
from hf_checkpoint import from_hf, to_hf_key
from layout import ParallelLayout
from model import Model, output_logits
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from train import build_model_meta, run_on_every_rank, train
from transformers import AutoModelForCausalLM


def main() -> None:
    args = sys.argv[1:]
    then_train = "--train" in args
    args = [arg for arg in args if arg != "--train"]
    layouts = None
    if "--layouts" in args:
        at = args.index("--layouts")
        layouts, args = json.loads(Path(args[at + 1]).read_text()), args[:at] + args[at + 2 :]

    def check_layouts(_config, device, _mesh) -> int:
        for name, overrides in layouts.items():
            config = parse_args([*args, *overrides])
            mesh = ParallelLayout.of(config.parallel, dist.get_world_size()).build_mesh(device.type)
            dist.barrier()  # every rank has finished the layout before
            if dist.get_rank() == 0:
                print(f"layout {name}", flush=True)
            check(config, device, mesh)
        return 0

    def check(config, device, mesh) -> int:
        model = build_model_meta(config, mesh, device)
        folder = Path(config.model.hf_checkpoint)
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = reference.state_dict()
        tokens = torch.randint(config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = reference(tokens).logits
        # pipeline.py's PipelineModel: this rank's stages, under the whole model's names; it runs only a schedule.
        pipelined = hasattr(model, "schedule")
        # This rank's whole tensors (all-gathered over the FSDP and tensor-parallel ranks), then every rank's.
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        mine = {name: tensor.cpu() for name, tensor in full.items()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if not pipelined:
            model.eval()
            with torch.no_grad():
                sharded = output_logits(model(tokens.to(device)))
            if isinstance(sharded, DTensor):  # tensor parallelism's output layer: the vocabulary split
                sharded = sharded.full_tensor()
            sharded = sharded.float().cpu()
            if dist.get_rank() == 0:
                print(f"sharded logits max |diff| {(sharded - logits).abs().max().item():.3g}", flush=True)
        if dist.get_rank() == 0:
            gathered = {name: tensor for state in everyone for name, tensor in state.items()}
            differ = [name for name, tensor in gathered.items() if not torch.equal(tensor, expected[to_hf_key(name)])]
            covered = {to_hf_key(name) for name in gathered}
            differ += [f"(none has {key})" for key in expected if key not in covered]
            print(f"weights differ: {' '.join(differ)}" if differ else f"weights: {len(gathered)} equal", flush=True)
            plain = Model(config.model)
            plain.init_weights(seed=1)
            plain.load_state_dict(from_hf(expected, config.model.tie_embeddings))
            with torch.no_grad():
                ours = plain.eval()(tokens)
            print(f"plain logits max |diff| {(ours - logits).abs().max().item():.3g}", flush=True)
        if then_train:
            model.train()
            del model
            train(config, device, mesh)
        return 0

    run_on_every_rank(check if layouts is None else check_layouts, args)


if __name__ == "__main__":
    main()
