"""Run under torchrun in a generated hf project (test_hf_moe.py), with a mixture-of-experts model folder:

    torchrun ... hf_moe_probe.py FOLDER [FOLDER ...] [--blind-load FOLDER] [--section.key VALUE ...]

For each FOLDER in turn (one launch for several models): the sharded model built by train.py from FOLDER
(pretrained weights) against transformers' from_pretrained(FOLDER) in one process, on the same tokens, fp32. Each
rank prints one JSON line per folder ("probe {...}", its "folder" named):
- experts_read: the experts each per-expert checkpoint tensor this rank read from the files came from (by
  model.read_part, which returns None for an expert of another rank's shard), as {layer: sorted experts};
- weights_differ: the weights of from_pretrained's model that the sharded model's (gathered) differ from (rank 0);
- logits_diff: max |diff| of the logits, in eval mode (a --lora project: after the adapters are set to nonzero
  values, against peft's model with the same values, so that the adapters on the experts count; base_diff:
  against the model without adapters);
- loss_diff (config.json with output_router_logits): the training loss (reduction "mean", model.train()) against
  transformers' own loss with the labels (cross-entropy + router_aux_loss_coef x its balance loss), and
  sum_diff: reduction "sum" against the mean x the targets; load_max_mean, load_min_mean: balance_experts'
  figures after those forwards and the reference's (from its router logits).
--blind-load FOLDER: then hf_load_probe.py's --blind check of FOLDER in the same launch (rank 1 does not see it:
rank 0 reads, converts and broadcasts), its lines ("warning: ...", "blind: equal") as that probe prints them.
--then-train RUNS.json: last, in the same launch, the training runs of RUNS.json (then_train.py).
"""

import json
import re
import sys
from pathlib import Path

import model as model_module
import torch
import torch.distributed as dist
from model import ModelArgs
from then_train import take_option, train_runs  # beside this file (sys.path[0])
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from train import build_model_meta, run_on_every_rank
from transformers import AutoModelForCausalLM


def main() -> None:
    count = next((i for i, arg in enumerate(sys.argv[1:]) if arg.startswith("--")), len(sys.argv) - 1)
    folders, args = [Path(arg) for arg in sys.argv[1 : 1 + count]], sys.argv[1 + count :]
    blind = None
    if "--blind-load" in args:
        at = args.index("--blind-load")
        blind, args = Path(args[at + 1]), args[:at] + args[at + 2 :]
    runs, args = take_option(args, "--then-train")

    def probe_all(config, device, mesh) -> int:
        for folder in folders:
            probe(config, device, mesh, folder)
        if blind is not None:
            import hf_load_probe  # beside this file (sys.path[0])

            hf_load_probe.check(config, device, mesh, blind, blind=True)
        return train_runs(runs, device)

    def probe(config, device, mesh, folder: Path) -> None:
        config.model = ModelArgs(path=str(folder), pretrained=True)
        experts_read: dict[str, set[int]] = {}
        read_part = model_module.read_part

        def recording(source, sharding, index, dtype):
            part = read_part(source, sharding, index, dtype)
            if part is not None and sharding is not None:
                experts_read.setdefault(re.search(r"layers\.(\d+)\.", str(source_names.get(id(source)))).group(1),
                                        set()).add(index)  # fmt: skip
            return part

        # read_part gets a safetensors slice, which does not know its name: the names of the slices handed out.
        source_names: dict[int, str] = {}
        safe_open = model_module.safe_open

        class NamingFile:
            def __init__(self, path, framework):
                self.file = safe_open(path, framework=framework)

            def get_slice(self, key):
                part = self.file.get_slice(key)
                source_names[id(part)] = key
                return part

            def __getattr__(self, name):
                return getattr(self.file, name)

            def __enter__(self):
                return self.file.__enter__()

            def __exit__(self, *exc):
                return self.file.__exit__(*exc)

        model_module.read_part, model_module.safe_open = recording, NamingFile
        model = build_model_meta(config, mesh, device)
        model_module.read_part, model_module.safe_open = read_part, safe_open

        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokens = torch.randint(config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            base_logits = reference(tokens).logits
        # A collective: rank 0 gets every full tensor (peft's adapted layers: their weight under base_layer).
        gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered = {re.sub(r"(\.base_layer)+\.", ".", name): tensor for name, tensor in gathered.items()}
        weights_differ = [name for name, tensor in reference.state_dict().items()
                          if dist.get_rank() == 0 and not torch.equal(gathered[name], tensor)]  # fmt: skip
        lora = getattr(config, "lora", None)
        if lora is not None:
            # Nonzero adapters (B starts at zero), the same on every rank, into the sharded model and peft's.
            from peft import LoraConfig, get_peft_model

            # A collective: rank 0 gets every full tensor; every rank draws the same values from the shapes.
            shapes = {name: tensor.shape for name, tensor in get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ).items() if ".lora_" in name}  # fmt: skip
            shared = [shapes]
            dist.broadcast_object_list(shared, src=0)
            generator = torch.Generator().manual_seed(1)
            adapters = {
                name: torch.randn(shape, generator=generator) * 0.1 for name, shape in sorted(shared[0].items())
            }
            # A copy: set_model_state_dict replaces the values of the dict it is given with the sharded ones.
            set_model_state_dict(model, dict(adapters), options=StateDictOptions(full_state_dict=True, strict=False))
            settings = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                  target_modules=lora.target_modules)  # fmt: skip
            reference = get_peft_model(reference, settings)
            missing = reference.load_state_dict({"base_model.model." + k: v for k, v in adapters.items()}, strict=False)
            assert not missing.unexpected_keys, missing.unexpected_keys
        targets = torch.roll(tokens, -1, dims=1)
        targets[0, :3] = -100  # some targets not counted (IGNORE), as a chat prompt's
        report = {"folder": str(folder), "rank": dist.get_rank(),
                  "experts_read": {k: sorted(v) for k, v in experts_read.items()},
                  "weights_differ": weights_differ}  # fmt: skip
        model.eval()
        reference.eval()
        with torch.no_grad():
            logits = model(tokens.to(device)).logits.cpu()
            report["logits_diff"] = (logits - reference(tokens).logits).abs().max().item()
            report["base_diff"] = (logits - base_logits).abs().max().item()  # > 0 with adapters: they count
        if model.config.output_router_logits:
            model.train()
            reference.train()
            with torch.no_grad():
                mean = model_module.loss(model, tokens.to(device), targets.to(device), reduction="mean")
                total = model_module.loss(model, tokens.to(device), targets.to(device), reduction="sum")
                output = reference(tokens, labels=targets, shift_labels=targets)
                expected = output.loss
            report["loss_diff"] = (mean.cpu() - expected).abs().item()
            # The load figures of those two forwards on every rank (4 x each expert's tokens: the same ratios)
            # against the reference's routing: each token's top-k experts by router logits (Qwen3-MoE's, Mixtral's).
            figures = model_module.balance_experts(model, config)
            loads = torch.stack(
                [
                    torch.bincount(
                        logits.topk(model.config.num_experts_per_tok).indices.flatten(), minlength=logits.shape[-1]
                    ).float()
                    for logits in output.router_logits
                ]
            )
            average = loads.mean(dim=-1)
            report["load_max_mean"] = [
                figures["moe_load_max_mean"].item(),
                (loads.max(-1).values / average).max().item(),
            ]
            report["load_min_mean"] = [
                figures["moe_load_min_mean"].item(),
                (loads.min(-1).values / average).min().item(),
            ]
            report["sum_diff"] = (total.cpu() - mean.cpu() * (targets != -100).sum()).abs().item()
            report["loss"] = mean.item()
        sys.stdout.write("probe " + json.dumps(report) + "\n")
        sys.stdout.flush()

    run_on_every_rank(probe_all, args)


if __name__ == "__main__":
    main()
