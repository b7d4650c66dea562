"""A training step copies nothing from the device to the host (a sync that drains a GPU's queue) except on the
steps that report: metrics.py keeps each step's numbers on the device and copies them all at once on a logging,
validation, checkpoint or last step. Counted on 2 CPU ranks by wrapping Tensor.item/tolist/cpu/... (sync_probe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import HELPERS, TINY, generate, metrics, torchrun
from tests.helpers.sync_sites import NO_GPU_SYNC, where

# Steps 1-8, a progress line every 4 steps, validation every 6, no checkpoint before the last step's.
RUN = [*TINY, "--job.log_every", "4", "--training.steps", "8", "--eval.every", "6", "--eval.batches", "1",
       "--checkpoint.interval", "100", "--job.device", "cpu"]  # fmt: skip
REPORTING = {4, 6, 8}  # logging steps, the validation step, the last step (which also saves)


@pytest.fixture(scope="module")
def reports(projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{run: its folder}: the fp32 and fp16 projects' runs and a mixture-of-experts project's, RUN each, counted in
    one 2-rank launch (sync_probe.py --runs: each rank imports torch and joins the process group once); a run's
    folder holds rank0.json, rank1.json and its output folder run/."""
    root = tmp_path_factory.mktemp("syncs")
    # TINY's 2 blocks: the first dense (debug-moe's n_dense_layers 1), the second a mixture of experts.
    moe = generate(root / "project-moe", "--gpus", "2", "--fp32", "--moe")
    folders = {"fp32": projects["fp32"], "fp16": projects["fp16"], "moe": moe}
    runs = [{"project": str(project), "args": [*RUN, "--job.output_dir", str(root / name / "run")],
             "out": str(root / name)} for name, project in folders.items()]  # fmt: skip
    for name in folders:
        (root / name).mkdir()
    (root / "runs.json").write_text(json.dumps(runs))
    torchrun(projects["fp32"], str(HELPERS / "sync_probe.py"), "--runs", str(root / "runs.json"))
    return {name: root / name for name in folders}


def syncs_per_step(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


# The project's own copies on the reporting steps, per rank: rank 0 copies every pending number at once (1), and
# evaluate() reads the validation loss on every rank (step 6 and the last step).
OWN = {4: [1, 0], 6: [2, 1], 8: [2, 1]}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_steps_that_do_not_report_make_no_host_sync(reports: dict[str, Path], precision: str) -> None:
    for rank, report in enumerate(syncs_per_step(reports[precision])):
        assert len(report["steps"]) == 8, report
        sites = {
            int(step): [call for call in calls if where(call) not in NO_GPU_SYNC]
            for step, calls in report["sites"].items()
        }
        quiet = {step: sites.get(step, []) for step in range(1, 9) if step not in REPORTING}
        assert all(not calls for calls in quiet.values()), (rank, quiet)
        # The last step's checkpoint save copies the shards to the host inside torch (DCP): counted apart.
        own = {step: [call for call in sites.get(step, []) if not where(call).startswith("torch/")] for step in OWN}
        assert {step: len(calls) for step, calls in own.items()} == {step: OWN[step][rank] for step in OWN}, own
    # The rows are those of a run that synced every step: one per step, with every number.
    rows = metrics(reports[precision] / "run")
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all(isinstance(row["loss"], float) and isinstance(row["grad_norm"], float) for row in rows)
    assert [("val_loss" in row) for row in rows] == [step in (6, 8) for step in range(1, 9)]


def test_a_moe_step_makes_no_host_sync(reports: dict[str, Path]) -> None:
    """A mixture-of-experts block's grouped GEMM (moe.py's grouped_swiglu: bf16 on H100 and newer, and CPU at
    16-byte-aligned widths, as here) takes each expert's token count on the device: a MoE step copies nothing to
    the host either (the load figures stay on the device until metrics.py's report). (The per-expert loop that
    fp32 or older GPUs run needs the counts on the host: one copy per MoE block, as torchtitan's loop.)"""
    for rank, report in enumerate(syncs_per_step(reports["moe"])):
        assert len(report["steps"]) == 8, report
        for step in range(1, 9):
            calls = [where(call) for call in report["sites"].get(str(step), []) if where(call) not in NO_GPU_SYNC]
            if step not in REPORTING:
                assert calls == [], (rank, step, calls)
