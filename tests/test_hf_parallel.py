"""Family hf with tensor parallelism (`--tp`), from the plan each transformers model declares (tensor_parallel.py):
tiny Qwen3 (tied embeddings, per-head q_norm / k_norm) and Qwen3-MoE (untied embeddings) checkpoints made here with
save_pretrained, trained by a generated project on tp 2 x dp 2 (4 gloo ranks) and by one process; both must agree
in losses, gradient norms and final weights, and step 1's loss must be plain transformers' on the same batch.
(Llama's plan is Qwen3's without q_norm / k_norm, its untied output layer Qwen3-MoE's: these two run every word
of it, at ~35 CPU-s a model.) GPT-2, which declares no plan, is refused in one line by `fsdp2gen new` and by
preflight; the plans fsdp2gen reads (templates/hf_plans.json, and the README's table made from them) are the
installed transformers'.

No network: every model is a local folder written by the test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, fsdp2gen, generate, metrics, torchrun, torchrun_env

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "2",
         "--training.lr", "1e-3", "--training.steps", "3", "--eval.every", "0", "--job.device", "cpu",
         "--job.log_every", "1"]  # fmt: skip
TOLERANCE = 1e-5  # fp32: the tp ranks sum partial matmuls in another order than one process
# lr 1e-3 and 2e-5 for the weights, as tests/test_moe.py and test_pipeline_parallel.py's tp runs: Adam divides each
# gradient element by its magnitude, so an element whose terms nearly cancel keeps its summation-order roundoff at
# up to lr x 1e-2 in the weights (measured here after 3 steps: 1.0e-5 at most; at lr 1e-2, 1.0e-4), while the
# losses, gradient norms and Adam moments agree within 1e-5.
WEIGHTS_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen3Config, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("hf-tp-models")
    configs = {
        "qwen3-tied": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
        # Mixture of experts: the plan splits attention (and names a dense MLP its MoE layers lack); the experts
        # stay whole on every tp rank, sharded by FSDP. Untied: lm_head's own plan (colwise_gather_output).
        "qwen3-moe": Qwen3MoeConfig(
            **SIZES,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        "gpt2": GPT2Config(
            n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module")
def project(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One project; each test points model.path at its model.
    return generate(tmp_path_factory.mktemp("hf-tp") / "run", "--family", "hf", "--hf-model",
                    str(models["qwen3-tied"]), "--gpus", "4", "--tp", "2", "--fp32")  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3-tied", "qwen3-moe"])
def test_tp2_dp2_trains_equal_to_one_process_and_to_plain_transformers(
    project: Path, models: dict[str, Path], name: str, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model = ["--model.path", str(models[name])]
    torchrun(project, "train.py", *TRAIN, *model, "--job.output_dir", str(tmp_path / "tp2"), nproc=4)
    # One process: train.py's training, then plain transformers' loss on step 1's batch.
    one = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "hf_one_process.py"), *TRAIN, *model,
         "--job.output_dir", str(tmp_path / "one")],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True,
    )  # fmt: skip
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    parallel, single = metrics(tmp_path / "tp2"), metrics(tmp_path / "one")
    assert [r["step"] for r in parallel] == [r["step"] for r in single] == [1, 2, 3]
    for a, b in zip(parallel, single, strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=TOLERANCE, abs=TOLERANCE), (key, a, b)
    plain = float(re.search(r"plain transformers step 1 loss (\S+)", one.stdout).group(1))
    assert parallel[0]["loss"] == pytest.approx(plain, rel=TOLERANCE, abs=TOLERANCE)
    # The final weights: the checkpoints hold whole tensors whatever the layout.
    weights = {}
    for run in ("tp2", "one"):
        dcp_to_torch_save(tmp_path / run / "checkpoints" / "step-3", tmp_path / f"{run}.pt")
        weights[run] = torch.load(tmp_path / f"{run}.pt", weights_only=True)["train"]["model"]
    assert sorted(weights["tp2"]) == sorted(weights["one"])
    for key, value in weights["one"].items():
        torch.testing.assert_close(weights["tp2"][key], value, rtol=0, atol=WEIGHTS_TOLERANCE, msg=key)
    # Training moved them away from the pretrained ones (3 steps at lr 1e-3): the comparison is of trained weights.
    # (A mixture-of-experts file holds each expert apart: the keys the model shares with it are compared.)
    pretrained = {key: value for key, value in load_file(models[name] / "model.safetensors").items()
                  if key in weights["one"]}  # fmt: skip
    assert pretrained and all(not torch.equal(weights["one"][key], value) for key, value in pretrained.items())


# Run in the tp project: preflight.py with --world-size 4 (its output captured), then which plan words
# tensor_parallel.torch_style translates, of every word transformers registers and those README.md.jinja lists.
PREFLIGHT_AND_WORDS = """
import contextlib, io, json, sys
import preflight, tensor_parallel
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

argv, listed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["preflight.py", *argv]
stderr, code = io.StringIO(), 0
with contextlib.redirect_stderr(stderr):
    try:
        preflight.main()
    except SystemExit as exit:
        code = exit.code
words = sorted(set(ALL_PARALLEL_STYLES.keys()) | set(listed))
translated = [word for word in words if word == "replicate" or tensor_parallel.torch_style(word, False) is not None]
print(json.dumps({"code": code, "stderr": stderr.getvalue(), "translated": translated}))
"""


def test_a_model_without_a_tp_plan_is_refused_at_new_and_at_run_time_and_the_plans_are_transformers(
    project: Path, models: dict[str, Path], tmp_path: Path
) -> None:
    import json

    # fsdp2gen new: one line, exit 2, nothing written (templates/hf_plans.json says gpt2 declares no plan).
    new = fsdp2gen("new", str(tmp_path / "gpt2-tp"), "--yes", "--family", "hf", "--hf-model", str(models["gpt2"]),
                   "--gpus", "4", "--tp", "2")  # fmt: skip
    config = models["gpt2"] / "config.json"
    version = json.loads((REPO / "templates" / "hf_plans.json").read_text())["transformers"]
    assert (new.returncode, new.stderr) == (2, (
        f"fsdp2gen: error: --tp: GPT2LMHeadModel ({config}: model_type gpt2) declares no tensor-parallel plan in "
        f"transformers {version} (its config class's base_model_tp_plan is empty); use --tp 1 (FSDP shards it over "
        "every GPU)\n"
    ))  # fmt: skip
    assert not (tmp_path / "gpt2-tp").exists()
    # Run time: the tp project pointed at GPT-2 stops in preflight, before anything is built.
    readme_words = re.search(r"set hf_tp_words = (\[.*?\])", (REPO / "templates" / "project" / "README.md.jinja")
                             .read_text()).group(1)  # fmt: skip
    argv = ["--world-size", "4", *TRAIN, "--model.path", str(models["gpt2"]), "--job.output_dir",
            str(tmp_path / "out")]  # fmt: skip
    probe = subprocess.run(
        [sys.executable, "-c", PREFLIGHT_AND_WORDS, json.dumps(argv), readme_words],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.splitlines()[-1])
    assert (found["code"], found["stderr"]) == (2, (
        "preflight.py: error: parallel.tp = 2: GPT2LMHeadModel declares no tensor-parallel plan (transformers' "
        "GPT2Config.base_model_tp_plan is empty); use --parallel.tp 1 (FSDP shards it over every rank)\n"
    ))  # fmt: skip
    assert not (tmp_path / "out").exists()
    # The README's table calls translated exactly the words tensor_parallel.py translates.
    assert found["translated"] == sorted(json.loads(readme_words))
    # templates/hf_plans.json is what the installed transformers declares (else: python scripts/hf_plans.py).
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "hf_plans.py"), "--check"], capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]
