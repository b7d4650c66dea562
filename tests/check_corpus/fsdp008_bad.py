# ruff: noqa
"""FSDP008: torch.load without weights_only=True, through aliases too."""

import torch as th
from torch import load

state = th.load("model.pt")  # expect: FSDP008
state = th.load("model.pt", weights_only=False)  # expect: FSDP008
state = load("model.pt", map_location="cpu")  # expect: FSDP008
