"""Every model family's model.py exports the interface that train.py, preflight.py and the scripts use (the table in
the generated AGENTS.md), with the same signatures; every name of that table works on a plain module as on a
sharded one; and reading a config (config.py, which imports the family's model_args.py) imports no torch."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate

# fp32: the plain module computes in fp32, and so does the sharded one it is compared with (no mixed precision).
FAMILIES = {
    "llama": ["--family", "llama", "--fp32"],
    "llama-moe": ["--family", "llama", "--moe", "--fp32"],
    "custom": ["--family", "custom", "--fp32"],
    "hf": ["--family", "hf", "--hf-model", "models/tiny-llama", "--fp32"],
    "hf-lora": ["--family", "hf", "--hf-model", "models/tiny-llama", "--task", "sft", "--lora", "--fp32"],
}

# Run with the project first on sys.path: prints each name's kind and, for functions, their signature.
CHECK_INTERFACE = """
import dataclasses
import inspect

import model
import model_args

assert model.ModelArgs is model_args.ModelArgs, "model.ModelArgs is not model_args.ModelArgs"
assert model.MODEL_RULES is model_args.MODEL_RULES and model.RESUME_MAY_CHANGE is model_args.RESUME_MAY_CHANGE
assert inspect.isclass(model.Model), model.Model
assert dataclasses.is_dataclass(model.ModelArgs)
fields = {field.name for field in dataclasses.fields(model.ModelArgs)}
assert set(model.RESUME_MAY_CHANGE) <= fields, (model.RESUME_MAY_CHANGE, fields)
assert isinstance(model.MODEL_RULES, list)
for name in ("build_model", "block_classes", "initialize", "output_logits", "loss"):
    print(name, inspect.signature(getattr(model, name)))
"""

EXPECTED = """\
build_model (config: 'Config') -> 'Model'
block_classes (model: 'Model', shard_modules: 'list[str]') -> 'list[str]'
initialize (model: 'Model', config: 'Config', device: 'torch.device') -> 'None'
output_logits (output: '{output}') -> 'torch.Tensor'
loss (model: 'Model', tokens: 'torch.Tensor', targets: 'torch.Tensor', positions: 'torch.Tensor | None' = None, \
document_ids: 'torch.Tensor | None' = None, reduction: 'str' = 'mean', chunks: 'int' = 1) -> 'torch.Tensor'
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: generate(root / name, *options) for name, options in FAMILIES.items()}


def run_in(project: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=project, env={"PYTHONPATH": str(project), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_py_exports_the_interface(probed: Callable[[str], tuple[str, dict]], family: str) -> None:
    # CHECK_INTERFACE's lines, printed by the family's probe process (probed) before its plain-module checks.
    printed, _ = probed(family)
    # An hf model returns transformers' CausalLMOutputWithPast; the others the logits themselves.
    output = "CausalLMOutputWithPast" if family.startswith("hf") else "torch.Tensor"
    expected = EXPECTED.format(output=output)
    if family.startswith("hf"):
        # The model's class is transformers' PreTrainedModel (config.json names the subclass).
        expected = expected.replace("'Model'", "'PreTrainedModel'")
    assert printed == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reading_a_config_imports_no_torch(rendered: dict[str, Path], family: str) -> None:
    code = (
        "import sys\nimport config\nconfig.load_config('config.toml')\n"
        "heavy = sorted(name for name in ('torch', 'transformers', 'huggingface_hub') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = run_in(rendered[family], code)
    assert result.returncode == 0, result.stderr[-3000:]


def interface_table(agents_md: str) -> dict[str, list | None]:
    """The model interface as AGENTS.md's table lists it: {name: the parameters its row shows, [[name, default or
    None], ...], or None for a name that is not a function}."""
    rows = agents_md.split("| name | what the project expects |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    table: dict[str, list | None] = {}
    for row in rows.splitlines():
        shown = re.match(r"\| `([^`]+)` \|", row)
        assert shown, f"AGENTS.md: a row of the model interface that does not start with `name`: {row}"
        text = shown[1].split(" -> ")[0]
        if "(" not in text:
            table[text] = None
            continue
        function = ast.parse(f"def {text}: pass").body[0].args
        defaults = [None] * (len(function.args) - len(function.defaults)) + function.defaults
        table[text.split("(")[0]] = [
            [arg.arg, None if default is None else ast.literal_eval(default)]
            for arg, default in zip(function.args, defaults, strict=True)
        ]
    return table


def test_interface_table_is_read_whole(rendered: dict[str, Path]) -> None:
    # The parser sees every row (a row it misread would silently go unchecked below).
    text = (rendered["llama"] / "AGENTS.md").read_text()
    table = interface_table(text)
    assert len(table) == text.count("\n| `") and "loss" in table and table["Model"] is None
    assert table["loss"][3:] == [["positions", None], ["document_ids", None], ["reduction", "mean"], ["chunks", 1]]


# Tiny models: each family's [model] keys.
TINY_MODEL = {"dim": "64", "n_layers": "2", "n_heads": "4", "vocab_size": "128", "max_seq_len": "64"}
TINY_LLAMA = {**TINY_MODEL, "n_kv_heads": "2", "ffn_dim": "172"}
MODEL = {
    "llama": {**TINY_LLAMA, "tie_embeddings": "true"},  # tied weights, on a plain module too
    "llama-moe": TINY_LLAMA,
    "custom": TINY_MODEL,
}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama folders (config.json + model.safetensors): tied embeddings for hf, untied for hf-lora."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folders = {}
    for family, tied in (("hf", True), ("hf-lora", False)):
        config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=320, max_position_embeddings=64,
                             tie_word_embeddings=tied)  # fmt: skip
        torch.manual_seed(0)
        folders[family] = tmp_path_factory.mktemp(family) / "model"
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[family])
    return folders


# One process per family (torch imported once, an hf project's transformers too): CHECK_INTERFACE, a line that
# marks its end, then tests/helpers/model_interface_probe.py SPEC as `python model_interface_probe.py SPEC` runs it.
PROBE_AFTER_CHECK = """
import runpy
import sys

print("-- interface checked", flush=True)
sys.argv = [{probe!r}, sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def probed(rendered: dict[str, Path], pretrained: dict[str, Path]) -> Callable[[str], tuple[str, dict]]:
    """family -> what CHECK_INTERFACE printed, and the probe's report; one process per family, made by the first
    test that asks for it."""
    made: dict[str, tuple[str, dict]] = {}

    def probe(family: str) -> tuple[str, dict]:
        if family not in made:
            project = rendered[family]
            table = interface_table((project / "AGENTS.md").read_text())
            model = MODEL[family] if family in MODEL else {"path": str(pretrained[family])}
            spec = {"table": table, "overrides": {f"model.{key}": value for key, value in model.items()}}
            code = CHECK_INTERFACE + PROBE_AFTER_CHECK.format(probe=str(HELPERS / "model_interface_probe.py"))
            result = subprocess.run(
                [sys.executable, "-c", code, json.dumps(spec)], cwd=project,
                env={"PYTHONPATH": str(project), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr[-3000:]
            printed = result.stdout.split("-- interface checked\n", 1)[0]
            made[family] = printed, json.loads(result.stdout.splitlines()[-1])
        return made[family]

    return probe


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_name_works_on_a_plain_module(
    rendered: dict[str, Path], probed: Callable[[str], tuple[str, dict]], family: str
) -> None:
    """Each name of AGENTS.md's table, called on a module never fully_shard-ed (one process, train.py's process group
    of one rank) gives what it gives on the sharded model, and initialize what the family's own init gives
    (hf: from_pretrained's weights and non-persistent buffers, and transformers' init with the seed)."""
    table = interface_table((rendered[family] / "AGENTS.md").read_text())
    checked = dict(probed(family)[1])
    unchecked = checked.pop("unchecked")
    assert not unchecked, f"AGENTS.md's model interface lists {unchecked}: add their checks to model_interface_probe.py"
    assert checked == dict.fromkeys(table, "ok")
