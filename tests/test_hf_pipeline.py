"""Family hf with pipeline parallelism (`--pp`), cut by the plan each transformers model declares (pipeline_stages.py):
tiny Llama, Qwen3, Mistral, Qwen3-MoE and Mixtral checkpoints made here with save_pretrained (untied: a tied embedding
cannot span the first and the last stage; the mixtures of experts' blocks hold transformers' fused experts), trained by
a generated project on pp 2 x dp 2 (4 gloo ranks) and by one process; both must agree in losses, gradient norms, the
experts' load figures (summed over the stages) and final weights (fp32, 1e-5), and step 1's loss must be plain
transformers' on the same batch. Qwen3-MoE's runs are by a project generated with `--pp 2 --ep 2`: each stage shares out
its own layers' experts over its 2 dp_shard ranks (expert_parallel.py; Mixtral keeps ep 1), and its step-2 checkpoint
(whole experts under the model's names) resumes without pipeline and without expert parallelism on the same ranks. A
Qwen3 trained from scratch under Interleaved1F1B (4 stages of 1 layer, 2 per rank: rank 0 holds layers 0 and 2) proves
the random initialisation of a stage equal to the whole model's and the merge of a rank's stages. A tiny Llama with a
chat tokenizer is fine-tuned with LoRA on chat data (the loss on the responses' tokens only) by a `--lora --task sft`
project, equal to one process in the same way (its adapters). The Llama run (4 steps) has rank 3 killed in the middle of
step 4 and restarted by torchrun: it resumes bit for bit (and still equals one process); one process's step-2 checkpoint
resumes at pp 2, equal to the uninterrupted run. Models that cannot be cut (GPT-2 declares no plan; tied embeddings; a
mixture of experts whose config.json asks for transformers' load-balancing loss, one function of every layer's router
logits at once; Granite, whose forward scales the embeddings outside the modules its plan names, so that each stage
would scale them again) are refused in one line by `fsdp2gen new` and by preflight.

Two launches for all of it (tests/helpers/several_runs.py runs several train.py runs, of the three projects, in one set
of processes), and torchrun's restart of the second: the chat data's preparation, one process's seven references, plain
transformers and the preflight cases, then the 4 ranks' seven runs and the two resumes across layouts. No network: every
model is a local folder written by the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, fsdp2gen, generate, metrics, save_tiny_models
from tests.helpers.chats import chat_model, prepare_chats
from tests.helpers.several_runs import assert_resumed_bit_for_bit, launch_several, plain_losses, preflight_answers

SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
# 2 micro-batches per step (1F1B needs as many as pp ranks), checkpoints after steps 2 and 3 (Llama's: 2 and 4).
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "8", "--training.grad_accum_steps", "2",
         "--training.warmup_steps", "2", "--training.lr", "1e-3", "--training.steps", "3", "--eval.every", "0",
         "--job.device", "cpu", "--job.log_every", "1", "--checkpoint.interval", "2"]  # fmt: skip
TOLERANCE = 1e-5
MOE = {**SIZES, "head_dim": 16, "num_experts_per_tok": 2, "tie_word_embeddings": False}
# The figures compared per step: the mixtures of experts' load figures too (each stage counts its own layers).
COMPARED = ("loss", "grad_norm", "moe_load_max_mean", "moe_load_min_mean")
# Llama's pp 2 x dp 2 run (4 steps: the kill needs a step between its newest checkpoint and the killed step to
# compare) is killed in the middle of step 4 on torchrun's first attempt (several_runs.py's kill): rank 3, dp rank 1
# of the last stage.
KILL = {"rank": 3, "step": 4}
# The runs, by name: the model, the options of both its runs, and those of the pp 2 x dp 2 one only. From scratch
# at lr 1e-4: Adam turns the summation-order roundoff of an element whose gradient nearly cancels into up to ~lr in
# the weights (one embedding element 3.8e-5 off at lr 1e-3, all else within 2.4e-6 and the losses within 1e-7).
RUNS = {
    "llama": ("llama", ["--training.steps", "4"], []),
    "qwen3": ("qwen3", [], []),
    "mistral": ("mistral", [], []),
    # Mixtures of experts: 4 experts, 2 per token, in every decoder layer; no load-balancing loss (transformers'
    # default, output_router_logits false). Qwen3-MoE's by EP_PROJECT: at pp 2 with ep 2 (each rank of a stage holds
    # 2 of the 4 experts of the stage's layers), one process holding every expert.
    "qwen3-moe": ("qwen3-moe", [], ["--parallel.ep", "2"]),
    "mixtral": ("mixtral", [], []),
    "qwen3-scratch": ("qwen3", ["--model.pretrained", "false", "--training.lr", "1e-4"],
                      ["--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_stages_per_rank", "2"]),
    # LoRA fine-tuning on chat data (only the responses' tokens are targets) of a tiny Llama with a chat tokenizer,
    # by a `--lora --task sft` project (LORA_SFT), in the same launches (several_runs.py's "project").
    "lora-sft": ("chat", [], []),
}  # fmt: skip
LORA_SFT = "lora-sft"
EP_PROJECT = "qwen3-moe"  # the run of the project generated with --pp 2 --ep 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import (
        GPT2Config,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    root = tmp_path_factory.mktemp("hf-pp-models")
    configs = {
        "llama": LlamaConfig(**SIZES, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=False),  # per-head q_norm / k_norm
        "mistral": MistralConfig(**SIZES, head_dim=16, tie_word_embeddings=False),
        "qwen3-tied": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
        "qwen3-moe": Qwen3MoeConfig(**MOE, moe_intermediate_size=32, num_experts=4),
        "mixtral": MixtralConfig(**MOE, num_local_experts=4),
        # Asks for transformers' load-balancing loss (refused with a pipeline).
        "qwen3-moe-aux": Qwen3MoeConfig(**MOE, moe_intermediate_size=32, num_experts=4, output_router_logits=True),
        # Scales the embeddings in its base model's forward, outside the modules its plan names.
        "granite": GraniteConfig(**SIZES, embedding_multiplier=12.0, tie_word_embeddings=False),
        "gpt2": GPT2Config(
            n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
        ),  # fmt: skip
    }
    return save_tiny_models(root, configs) | {"chat": chat_model(root / "chat")}


def run_options(models: dict[str, Path], output_dir: Path, name: str, pipeline: bool) -> list[str]:
    model, both, pipelined = RUNS[name]
    data = ["--data.path", str(output_dir.parent / "chats")] if name == LORA_SFT else []
    options = [*TRAIN, "--model.path", str(models[model]), *data, "--job.output_dir", str(output_dir), *both]
    return options + (pipelined if pipeline else ["--parallel.pp", "1"])


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """In one process the runs at pp 1, plain transformers' step-1 losses and the preflight cases; then the pp 2 x
    dp 2 runs (4 ranks; Llama's killed mid-step and restarted) and Llama's resumes across layouts. Returns (root, one
    process's stdout, the 4 ranks' stdout)."""
    root = tmp_path_factory.mktemp("hf-pp")
    project = generate(root / "project", "--family", "hf", "--hf-model", str(models["llama"]), "--gpus", "4",
                       "--pp", "2", "--fp32")  # fmt: skip
    lora = generate(root / "lora", "--family", "hf", "--hf-model", str(models["chat"]), "--lora", "--task", "sft",
                    "--gpus", "4", "--pp", "2", "--fp32")  # fmt: skip
    ep = generate(root / "ep", "--family", "hf", "--hf-model", str(models["qwen3-moe"]), "--gpus", "4", "--pp", "2",
                  "--ep", "2", "--fp32")  # fmt: skip
    projects = {LORA_SFT: {"project": str(lora)}, EP_PROJECT: {"project": str(ep)}}

    def run(name: str, pipeline: bool) -> dict:
        output = root / f"{name}-{'pp2' if pipeline else 'one'}"
        return {"args": run_options(models, output, name, pipeline)} | projects.get(name, {})

    preflight = ["--world-size", "4", *TRAIN, "--job.output_dir", str(root / "refused")]
    spec = {
        "scripts": [prepare_chats(lora, root)],
        "runs": [run(name, False) | {"reference": name != "qwen3-scratch"} for name in RUNS],
        "preflight": {
            name: [*preflight, "--model.path", str(models[name])]
            for name in ("gpt2", "qwen3-tied", "qwen3-moe-aux", "granite")
        },
    }  # fmt: skip
    one = launch_several(project, spec, root / "one.json", nproc=1)

    # Rank 3 SIGKILLs itself in Llama's step 4 (after its backward, before the optimizer step; the newest checkpoint
    # is step 2's): torchrun restarts all 4 ranks, which resume from step 2, compute steps 3 and 4 again, and go on
    # with the runs after it. Then checkpoints of step 2 change layout on the same 4 ranks, each from a copy of its
    # folder without the newer checkpoints: Qwen3-MoE's at pp 2 x ep 2 resumed without a pipeline and with ep 1 (FSDP
    # over the 4 ranks, every expert on each), and Llama's one process's resumed at pp 2 (each stage reading only its
    # own layers).
    def resumed(folder: str, name: str, source: str, pipeline: bool, *layout: str) -> dict:
        interrupted = {"from": str(root / source), "remove": [f"checkpoints/step-{steps(name)[-1]}"]}
        args = [*run_options(models, root / folder, name, pipeline), *layout]
        return {"args": args, "interrupted": interrupted} | projects.get(name, {})

    runs = [run(name, True) | ({"kill": KILL} if name == "llama" else {}) for name in RUNS]
    runs += [resumed("resumed", EP_PROJECT, "qwen3-moe-pp2", False, "--parallel.ep", "1"),
             resumed("resumed-pp2", "llama", "llama-one", True)]  # fmt: skip
    pp2 = launch_several(project, {"runs": runs}, root / "pp2.json", nproc=4, restarts=1)
    return root, one.stdout, pp2.stdout


def steps(name: str) -> list[int]:
    return [1, 2, 3, 4] if name == "llama" else [1, 2, 3]


def weights(run: Path, step: int) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / f"step-{step}", run.with_suffix(f".{step}.pt"))
    return torch.load(run.with_suffix(f".{step}.pt"), weights_only=True)["train"]["model"]


def assert_equal_runs(got: Path, expected: Path, steps: list[int]) -> None:
    """Losses and gradient norms of `steps`, and the final weights (whole tensors, by name), within TOLERANCE."""
    import torch

    a, b = ([r for r in metrics(run) if r["step"] in steps] for run in (got, expected))
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps
    for x, y in zip(a, b, strict=True):
        for key in (key for key in COMPARED if key in y):
            assert x[key] == pytest.approx(y[key], rel=TOLERANCE, abs=TOLERANCE), (key, x, y)
    final, reference = weights(got, steps[-1]), weights(expected, steps[-1])
    # The same names: a stage's parameters keep the whole model's (model.layers.3..., not renumbered).
    assert sorted(final) == sorted(reference)
    for key, value in reference.items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.parametrize("name", list(RUNS))
def test_pp2_x_dp2_trains_equal_to_one_process_and_to_plain_transformers(
    runs: tuple[Path, str, str], name: str
) -> None:
    root, stdout, pp2 = runs
    assert_equal_runs(root / f"{name}-pp2", root / f"{name}-one", steps(name))
    if name == EP_PROJECT:  # rank 0 (stage 0: layers 0 and 1) holds 2 of each of its layers' 4 experts
        assert ("expert parallelism: 2 of the 4 experts of each of 2 mixture-of-experts layers (of this pipeline "
                "stage) per rank, sharded over the 1 ranks that hold the same ones") in pp2  # fmt: skip
    plain = plain_losses(stdout).get(str(root / f"{name}-one"))
    if name == "qwen3-scratch":
        assert plain is None
    else:  # the pretrained runs: transformers' own loss of the files, on step 1's batch
        assert metrics(root / f"{name}-pp2")[0]["loss"] == pytest.approx(plain, rel=TOLERANCE)


def test_a_rank_killed_mid_step_under_pp2_dp2_restarts_and_resumes_bit_for_bit(runs: tuple[Path, str, str]) -> None:
    # torchrun --max-restarts 1 restarts all 4 ranks from the step-2 checkpoint: each loads its stage's FSDP shards
    # of the weights and of Adam's moments, the data position and the RNG states, and the schedule runs its
    # micro-batches again. Step 3, computed again, is the first attempt's exactly (==). (The whole run equals one
    # process: test_pp2_x_dp2_trains_equal_to_one_process_and_to_plain_transformers[llama], with this run.)
    root, _, stdout = runs
    assert sorted(row["step"] for row in metrics(root / "llama-pp2")) == steps("llama")
    assert_resumed_bit_for_bit(stdout, root / "llama-pp2", KILL, 2, ("loss", "grad_norm"))


def test_checkpoints_resume_across_layouts_pp2_ep2_to_pp1_ep1_and_one_process_to_pp2(
    runs: tuple[Path, str, str],
) -> None:
    # The steps after step 2 and the final weights of both resumes are the uninterrupted one-process run's.
    root, _, stdout = runs
    for folder, name in (("resumed", EP_PROJECT), ("resumed-pp2", "llama")):
        assert f"resumed from {root / folder / 'checkpoints' / 'step-2'} at step 2" in stdout, stdout[-3000:]
        assert_equal_runs(root / folder, root / f"{name}-one", steps(name)[2:])


def test_a_model_that_cannot_be_cut_is_refused_at_new_and_in_preflight(
    runs: tuple[Path, str, str], models: dict[str, Path], tmp_path: Path
) -> None:
    root, stdout, _ = runs
    new = fsdp2gen("new", str(tmp_path / "gpt2-pp"), "--yes", "--family", "hf", "--hf-model", str(models["gpt2"]),
                   "--gpus", "4", "--pp", "2")  # fmt: skip
    config = models["gpt2"] / "config.json"
    version = json.loads((REPO / "templates" / "hf_plans.json").read_text())["transformers"]
    assert (new.returncode, new.stderr) == (2, (
        f"fsdp2gen: error: --pp: GPT2LMHeadModel ({config}: model_type gpt2) declares no pipeline plan in "
        f"transformers {version} (its config class's base_model_pp_plan is empty); use --pp 1 (FSDP shards it over "
        "every GPU)\n"
    ))  # fmt: skip
    assert not (tmp_path / "gpt2-pp").exists()
    aux = fsdp2gen("new", str(tmp_path / "aux-pp"), "--yes", "--family", "hf", "--hf-model",
                   str(models["qwen3-moe-aux"]), "--gpus", "4", "--pp", "2")  # fmt: skip
    assert (aux.returncode, aux.stderr) == (2, (
        f"fsdp2gen: error: --pp: Qwen3MoeForCausalLM ({models['qwen3-moe-aux'] / 'config.json'}) sets "
        "output_router_logits: transformers' load-balancing loss is one function of every layer's router logits at "
        "once, which the pipeline stages hold apart; use --pp 1, or set output_router_logits to false in its "
        "config.json\n"
    ))  # fmt: skip
    assert not (tmp_path / "aux-pp").exists()
    cases = preflight_answers(stdout)
    expected = {
        "gpt2": "parallel.pp = 2: GPT2LMHeadModel declares no pipeline plan (transformers' "
        "GPT2Config.base_model_pp_plan is empty); use --parallel.pp 1 (FSDP shards it over every rank)",
        "qwen3-tied": "parallel.pp = 2: Qwen3ForCausalLM ties lm_head to the input embedding (tie_word_embeddings "
        "in its config.json), one matrix that the first and the last pipeline stage cannot share; use "
        "--parallel.pp 1, or train an untied copy (tie_word_embeddings false, lm_head.weight saved as its own "
        "tensor)",
        "qwen3-moe-aux": "parallel.pp = 2: Qwen3MoeForCausalLM's config.json sets output_router_logits: "
        "transformers' load-balancing loss is one function of every layer's router logits at once, which the "
        "pipeline stages hold apart; use --parallel.pp 1, or set output_router_logits to false in its config.json",
        "granite": "parallel.pp = 2: GraniteForCausalLM's forward does more between its embedding and its first "
        "decoder layer than the modules of its pipeline plan (base_model_pp_plan), which every stage would do again; "
        "use --parallel.pp 1",
    }
    for case, line in expected.items():
        assert cases[case] == [2, "", f"preflight.py: error: {line}\n"], case
    assert not (root / "refused").exists()
