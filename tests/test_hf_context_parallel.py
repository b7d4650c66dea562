"""Family hf with context parallelism (`--cp`): ring attention through transformers' own SDPA attention, every
sequence split over the cp ranks (context_parallel.py). Tiny Llama, Qwen3 (tied embeddings, per-head q_norm /
k_norm), Qwen3-MoE and Mixtral (transformers' fused experts; their load figures compared too) and Mistral (a sliding
window as long as training.seq_len: the whole causal mask, which ring attention splits) checkpoints made here with
save_pretrained, trained by one generated project (--cp 2): Qwen3 at cp 2 x dp_shard 2 on 4 gloo ranks (FSDP over
dp_shard x cp), Llama, Mixtral and Mistral at cp 2 on 2 (FSDP over the cp ranks); Qwen3-MoE by a project generated
with --ep 2 --cp 2, at ep 2 x cp 2 on 4 ranks (each rank holding 2 of the 4 experts of every layer, the tokens of
its sequence pieces sent to their experts' ranks over the ep group, the experts sharded by FSDP over the cp ranks
that hold the same ones: layout.py's expert_fsdp_mesh); and a tiny Llama with a chat tokenizer fine-tuned with LoRA
on chat data by a `--lora --task sft` project at cp 2 on 2 (the loss mask split over the cp ranks with the tokens).
All must equal one process in losses, gradient norms and final weights (LoRA's: the adapters), and step 1's loss
must be plain transformers' on the same batch. Llama's cp 2 run has rank 1 killed in the middle of step 4 and
restarted by torchrun: it resumes bit for bit. (cp 2 x tp 2 composes, as for llama: equal to one process by hand,
for Llama, at 4 ranks; not run here, ~12 CPU-s more.)

CPU ranks cannot run ring attention as torch ships it: the runs put tests/helpers/cp_cpu_shim on PYTHONPATH (see
tests/test_context_parallel.py), which gives torch's ring attention the CPU kernel; the project's code path is the
GPU one. A model whose attention ring attention cannot split is refused in one line by preflight (its attention run
once on the meta device), and where its config.json says so by `fsdp2gen new` (test_bad_input_generator.py).

Three launches (tests/helpers/several_runs.py), and torchrun's restart of the second: Qwen3's and Qwen3-MoE's on 4
ranks; the chat data's preparation, the LoRA run, Mixtral's, Mistral's and Llama's on 2; then one process (without
the shim: it has no cp ranks, and the refusals come before the CPU kernel's) answers the refusal cases of preflight.py
and makes the six references and plain transformers' losses. No network: every model is a local folder written by
the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, save_tiny_models
from tests.helpers.chats import chat_model, prepare_chats
from tests.helpers.several_runs import assert_resumed_bit_for_bit, launch_several, plain_losses, preflight_answers

SHIM = HELPERS / "cp_cpu_shim"
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
# 4 steps of 2 micro-batches, checkpoints after steps 2 and 4; seq_len 16: 2 x cp pieces of 8 tokens.
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.grad_accum_steps", "2",
         "--training.warmup_steps", "2", "--training.lr", "1e-3", "--training.steps", "4", "--eval.every", "0",
         "--job.device", "cpu", "--job.log_every", "1", "--checkpoint.interval", "2"]  # fmt: skip
STEPS = [1, 2, 3, 4]
# The runs: the model and its other options (given the test's folder). Qwen3 at cp 2 x dp_shard 2 on 4 ranks, Llama
# and the LoRA fine-tuning on chat data (the masked loss: only the responses' tokens are targets, split over the cp
# ranks with the tokens) at cp 2 on 2 (parallel.dp_shard -1: the ranks cp leaves).
RUNS = {
    "qwen3": ("qwen3", lambda root: []),
    "llama": ("llama", lambda root: []),
    # A mixture of experts (transformers' fused experts; each token routed on its own cp rank): Qwen3-MoE at ep 2 x
    # cp 2 on 4 ranks (its own project: ep_cp in runs()), Mixtral at cp 2 on 2.
    "qwen3-moe": ("qwen3-moe", lambda root: []),
    "mixtral": ("mixtral", lambda root: []),
    # Mistral 7B v0.3's sliding_window is null; a window of training.seq_len tokens is the shortest ring attention
    # splits (a token attends to the 15 before it, all there are): plain transformers applies it, cp must match.
    "mistral": ("mistral-window16", lambda root: []),
    "lora-sft": ("chat", lambda root: ["--data.path", str(root / "chats")]),
}
# Llama's run at cp 2 is killed in the middle of step 4 on torchrun's first attempt (several_runs.py's kill).
KILL = {"rank": 1, "step": 4}
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
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("hf-cp-models")
    folders = save_tiny_models(root, {
        "llama": LlamaConfig(**SIZES),
        "qwen3": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
        "mistral": MistralConfig(**SIZES, sliding_window=4),
        "mistral-window16": MistralConfig(**SIZES, sliding_window=16),
        "qwen3-moe": Qwen3MoeConfig(**SIZES, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, tie_word_embeddings=False),
        "mixtral": MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2),
    })  # fmt: skip
    return folders | {"chat": chat_model(root / "chat")}


def options(models: dict[str, Path], root: Path, run: str) -> list[str]:
    """train.py's options of a run (RUNS) whose output folder is root/run."""
    name, extra = RUNS[run.rsplit("-", 1)[0]]
    return [*TRAIN, "--model.path", str(models[name]), *extra(root), "--job.output_dir", str(root / run)]


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """The folder of every run's output, the preflight answers and plain transformers' losses of the one-process
    launch, and the 2-rank launch's output."""
    root = tmp_path_factory.mktemp("hf-cp")
    project = generate(root / "project", "--family", "hf", "--hf-model", str(models["qwen3"]), "--gpus", "4",
                       "--cp", "2", "--fp32")  # fmt: skip
    # LoRA fine-tuning on chat data (--lora --task sft): the same layout, in the same launches (several_runs.py).
    lora = generate(root / "lora", "--family", "hf", "--hf-model", str(models["chat"]), "--lora", "--task", "sft",
                    "--gpus", "2", "--cp", "2", "--fp32")  # fmt: skip
    # Expert parallelism with context parallelism: mesh dp_shard_mod_ep 1 x cp 2 x ep 2, the experts' FSDP over cp.
    ep_cp = generate(root / "ep-cp", "--family", "hf", "--hf-model", str(models["qwen3-moe"]), "--gpus", "4",
                     "--ep", "2", "--cp", "2", "--fp32")  # fmt: skip
    env = {"PYTHONPATH": f"{SHIM}:{project}"}
    cp2x2 = launch_several(project, [options(models, root, "qwen3-cp2"),
                             {"args": options(models, root, "qwen3-moe-cp2"), "project": str(ep_cp)}],
                   root / "cp2x2.json", nproc=4, env=env)  # fmt: skip
    # Llama's run has rank 1 SIGKILLed in step 4 (after its backward, before the optimizer step; the newest
    # checkpoint is step 2's): torchrun restarts both ranks, which resume from step 2 and compute steps 3 and 4 again
    # (the LoRA, Mixtral and Mistral runs, before it, are not run again).
    cp2 = launch_several(project, {
        "scripts": [prepare_chats(lora, root)],
        "runs": [{"args": options(models, root, "lora-sft-cp2"), "project": str(lora)},
                 options(models, root, "mixtral-cp2"),
                 options(models, root, "mistral-cp2"),
                 {"args": options(models, root, "llama-cp2"), "kill": KILL}],
    }, root / "cp2.json", nproc=2, env=env, restarts=1)  # fmt: skip
    cases = {case: ["--world-size", "4", *TRAIN, "--model.path", str(models[name]), *args, "--job.output_dir",
                    str(root / case)] for case, (name, args, _) in REFUSALS.items()}  # fmt: skip
    one = launch_several(project, {
        "preflight": cases,
        "runs": [{"args": options(models, root, f"{run}-one"), "reference": True,
                  **({"project": str(lora)} if run == "lora-sft" else {})} for run in RUNS],
    }, root / "one.json", nproc=1).stdout  # fmt: skip
    plain = {run: plain_losses(one)[str(root / f"{run}-one")] for run in RUNS}
    return root, {"preflight": preflight_answers(one), "plain": plain, "cp2x2": cp2x2.stdout}, cp2.stdout


@pytest.mark.parametrize("name", list(RUNS))
def test_cp2_trains_equal_to_one_process_and_to_plain_transformers(
    runs: tuple[Path, dict, str], models: dict[str, Path], name: str
) -> None:
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, found, _ = runs
    parallel, single = metrics(root / f"{name}-cp2"), metrics(root / f"{name}-one")
    assert [r["step"] for r in parallel] == [r["step"] for r in single] == STEPS
    for a, b in zip(parallel, single, strict=True):
        for key in (key for key in ("loss", "grad_norm", "moe_load_max_mean", "moe_load_min_mean") if key in b):
            assert a[key] == pytest.approx(b[key], rel=TOLERANCE, abs=TOLERANCE), (key, a, b)
    assert parallel[0]["loss"] == pytest.approx(found["plain"][name], rel=TOLERANCE, abs=TOLERANCE)
    if name == "qwen3-moe":  # the run was ep 2 x cp 2: each expert sharded over the 2 cp ranks that hold it
        assert ("expert parallelism: 2 of the 4 experts of each of 2 mixture-of-experts layers per rank, sharded "
                "over the 2 ranks that hold the same ones") in found["cp2x2"]  # fmt: skip
    # The final weights: the checkpoints hold whole tensors whatever the layout (LoRA's: the adapters only).
    weights = {}
    for run in ("cp2", "one"):
        dcp_to_torch_save(root / f"{name}-{run}" / "checkpoints" / "step-4", root / f"{name}-{run}.pt")
        weights[run] = torch.load(root / f"{name}-{run}.pt", weights_only=True)["train"]["model"]
    assert sorted(weights["cp2"]) == sorted(weights["one"])
    for key, value in weights["one"].items():
        torch.testing.assert_close(weights["cp2"][key], value, rtol=0, atol=WEIGHTS_TOLERANCE, msg=key)
    # Training moved them away from where they started: the comparison is of trained weights.
    if name == "lora-sft":  # every adapter's B starts at zero
        b = [value for key, value in weights["one"].items() if "lora_B" in key]
        assert b and all(value.abs().max() > 0 for value in b)
        return
    pretrained = load_file(models[RUNS[name][0]] / "model.safetensors")
    # A mixture-of-experts file holds each expert apart (transformers fuses them on loading): the keys in common.
    shared = {key: value for key, value in pretrained.items() if key in weights["one"]}
    assert shared and (name in ("qwen3-moe", "mixtral") or shared.keys() == pretrained.keys())
    assert all(not torch.equal(weights["one"][key], value) for key, value in shared.items())


def test_a_rank_killed_mid_step_under_cp2_restarts_and_resumes_bit_for_bit(runs: tuple[Path, dict, str]) -> None:
    # torchrun --max-restarts 1 restarts both ranks from the step-2 checkpoint: each loads its FSDP shards of the
    # weights and of Adam's moments, the data position and the RNG states, and takes its pieces of every sequence
    # again. Step 3, computed again, is the first attempt's exactly (==). (The whole run equals one process: the test
    # above, with this run.)
    root, _, stdout = runs
    assert sorted(row["step"] for row in metrics(root / "llama-cp2")) == STEPS
    assert_resumed_bit_for_bit(stdout, root / "llama-cp2", KILL, 2, ("loss", "grad_norm"))


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_ring_attention_cannot_split_is_refused_by_preflight_in_one_line(
    runs: tuple[Path, dict, str], case: str
) -> None:
    root, found, _ = runs
    code, _, stderr = found["preflight"][case]
    assert (code, stderr) == (2, f"preflight.py: error: {REFUSALS[case][2]}\n")
    assert not (root / case).exists()  # nothing written


# The refusals of `fsdp2gen new` (from config.json) are cases of test_bad_input_generator.py (cp-hf-*).
