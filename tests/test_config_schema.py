"""Every key of every family's config is checked by one schema: for values drawn (hypothesis) across types, signs,
NaN/inf, huge and tiny magnitudes, strings and empty ones, preflight refuses with one line and exit code 2, or
the run trains its first step with a finite loss. The keys are enumerated from each rendered project's dataclasses
(tests/helpers/config_property.py runs inside the project; every accepted draw is trained there, in one process).

HYPOTHESIS_PROFILE=nightly draws more (about 20 per key and 300 pairs of keys, instead of 2 and 30).

The file itself is drawn too (tests/helpers/config_file_property.py): bytes, TOML of any shape and nesting depth,
the project's config.toml edited; each is a Config or one line and exit code 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, TINY, generate, save_tiny_llama, torchrun_env

BASE = ["--job.device", "cpu", "--training.steps", "1"]
HF_BASE = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
           "--training.lr", "1e-2", "--job.log_every", "1", *BASE]  # fmt: skip
# Keys each family must have (a check that the enumeration sees the model's own section).
MODEL_KEYS = {
    "llama": {"model.dim", "model.n_heads", "model.n_kv_heads", "model.rope_theta", "model.norm_eps", "model.init_std"},
    "custom": {"model.dim", "model.n_heads", "model.init_std", "model.max_seq_len"},
    "hf": {"model.path", "model.pretrained"},
}
MODEL_KEYS["llama-moe"] = MODEL_KEYS["llama"] | {"model.n_experts", "model.top_k", "model.expert_bias_rate"}


FAMILIES = ("llama", "llama-moe", "custom", "hf")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{family: its report}: config_property.py over one project of each family, in one process (torch imported
    once; each project's modules in place of the one's before)."""
    root = tmp_path_factory.mktemp("config-property")
    argv = []
    for family in FAMILIES:
        tmp = root / family
        tmp.mkdir()
        options, base = ["--family", family, "--fp32"], [*TINY, *BASE]
        if family == "llama-moe":
            # Mixture-of-experts blocks (debug-moe: 8 experts, top 2; TINY's 2 blocks, the second with experts): the
            # draws of its keys train MoE models, where on the dense llama they mostly stop at "needs moe_ffn_dim".
            options, base = ["--family", "llama", "--moe", "--fp32"], [*TINY, "--model.moe_ffn_dim", "32", *BASE]
        elif family == "hf":
            model = save_tiny_llama(tmp / "tiny-llama", "hello world " * 50)
            options, base = [*options, "--hf-model", str(model)], HF_BASE
        elif family == "custom":
            # The custom model has no n_kv_heads or ffn_dim.
            pairs = [TINY[i : i + 2] for i in range(0, len(TINY), 2)]
            base = [arg for pair in pairs if pair[0] not in ("--model.n_kv_heads", "--model.ffn_dim") for arg in pair]
            base += BASE
        project = generate(tmp / "run", *options)
        (tmp / "base.json").write_text(json.dumps(base))
        argv += [str(project), str(tmp / "base.json"), str(tmp / "report.json")]
    scratch = root / "scratch"
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(HELPERS / "config_property.py"), *argv],
        cwd=scratch, env={**torchrun_env(), "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return {family: json.loads((root / family / "report.json").read_text()) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_key_is_refused_in_one_line_or_trains(family: str, reports: dict[str, dict]) -> None:
    report = reports[family]
    assert report["keys_drawn"] == report["keys"]  # every key, none left out
    assert MODEL_KEYS[family] <= set(report["keys"])
    assert report["unbounded"] == []
    # Both sides of the property are exercised.
    assert report["refused"] >= 30 and report["trained"] >= 20, report


# Run inside a rendered project: for drawn (seq_len, loss_chunks), config.py accepts the config exactly when the
# chunks divide the sequence, and otherwise refuses it with the rule's one line. Half the draws are divisible.
LOSS_CHUNKS_PROPERTY = """
from hypothesis import given, settings, strategies as st

from config import ConfigError, load_config


@st.composite
def lengths(draw):
    chunks = draw(st.integers(1, 2**31 - 1) | st.integers(1, 64))
    if draw(st.booleans()):
        return draw(st.integers(1, (2**31 - 1) // chunks)) * chunks, chunks
    return draw(st.integers(1, 2**31 - 1) | st.integers(1, 4096)), chunks


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(lengths())
def rule_holds(drawn):
    seq_len, chunks = drawn
    overrides = {"training.seq_len": str(seq_len), "training.loss_chunks": str(chunks)}
    try:
        config = load_config("config.toml", overrides)
    except ConfigError as error:
        assert seq_len % chunks, (drawn, error)
        assert str(error) == (
            f"training.loss_chunks = {chunks} does not divide training.seq_len = {seq_len} (the loss is computed in "
            "equal sequence chunks); pick a divisor of seq_len, e.g. --training.loss_chunks 1"
        ), str(error)
        counts[0] += 1
    else:
        assert seq_len % chunks == 0 and config.training.loss_chunks == chunks, drawn
        counts[1] += 1


counts = [0, 0]
rule_holds()
print(*counts)
"""


def test_loss_chunks_must_divide_seq_len_for_drawn_values(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--fp32")
    # The generated config's own default divides its own seq_len.
    assert "loss_chunks = 8\n" in (project / "config.toml").read_text()
    assert "seq_len = 256\n" in (project / "config.toml").read_text()
    result = subprocess.run([sys.executable, "-c", LOSS_CHUNKS_PROPERTY], cwd=project, capture_output=True, text=True,
                            env={**torchrun_env(), "PYTHONPATH": str(project)}, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    refused, accepted = map(int, result.stdout.split())
    assert refused >= 50 and accepted >= 50, (refused, accepted)


def test_config_files_of_any_shape_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    project = generate(tmp_path / "run", "--fp32", "--lora", "--family", "hf", "--hf-model", "org/model")
    result = subprocess.run(
        [sys.executable, str(HELPERS / "config_file_property.py"), str(tmp_path), str(tmp_path / "report.json")],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["refused"] >= 50 and report["accepted"] >= 5, report
