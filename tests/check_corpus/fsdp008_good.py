# ruff: noqa
"""FSDP008 done right: weights_only=True; other libraries' load() are not torch.load."""

import json

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

state = torch.load("model.pt", weights_only=True, map_location="cpu")
dcp.load(state, checkpoint_id="checkpoints/step-10")
config = json.load(open("config.json"))
array = np.load("tokens.npy")
