"""Family hf with context parallelism (`--cp`): ring attention through transformers' own SDPA attention, every
sequence split over the cp ranks (context_parallel.py). Tiny Llama and Qwen3 (tied embeddings, per-head q_norm /
k_norm) checkpoints made here with save_pretrained, trained by one generated project (--cp 2): Qwen3 at cp 2 x
dp_shard 2 on 4 gloo ranks (FSDP over dp_shard x cp), Llama at cp 2 on 2 (FSDP over the cp ranks); both must equal
one process in losses, gradient norms and final weights, and step 1's loss must be plain transformers' on the same
batch. (cp 2 x tp 2 composes, as for llama: equal to one process by hand, for Llama, at 4 ranks; not run here, ~12
CPU-s more.)

CPU ranks cannot run ring attention as torch ships it: the runs put tests/helpers/cp_cpu_shim on PYTHONPATH (see
tests/test_context_parallel.py), which gives torch's ring attention the CPU kernel; the project's code path is the
GPU one. One process (tests/helpers/hf_cp_reference.py) answers the refusal cases of preflight.py and computes both
references. A model whose attention ring attention cannot split is refused in one line by preflight (its attention
run once on the meta device), and where its config.json says so by `fsdp2gen new` (test_bad_input_generator.py).

No network: every model is a local folder written by the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, torchrun_env

SHIM = HELPERS / "cp_cpu_shim"
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
# 3 steps of 2 micro-batches; seq_len 16: 2 x cp pieces of 8 tokens.
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.grad_accum_steps", "2",
         "--training.warmup_steps", "2", "--training.lr", "1e-3", "--training.steps", "3", "--eval.every", "0",
         "--job.device", "cpu", "--job.log_every", "1"]  # fmt: skip
# The ranks of each model's run (parallel.dp_shard -1: the ranks cp leaves).
RANKS = {"qwen3": 4, "llama": 2}
TOLERANCE = 1e-5
# As tests/test_hf_parallel.py: Adam keeps an element's summation-order roundoff at up to lr x 1e-2 in the weights.
WEIGHTS_TOLERANCE = 2e-5
FIX = "which ring attention (causal SDPA over the whole sequence, in pieces) cannot split; use --parallel.cp 1"
REFUSALS = {
    # Mistral's sliding window of 4 tokens, shorter than the 16 of a sample.
    "sliding-window": ("mistral", [],
                       f"parallel.cp = 2: MistralForCausalLM attends through a sliding window of 4 tokens, fewer than "
                       f"training.seq_len (16), {FIX}"),
    "document-mask": ("qwen3", ["--data.document_mask", "true"],
                      "parallel.cp = 2 cannot mask documents (ring attention is causal over the whole sequence); run "
                      "with --data.document_mask false, or --parallel.cp 1 to keep documents apart"),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    root = tmp_path_factory.mktemp("hf-cp-models")
    configs = {
        "llama": LlamaConfig(**SIZES),
        "qwen3": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
        "mistral": MistralConfig(**SIZES, sliding_window=4),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The folder of every run's output, and the reference process's answers ({"preflight", "plain"})."""
    root = tmp_path_factory.mktemp("hf-cp")
    project = generate(root / "project", "--family", "hf", "--hf-model", str(models["qwen3"]), "--gpus", "4",
                       "--cp", "2", "--fp32")  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{SHIM}:{project}"}
    for name, ranks in RANKS.items():
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   "--max-restarts=0", "train.py", *TRAIN, "--model.path", str(models[name]),
                   "--job.output_dir", str(root / f"{name}-cp2")]  # fmt: skip
        result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cases = {case: ["--world-size", "4", *TRAIN, "--model.path", str(models[name]), *args, "--job.output_dir",
                    str(root / case)] for case, (name, args, _) in REFUSALS.items()}  # fmt: skip
    references = {name: [*TRAIN, "--model.path", str(models[name]), "--job.output_dir", str(root / f"{name}-one")]
                  for name in RANKS}  # fmt: skip
    (root / "cases.json").write_text(json.dumps(cases))
    (root / "runs.json").write_text(json.dumps(references))
    # Without the shim: one process has no cp ranks, and the refusals come before the CPU kernel's.
    reference = subprocess.run(
        [sys.executable, str(HELPERS / "hf_cp_reference.py"), str(root / "cases.json"), str(root / "runs.json")],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    return root, json.loads(reference.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", sorted(RANKS))
def test_cp2_trains_equal_to_one_process_and_to_plain_transformers(
    runs: tuple[Path, dict], models: dict[str, Path], name: str
) -> None:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, found = runs
    parallel, single = metrics(root / f"{name}-cp2"), metrics(root / f"{name}-one")
    assert [r["step"] for r in parallel] == [r["step"] for r in single] == [1, 2, 3]
    for a, b in zip(parallel, single, strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=TOLERANCE, abs=TOLERANCE), (key, a, b)
    assert parallel[0]["loss"] == pytest.approx(found["plain"][name], rel=TOLERANCE, abs=TOLERANCE)
    # The final weights: the checkpoints hold whole tensors whatever the layout.
    weights = {}
    for run in ("cp2", "one"):
        dcp_to_torch_save(root / f"{name}-{run}" / "checkpoints" / "step-3", root / f"{name}-{run}.pt")
        weights[run] = torch.load(root / f"{name}-{run}.pt", weights_only=True)["train"]["model"]
    assert sorted(weights["cp2"]) == sorted(weights["one"])
    for key, value in weights["one"].items():
        torch.testing.assert_close(weights["cp2"][key], value, rtol=0, atol=WEIGHTS_TOLERANCE, msg=key)
    # Training moved them away from the pretrained ones: the comparison is of trained weights.
    pretrained = load_file(models[name] / "model.safetensors")
    assert set(pretrained) <= set(weights["one"])
    assert all(not torch.equal(weights["one"][key], value) for key, value in pretrained.items())


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_ring_attention_cannot_split_is_refused_by_preflight_in_one_line(
    runs: tuple[Path, dict], case: str
) -> None:
    root, found = runs
    code, _, stderr = found["preflight"][case]
    assert (code, stderr) == (2, f"preflight.py: error: {REFUSALS[case][2]}\n")
    assert not (root / case).exists()  # nothing written


# The refusals of `fsdp2gen new` (from config.json) are cases of test_bad_input_generator.py (cp-hf-*).
