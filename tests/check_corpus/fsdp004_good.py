# ruff: noqa
"""FSDP004 done right: DCP for sharded saves, full state dicts for torch.save."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer

model = Transformer()
fully_shard(model)
dcp.save({"model": model.state_dict()}, checkpoint_id="checkpoints/step-10")
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
options = StateDictOptions(full_state_dict=True)
also_full = get_model_state_dict(model, options=options)
if dist.get_rank() == 0:
    torch.save(full, "model.pt")
    torch.save(also_full, "model-again.pt")

probe = torch.nn.Linear(8, 8)
torch.save(probe.state_dict(), "probe.pt")
