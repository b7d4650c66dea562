"""Mixed precision really happens (the silent no-op users report), and fp16 overflow skips on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import HELPERS, project_modules, torchrun
from tests.helpers.several_runs import launch_several

TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.max_seq_len", "64", "--training.seq_len", "32",
        "--training.global_batch_size", "4", "--job.device", "cpu"]  # fmt: skip


def probe(project: Path, mode: str, out: Path, *overrides: str) -> list[dict]:
    torchrun(project, str(HELPERS / "precision_probe.py"), mode, *TINY, *overrides, env={"PROBE_OUT": str(out)})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def bf16_reports(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's bf16 report: a model built with each parallel.output_dtype, in one 2-rank launch."""
    return probe(projects["bf16"], "bf16", tmp_path_factory.mktemp("bf16-probe"))


@pytest.mark.parametrize("output_dtype,logits", [("float32", "torch.float32"), ("compute", "torch.bfloat16")])
def test_bf16_parameters_are_bf16_inside_forward_and_fp32_outside(
    bf16_reports: list[dict], output_dtype: str, logits: str
) -> None:
    assert len(bf16_reports) == 2
    for report in bf16_reports:
        assert report[output_dtype]["inside_forward"] == "torch.bfloat16"
        assert report[output_dtype]["master"] == "torch.float32"
        # parallel.output_dtype: the root's MixedPrecisionPolicy casts the logits (or leaves them in bf16).
        assert report[output_dtype]["logits"] == logits


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(projects: dict[str, Path], tmp_path: Path) -> None:
    reports = probe(projects["fp16"], "fp16", tmp_path)
    assert len(reports) == 2
    for report in reports:
        assert report["params_unchanged"] is True
        assert report["scale_after"] == report["scale_before"] / 2


@pytest.fixture(scope="module")
def one_process_runs(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of three runs of one process each (FSDP's mixed precision over a mesh of 1), made in one process
    (tests/helpers/several_runs.py: train.train() per run, each its project's, seeded from its config): "fp32" and
    "bf16", 10 steps of one config, and "fp16", 2 steps."""
    root = tmp_path_factory.mktemp("one-process")
    compared = [*TINY, "--training.steps", "10", "--training.global_batch_size", "8", "--training.lr", "1e-2"]
    runs = [
        {"project": str(projects["fp32"]), "args": [*compared, "--job.output_dir", str(root / "fp32")]},
        {"project": str(projects["bf16"]), "args": [*compared, "--job.output_dir", str(root / "bf16")]},
        {"project": str(projects["fp16"]), "args": [*TINY, "--training.steps", "2", "--job.output_dir",
                                                    str(root / "fp16")]},
    ]  # fmt: skip
    launch_several(projects["fp32"], runs, root / "runs.json", nproc=1)
    return root


def test_fp16_metrics_count_skipped_steps(one_process_runs: Path) -> None:
    records = [json.loads(line) for line in (one_process_runs / "fp16" / "metrics.jsonl").read_text().splitlines()]
    # The initial scale of 2**16 overflows nothing on this tiny model: no step skipped, scale unchanged.
    assert [(r["skipped_steps"], r["loss_scale"], r["mfu"]) for r in records] == [(0, 65536.0, None)] * 2


def test_bf16_training_stays_within_2e_2_of_fp32(one_process_runs: Path) -> None:
    # One process each (a mesh of 1): the rounding, not the ranks, is what is compared.
    losses = {
        precision: [json.loads(line)["loss"] for line in (one_process_runs / precision / "metrics.jsonl").open()]
        for precision in ("fp32", "bf16")
    }
    assert len(losses["bf16"]) == 10
    for fp32, bf16 in zip(losses["fp32"], losses["bf16"], strict=True):
        assert abs(fp32 - bf16) <= 2e-2, (losses["fp32"], losses["bf16"])
    # ...and not equal: bf16 really changed the arithmetic.
    assert losses["fp32"] != losses["bf16"]


def test_bf16_on_a_cpu_without_bf16_instructions_is_said_once(projects: dict[str, Path], tmp_path: Path) -> None:
    # The generated check reads the CPU's flags; here it is given the flags of an AVX2-only and of a Sapphire
    # Rapids host (this machine's own flags decide whether the real run below prints the note).
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\nprocessor : 1\nflags : fpu sse2 avx avx2 fma\n")
    amx = tmp_path / "amx"
    amx.write_text("flags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    # In this process (the project's train.py imported here, forgotten after: project_modules), not one of its own.
    with project_modules(projects["bf16"]):
        from train import cpu_has_bf16_instructions

        assert [cpu_has_bf16_instructions(path) for path in (avx2, amx, tmp_path / "none")] == [False, True, None]
    run = torchrun(projects["bf16"], "train.py", *TINY, "--training.steps", "1", "--job.device", "cpu",
                   "--job.output_dir", str(tmp_path / "out"))  # fmt: skip
    flags = set(Path("/proc/cpuinfo").read_text().split())
    native = bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    note = "note: this CPU has no bf16 instructions (avx512_bf16, AMX): torch emulates bf16"
    assert run.stdout.count(note) == (0 if native else 1), run.stdout
    # Synthetic tokens are said so, with the way to train on text.
    assert (
        "data: SYNTHETIC tokens (data.path is empty), a learnable pattern, not text: 4,096 training samples"
        in run.stdout
    )
    assert "data: to train on text, prepare it with scripts/prepare_data.py and pass --data.path" in run.stdout
