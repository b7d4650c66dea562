"""The checkpoint keys of several generated projects, in one process (torch, transformers and torchao are imported
once instead of once per project):

    python state_dict_keys_probe.py PROJECTS.json KEYS.json

PROJECTS.json maps a name to [project folder, train.py overrides]. For each project, in its folder, with its modules
imported afresh (those of the project before are forgotten): the model as train.py builds it (model.py's build_model
on the meta device), then as train.py shards and fills it (build_model_meta: float8, activation checkpointing,
compile, fully_shard, on one gloo rank), and the keys DCP's get_state_dict saves for it and an AdamW over its
trainable parameters. Writes {name: the three key lists, each under a "# ..." header} to KEYS.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh


def flat(prefix: str, value: object) -> list[str]:
    if isinstance(value, dict):
        return [key for name, item in value.items() for key in flat(f"{prefix}.{name}" if prefix else str(name), item)]
    if isinstance(value, list):
        return [key for index, item in enumerate(value) for key in flat(f"{prefix}.{index}", item)]
    return [prefix]


def probe(overrides: list[str]) -> None:
    """Print the key lists of the project in the current folder (its modules first on sys.path)."""
    import train
    from config import load_config, parse_overrides
    from model import build_model

    config = load_config("config.toml", parse_overrides(overrides))
    with torch.device("meta"):
        plain = build_model(config)
    print("# model.state_dict() of build_model(config)")
    print("\n".join(sorted(plain.state_dict())))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    model = train.build_model_meta(config, mesh, torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    print("# get_state_dict(model, AdamW) after build_model_meta: model")
    print("\n".join(sorted(model_state)))
    print("# optimizer")
    print("\n".join(sorted(set(flat("", optimizer_state)))))


def keys_of(project: Path, overrides: list[str]) -> str:
    """The key lists of `project`: its headers and keys (no key has a space), not what train.py prints."""
    before, search_path, cwd = set(sys.modules), list(sys.path), os.getcwd()
    sys.path.insert(0, str(project))
    os.chdir(project)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            probe(overrides)
    finally:
        os.chdir(cwd)
        sys.path[:] = search_path
        # Forget the project's modules: the next project has modules of the same names.
        for name in set(sys.modules) - before:
            if str(project) in (getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
    return "".join(line for line in out.getvalue().splitlines(keepends=True) if line.startswith("#") or " " not in line)


def main() -> None:
    projects = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        keys = {name: keys_of(Path(folder), overrides) for name, (folder, overrides) in projects.items()}
    finally:
        dist.destroy_process_group()
    Path(sys.argv[2]).write_text(json.dumps(keys))


if __name__ == "__main__":
    main()
