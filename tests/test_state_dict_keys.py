"""Parameter and optimizer-state names stay what checkpoints already hold: every golden's key lists equal the ones
recorded in tests/data/state_dict_keys/ (recorded before the blocks' container became a ModuleDict keyed by the
layer index). A renamed key would make every existing checkpoint unloadable.

The goldens' key lists are read in one process (tests/helpers/state_dict_keys_probe.py), from copies of
generated_examples/ (which tests/test_goldens.py keeps equal to a fresh render).

To record them again after an intended change: FSDP2GEN_UPDATE_KEYS=1 pytest tests/test_state_dict_keys.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, REPO, TINY, save_tiny_llama, torchrun_env
from tests.test_goldens import EXAMPLES, GOLDENS

RECORDED = REPO / "tests" / "data" / "state_dict_keys"

# Small models of each family (two blocks: a renumbered index shows); hf: the tiny Llama the tests make.
CUSTOM_TINY = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.vocab_size", "128",
    "--model.max_seq_len", "64", "--training.seq_len", "32",
]  # fmt: skip
OVERRIDES = {"llama": TINY, "custom": CUSTOM_TINY, "hf": ["--training.seq_len", "32"]}


def save_tiny_model(folder: Path) -> None:
    """The golden's model folder: the tests' tiny Llama, or a tiny Qwen3-MoE (fused experts) for an MoE golden."""
    if folder.name != "tiny-qwen3-moe":
        save_tiny_llama(folder, "hello world, a tiny corpus " * 20)
        return
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=4, vocab_size=320)  # fmt: skip
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**sizes)).save_pretrained(folder)


@pytest.fixture(scope="module")
def key_lists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every golden's key lists, read in one process from a copy of the golden."""
    root = tmp_path_factory.mktemp("keys")
    projects = {}
    for name, answers in sorted(GOLDENS.items()):
        project = shutil.copytree(EXAMPLES / name, root / name)
        if answers["family"] == "hf":
            save_tiny_model(project / answers["hf_model"])
        projects[name] = [str(project), ["--job.device", "cpu", *OVERRIDES[answers["family"]]]]
    (root / "projects.json").write_text(json.dumps(projects))
    command = [sys.executable, str(HELPERS / "state_dict_keys_probe.py"), str(root / "projects.json"),
               str(root / "keys.json")]  # fmt: skip
    result = subprocess.run(command, cwd=root, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((root / "keys.json").read_text())


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_checkpoint_keys_equal_the_recorded_ones(key_lists: dict[str, str], name: str) -> None:
    keys = key_lists[name]
    recorded = RECORDED / f"{name}.txt"
    if os.environ.get("FSDP2GEN_UPDATE_KEYS") == "1":
        recorded.parent.mkdir(parents=True, exist_ok=True)
        recorded.write_text(keys)
    assert keys.splitlines() == recorded.read_text().splitlines()
