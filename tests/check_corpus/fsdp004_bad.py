# ruff: noqa
"""FSDP004: torch.save of sharded state dicts."""

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer

model = Transformer()
fully_shard(model)
torch.save(model.state_dict(), "model.pt")  # expect: FSDP004
state = {"model": model.state_dict(), "step": 10}
torch.save(state, "state.pt")  # expect: FSDP004
torch.save(get_model_state_dict(model), "dcp-api.pt")  # expect: FSDP004
