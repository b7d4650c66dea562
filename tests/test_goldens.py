"""generated_examples/ holds committed outputs; regenerating them from their answers must match exactly.

After an intended template change, refresh them with:
    FSDP2GEN_UPDATE_GOLDENS=1 python -m pytest tests/test_goldens.py
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, fsdp2gen, generate, tree

EXAMPLES = REPO / "generated_examples"
# The parallelism and performance options at their defaults, for goldens that leave them so.
DEFAULT_OPTIONS = {
    "tp": 1,
    "moe": False,
    "ep": 1,
    "cp": 1,
    "pp": 1,
    "reshard_after_forward": "true",
    "activation_checkpointing": "none",
    "compile": False,
    "float8": False,
    "cpu_offload": False,
    "prefetch": False,
    "tensorboard": False,
    "tokenizer": "",
    "wandb": False,
    "task": "pretrain",
    "lora": False,
    "qlora": False,
}
# name -> answers; every name must exist in generated_examples/ and vice versa. Every option is on in one at least.
GOLDENS = {
    # What the README's main command writes (`fsdp2gen new my-run --gpus 8 --bf16 --yes`): every other answer
    # at its default.
    "llama-8gpu-bf16": {
        "family": "llama",
        "gpus": 8,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
    },
    "llama-1gpu-fp32": {
        "family": "llama",
        "gpus": 1,
        "nodes": 1,
        "precision": "fp32",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
    },
    "llama-8gpu-bf16-float8-compile-selectiveac-prefetch-tensorboard-wandb": {
        "family": "llama",
        "gpus": 8,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        # What an 8-GPU H100/H200 node runs best: compiled float8 blocks, every 2nd block recomputed, explicit
        # prefetch.
        "activation_checkpointing": "selective",
        "compile": True,
        "float8": True,
        "prefetch": True,
        "tensorboard": True,
        "wandb": True,
    },
    # HSDP (replicated across the 2 nodes, sharded within each), launched by SLURM.
    "llama-2node-bf16-slurm-reshard8-fullac-compile": {
        "family": "llama",
        "gpus": 8,
        "nodes": 2,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "slurm",
        **DEFAULT_OPTIONS,
        # Between forward and backward, parameters stay sharded over one node: backward gathers within the node.
        "reshard_after_forward": "8",
        "activation_checkpointing": "full",
        "compile": True,
    },
    "llama-2gpu-fp32-async": {
        "family": "llama",
        "gpus": 2,
        "nodes": 1,
        "precision": "fp32",
        "checkpoint": "dcp-async",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
    },
    "llama-8gpu-bf16-tp2": {
        "family": "llama",
        "gpus": 8,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "tp": 2,
    },
    # Long sequences: each one split over 2 GPUs (context parallelism), FSDP over all 8 (dp_shard 4 x cp 2).
    "llama-8gpu-bf16-cp2": {
        "family": "llama",
        "gpus": 8,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "cp": 2,
    },
    "llama-4gpu-bf16-full-offload": {
        "family": "llama",
        "gpus": 4,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "full",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "cpu_offload": True,
    },
    # Mixture-of-experts blocks (model.size debug-moe; qwen3-30b-a3b and deepseek-v3 shapes), load balancing,
    # experts shared out over 2 GPUs (expert parallelism).
    "llama-4gpu-bf16-moe-ep2": {
        "family": "llama",
        "gpus": 4,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "moe": True,
        "ep": 2,
    },
    # Pipeline parallelism: 2 stages (1F1B) x FSDP over the other 2 GPUs of each stage.
    "llama-4gpu-bf16-pp2": {
        "family": "llama",
        "gpus": 4,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "pp": 2,
    },
    # A folder relative to the project, which need not exist to generate (scripts/gpu_smoke.sh puts a tiny
    # Llama there); a hub id would be kept as given too.
    "hf-2gpu-bf16": {
        "family": "hf",
        "hf_model": "models/tiny-llama",
        "pretrained": True,
        "gpus": 2,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
    },
    # Tensor parallelism for a Hugging Face model, from the plan it declares (tensor_parallel.py), FSDP over the rest.
    "hf-4gpu-bf16-tp2": {
        "family": "hf",
        "hf_model": "models/tiny-llama",
        "pretrained": True,
        "gpus": 4,
        "nodes": 1,
        "precision": "bf16",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "tp": 2,
    },
    # Expert parallelism for a Hugging Face mixture-of-experts model, from the plan it declares (expert_parallel.py).
    "hf-4gpu-fp32-ep2": {
        "family": "hf",
        "hf_model": "models/tiny-qwen3-moe",
        "pretrained": True,
        "gpus": 4,
        "nodes": 1,
        "precision": "fp32",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "ep": 2,
    },
    # Supervised fine-tuning of a Hugging Face model on chat data, with LoRA adapters.
    "hf-2gpu-fp32-sft-lora": {
        "family": "hf",
        "hf_model": "models/tiny-llama",
        "pretrained": True,
        "gpus": 2,
        "nodes": 1,
        "precision": "fp32",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "task": "sft",
        "lora": True,
    },
    # Your own model, with a tokenizer from the hub (fetched when first used): model.vocab_size follows it.
    "custom-2gpu-fp32": {
        "family": "custom",
        "gpus": 2,
        "nodes": 1,
        "precision": "fp32",
        "checkpoint": "dcp",
        "launcher": "torchrun",
        **DEFAULT_OPTIONS,
        "tokenizer": "gpt2",
    },
}


def flags(answers: dict) -> list[str]:
    """The `fsdp2gen new` options giving `answers` (True/False as --name/--no-name; pretrained as
    --pretrained/--from-scratch)."""
    found = []
    for name, value in answers.items():
        flag = "--" + name.replace("_", "-")
        if name == "pretrained":
            found.append("--pretrained" if value else "--from-scratch")
        elif isinstance(value, bool):
            found.append(flag if value else "--no-" + flag[2:])
        else:
            found += [flag, str(value)]
    return found


def test_every_golden_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()) == sorted(GOLDENS)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_regenerates_identically(tmp_path: Path, name: str) -> None:
    golden = EXAMPLES / name
    if os.environ.get("FSDP2GEN_UPDATE_GOLDENS") == "1":
        shutil.rmtree(golden, ignore_errors=True)
        generate(golden, *flags(GOLDENS[name]))
    recorded = yaml.safe_load((golden / ".copier-answers.yml").read_text())
    answers = {key: value for key, value in recorded.items() if not key.startswith("_")}
    # The built-in llama records --hf-model too (a Hugging Face checkpoint to start from; none in the goldens).
    unasked = {"hf_model": ""} if GOLDENS[name]["family"] == "llama" else {}
    assert answers == {"project_name": name, **unasked, **GOLDENS[name]}
    fresh = generate(tmp_path / name, *flags(answers))
    expected, actual = tree(golden), tree(fresh)
    assert sorted(actual) == sorted(expected)
    changed = [path for path in expected if expected[path] != actual[path]]
    assert changed == [], f"{name}: {changed} differ; if intended, run FSDP2GEN_UPDATE_GOLDENS=1 pytest {__file__}"
    for path in expected:
        assert os.access(golden / path, os.X_OK) == os.access(fresh / path, os.X_OK), path


def test_the_readme_main_command_writes_the_default_golden(tmp_path: Path) -> None:
    # The README's first command, with its options as written there; only the project's name differs.
    command = re.search(r"fsdp2gen new my-run ([^&]*?) &&", (REPO / "README.md").read_text())
    assert command, "README's main command not found"
    fresh = tmp_path / "llama-8gpu-bf16"
    result = fsdp2gen("new", str(fresh), *command[1].split())
    assert result.returncode == 0, result.stderr
    assert tree(fresh) == tree(EXAMPLES / "llama-8gpu-bf16")
