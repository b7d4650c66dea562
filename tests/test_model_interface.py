"""Every model family's model.py exports the interface that train.py, preflight.py and the scripts use (the table in
the generated AGENTS.md), with the same signatures; and reading a config (config.py, which imports the family's
model_args.py) imports no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import generate

FAMILIES = {
    "llama": [],
    "custom": [],
    "hf": ["--hf-model", "models/tiny-llama"],
    "hf-lora": ["--family", "hf", "--hf-model", "models/tiny-llama", "--task", "sft", "--lora"],
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
    return {
        name: generate(root / name, *(options if name == "hf-lora" else ["--family", name, *options]))
        for name, options in FAMILIES.items()
    }


def run_in(project: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=project, env={"PYTHONPATH": str(project), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_py_exports_the_interface(rendered: dict[str, Path], family: str) -> None:
    result = run_in(rendered[family], CHECK_INTERFACE)
    assert result.returncode == 0, result.stderr[-3000:]
    # An hf model returns transformers' CausalLMOutputWithPast; the others the logits themselves.
    output = "CausalLMOutputWithPast" if family.startswith("hf") else "torch.Tensor"
    expected = EXPECTED.format(output=output)
    if family.startswith("hf"):
        # The model's class is transformers' PreTrainedModel (config.json names the subclass).
        expected = expected.replace("'Model'", "'PreTrainedModel'")
    assert result.stdout == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reading_a_config_imports_no_torch(rendered: dict[str, Path], family: str) -> None:
    code = (
        "import sys\nimport config\nconfig.load_config('config.toml')\n"
        "heavy = sorted(name for name in ('torch', 'transformers', 'huggingface_hub') if name in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = run_in(rendered[family], code)
    assert result.returncode == 0, result.stderr[-3000:]
