"""Run under torchrun inside a generated `--lora` project (PYTHONPATH = the project) by test_lora.py.

Loads the newest checkpoint with train.py's own blocks, then rank 0 writes $PROBE_OUT (JSON): whether every frozen
weight equals the pretrained file's bit for bit, the norm of each adapter, and per rank the optimizer state's size
next to the adapters' and the frozen weights' local sizes; and, beside it, model_output.pt: the sharded model's
output on a fixed input, as the project's tests/model_output.py writes it (the same launch, not another).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint import Checkpointer, TrainState
from config import parse_args
from model import output_logits
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from train import build_model_meta, build_optimizer, checkpoint_load, close_process_group, init_distributed

config = parse_args(sys.argv[1:])
device, mesh = init_distributed(config)
model = build_model_meta(config, mesh, device)
optimizer, scheduler = build_optimizer(model, config.training, device)
state = TrainState(model, optimizer, scheduler, config.training.global_batch_size, device, run_id="probe")
checkpointer = Checkpointer(Path(config.job.output_dir) / "checkpoints", config)
assert checkpoint_load(state, checkpointer) is not None
checkpointer.close()


def local_numel(tensor: torch.Tensor) -> int:
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()


optimizer_state = sum(local_numel(v) for s in optimizer.state.values() for v in s.values() if v.ndim > 0)
adapters = sum(local_numel(p) for p in model.parameters() if p.requires_grad)
frozen = sum(local_numel(p) for p in model.parameters() if not p.requires_grad)
sizes = [None] * dist.get_world_size()
dist.all_gather_object(sizes, {"optimizer_state": optimizer_state, "adapters": adapters, "frozen": frozen})
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
# tests/model_output.py's input and output: every rank computes the whole output with the all-gathered weights.
tokens = torch.randint(
    config.model.vocab_size, (2, config.training.seq_len), generator=torch.Generator().manual_seed(0)
)
model.eval()
with torch.no_grad():
    logits = output_logits(model(tokens.to(device))).float().cpu()
if dist.get_rank() == 0:
    torch.save({"tokens": tokens, "logits": logits}, Path(os.environ["PROBE_OUT"]).with_name("model_output.pt"))
    pretrained = load_file(config.model.folder / "model.safetensors")
    base = {name.replace(".base_layer.", "."): tensor for name, tensor in full.items() if ".lora_" not in name}
    report = {
        "frozen_equal": sorted(name for name in pretrained if torch.equal(pretrained[name], base[name])),
        "frozen_names": sorted(pretrained),
        "adapter_norms": {name: tensor.norm().item() for name, tensor in full.items() if ".lora_" in name},
        "sizes": sizes,
    }
    Path(os.environ["PROBE_OUT"]).write_text(json.dumps(report))
close_process_group()
