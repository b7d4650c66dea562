"""Run inside a generated hf project (PYTHONPATH = the project): build the project's model (model.build_model,
LoRA adapters included) from its config.toml on the meta device, as train.py does, and print every parameter's
name, shape and requires_grad as JSON, for tests/test_plan_families.py to compare with `fsdp2gen plan`.

Usage: python plan_family_probe.py config.toml
"""

from __future__ import annotations

import json
import sys

import torch
from config import load_config
from model import build_model

if __name__ == "__main__":
    config = load_config(sys.argv[1])
    with torch.device("meta"):
        model = build_model(config)
    parameters = [[name, list(p.shape), p.requires_grad] for name, p in model.named_parameters()]
    buffers = {name: list(b.shape) for name, b in model.named_buffers()}
    print(json.dumps({"parameters": parameters, "buffers": buffers}))
