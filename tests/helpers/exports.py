"""scripts/export.py and scripts/generate.py of an hf project read a checkpoint of any parallel layout as they read
one process's: run in the test's own process (tests/helpers/scripts.run_in_this_process, torch and transformers
imported once)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.scripts import captured_in_this_process, run_in_this_process


def assert_read_as_one_process(
    project: Path, checkpoint: Path, reference: Path, tolerance: float, generates: bool = True
) -> None:
    """export.py writes `checkpoint` (a run's step-N folder, of any layout) as save_pretrained writes the model: the
    names of `reference` (the same step of one process's run) exported, the weights within `tolerance`, and
    transformers loads it with nothing missing; generate.py continues a prompt from the checkpoint as from the
    exported folder (generates=False: a LoRA checkpoint, which generate.py reads through its export only)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = {}
    for name, step in (("layout", checkpoint), ("one", reference)):
        exported[name] = step.parent.parent / f"exported-{step.name}"
        run_in_this_process(project, "scripts/export.py", str(step), "--output", str(exported[name]))
    weights, expected = (load_file(exported[name] / "model.safetensors") for name in ("layout", "one"))
    assert sorted(weights) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=tolerance, msg=key)
    _, loading = AutoModelForCausalLM.from_pretrained(exported["layout"], output_loading_info=True)
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched weights
    if not generates:
        return
    from_checkpoint = continuation(project, str(checkpoint))
    assert re.fullmatch(r"\d+(,\d+){7}\n", from_checkpoint), from_checkpoint
    assert from_checkpoint == continuation(project, "--exported", str(exported["layout"]))


def continuation(project: Path, *source: str) -> str:
    """generate.py's greedy 8 tokens after the ids 1, 2, 3, as it prints them."""
    code, printed, stderr = captured_in_this_process(
        project, "scripts/generate.py", *source, "--prompt-ids", "1,2,3", "--max-new-tokens", "8"
    )
    assert code == 0, stderr[-3000:]
    return printed
