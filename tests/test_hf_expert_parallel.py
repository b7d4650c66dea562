"""Family hf with expert parallelism (`fsdp2gen new --family hf --ep N`), from the plan each transformers
mixture-of-experts model declares (expert_parallel.py): tiny Qwen3-MoE and Mixtral checkpoints made here with
save_pretrained (one tensor per expert in the files, fused experts in the model), trained by a generated project on
ep 2 x dp_shard_mod_ep 2 (4 gloo ranks, each holding 2 of the 4 experts of every layer, each of those sharded over
2 ranks) and by one process: both agree in losses, gradient norms, load figures and final weights, step 1's loss is
plain transformers' on the same batch, the checkpoints of step 2 resume across layouts (ep 2's with ep 1, one
process's with ep 2) equal to the uninterrupted run, and scripts/export.py and generate.py read the ep 2 checkpoints
as one process's. The Qwen3-MoE run at ep 2 has rank 3 killed in the middle of step 4 and restarted by torchrun: it
resumes bit for bit (and still equals one process). LoRA on the Qwen3-MoE (a project generated --lora --ep 2, its
fused experts' adapters split by expert as the experts are) does the same against its one-process run, resumes its
ep 2 checkpoint with ep 1, and exports as one process's. A dense model is refused in one line by `fsdp2gen new --ep`
and by preflight.

Two launches in all (tests/helpers/several_runs.py), and torchrun's restart of the second: the one-process launch
runs the preflight cases and both references (and plain transformers); the 4-rank one trains both models and the
resumes across layouts. No network: every model is a local folder written here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO, fsdp2gen, generate, metrics, save_tiny_models
from tests.helpers.chats import chat_model, prepare_chats
from tests.helpers.exports import assert_read_as_one_process
from tests.helpers.several_runs import assert_resumed_bit_for_bit, launch_several, plain_losses, preflight_answers

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "max_position_embeddings": 64, "num_experts_per_tok": 2}  # fmt: skip
# 4 steps, checkpoints after steps 2 and 4.
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "2",
         "--training.lr", "1e-3", "--training.steps", "4", "--eval.every", "0", "--job.device", "cpu",
         "--job.log_every", "1", "--checkpoint.interval", "2"]  # fmt: skip
STEPS = [1, 2, 3, 4]
# The ep 2 run of Qwen3-MoE is killed in the middle of step 4 on torchrun's first attempt (several_runs.py's kill).
KILL = {"rank": 3, "step": 4}
MOE = ("qwen3-moe", "mixtral")
# Full fine-tuning on chat data (--task sft: only the responses' tokens are targets; data.document_mask on, each
# conversation attending to itself) of a Qwen3-MoE with a chat tokenizer, by a project generated for it, in the same
# launches; and LoRA on the Qwen3-MoE (--lora: attention and the fused experts adapted, each rank training the
# adapters of its own experts, expert_parallel.apply_lora_expert_parallel), by a project generated --lora --ep 2.
RUNS = (*MOE, "sft", "lora")
TOLERANCE = 1e-5  # fp32: the all-to-all sums each token's experts in another order than one process
# The final weights: Adam divides each gradient element by its magnitude, so an element whose terms nearly cancel
# keeps its summation-order roundoff at up to lr x 1e-2 (tests/test_hf_parallel.py measured 1.0e-5 at lr 1e-3).
WEIGHTS_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """4 experts of hidden 16 in each of 2 layers, top 2: Qwen3-MoE and Mixtral; and a dense Qwen3."""
    from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("hf-ep-models")
    folders = save_tiny_models(root, {
        "qwen3-moe": Qwen3MoeConfig(**SIZES, num_experts=4, moe_intermediate_size=16, head_dim=8),
        "mixtral": MixtralConfig(**SIZES, num_local_experts=4, intermediate_size=16),
        "qwen3": Qwen3Config(**SIZES, intermediate_size=32, head_dim=8),
    })  # fmt: skip
    sizes = SIZES | {"vocab_size": 320}  # the chat tokenizer's 300 tokens
    folders["sft"] = chat_model(
        root / "sft", Qwen3MoeConfig(**sizes, num_experts=4, moe_intermediate_size=16, head_dim=8)
    )
    folders["lora"] = folders["qwen3-moe"]
    # 3 experts, which 2 ep ranks cannot share out: its config.json only (trained from scratch, nothing loaded).
    folders["three-experts"] = root / "three-experts"
    Qwen3MoeConfig(**SIZES, num_experts=3, moe_intermediate_size=16, head_dim=8).save_pretrained(root / "three-experts")
    return folders


@pytest.fixture(scope="module")
def runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run in one process (and the preflight cases), then at ep 2 on 4 ranks (Qwen3-MoE's run killed mid-step
    and restarted), and the resumes across layouts."""
    root = tmp_path_factory.mktemp("hf-ep")
    project = generate(root / "project", "--family", "hf", "--hf-model", str(models["qwen3-moe"]), "--gpus", "4",
                       "--ep", "2", "--fp32")  # fmt: skip

    sft = generate(root / "sft", "--family", "hf", "--hf-model", str(models["sft"]), "--task", "sft", "--gpus", "4",
                   "--ep", "2", "--fp32")  # fmt: skip
    lora = generate(root / "lora", "--family", "hf", "--hf-model", str(models["qwen3-moe"]), "--lora", "--gpus", "4",
                    "--ep", "2", "--fp32")  # fmt: skip

    def options(name: str, run: str) -> list[str]:
        data = ["--data.path", str(root / "chats")] if name == "sft" else []
        return [*TRAIN, "--model.path", str(models[name]), *data, "--job.output_dir", str(root / f"{run}-{name}")]

    def project_of(name: str) -> dict:
        return {"project": str({"sft": sft, "lora": lora}[name])} if name in ("sft", "lora") else {}

    dense = [*TRAIN, "--model.path", str(models["qwen3"]), "--job.output_dir", str(root / "refused")]
    three = [*TRAIN, "--model.path", str(models["three-experts"]), "--model.pretrained", "false", "--job.output_dir",
             str(root / "refused")]  # fmt: skip
    one = launch_several(project, {
        "scripts": [prepare_chats(sft, root)],
        "preflight": {"dense": ["--world-size", "4", *dense], "three-experts": ["--world-size", "4", *three]},
        "runs": [{"args": options(name, "one"), "reference": True, **project_of(name)} for name in RUNS],
    }, root / "one.json", nproc=1)  # fmt: skip

    # Rank 3 SIGKILLs itself in step 4 (after its backward, before the optimizer step; the newest checkpoint is
    # step 2's): torchrun restarts all 4 ranks, which resume from step 2 and compute steps 3 and 4 again. Then the
    # checkpoints of step 2 change layout: the ep 2 run's resumed with parallel.ep 1 (FSDP over the 4 ranks, every
    # expert on each), and the one process's resumed at ep 2 (each rank reading only its experts), each from a copy
    # of its folder without the step-4 checkpoint.
    def resumed(run: str, source: str, *layout: str, name: str = "qwen3-moe") -> dict:
        interrupted = {"from": str(root / f"{source}-{name}"), "remove": ["checkpoints/step-4"]}
        return {"args": [*options(name, run), *layout], "interrupted": interrupted, **project_of(name)}

    ep2 = launch_several(project, {
        "runs": [{"args": options("qwen3-moe", "ep2"), "kill": KILL}, options("mixtral", "ep2"),
                 {"args": options("sft", "ep2"), **project_of("sft")},
                 {"args": options("lora", "ep2"), **project_of("lora")},
                 resumed("resume", "ep2", "--parallel.ep", "1"), resumed("resume-ep2", "one"),
                 resumed("resume", "ep2", "--parallel.ep", "1", name="lora")],
    }, root / "ep2.json", nproc=4, restarts=1)  # fmt: skip
    return {"root": root, "ep2": ep2, "one": one, "project": project, "lora": lora}


def final_weights(run: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "step-4", run / "step-4.pt")
    return torch.load(run / "step-4.pt", weights_only=True)["train"]["model"]


def assert_same_run(got: Path, expected: Path, steps: list[int]) -> None:
    """Losses, gradient norms and load figures of `steps`, and the final weights, equal within the tolerances."""
    import torch

    mine = {row["step"]: row for row in metrics(got) if row["step"] in steps}
    theirs = {row["step"]: row for row in metrics(expected) if row["step"] in steps}
    assert sorted(mine) == sorted(theirs) == steps
    for step in steps:
        for key in ("loss", "grad_norm", "moe_load_max_mean", "moe_load_min_mean"):
            assert mine[step][key] == pytest.approx(theirs[step][key], rel=TOLERANCE, abs=TOLERANCE), (key, step)
    weights, reference = final_weights(got), final_weights(expected)
    assert sorted(weights) == sorted(reference)  # the same names whatever ep was
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=WEIGHTS_TOLERANCE, msg=key)


@pytest.mark.parametrize("name", RUNS)
def test_ep2_x_dp2_trains_equal_to_one_process_and_to_plain_transformers(runs: dict, name: str) -> None:
    root = runs["root"]
    # Rank 0 says how the experts are shared out: 4 per layer over 2 ranks, each rank's 2 sharded over 2 ranks.
    shared_out = "expert parallelism: 2 of the 4 experts of each of 2 mixture-of-experts layers per rank, sharded over"
    assert f"{shared_out} the 2 ranks that hold the same ones" in runs["ep2"].stdout
    assert_same_run(root / f"ep2-{name}", root / f"one-{name}", STEPS)
    # Step 1's loss is plain transformers' (from_pretrained, its own logits) on the same batch: the experts each
    # rank read from the per-expert files are the right ones.
    plain = plain_losses(runs["one"].stdout)[str(root / f"one-{name}")]
    ep2 = metrics(root / f"ep2-{name}")[0]["loss"]
    assert ep2 == pytest.approx(plain, rel=TOLERANCE, abs=TOLERANCE)


def test_a_rank_killed_mid_step_under_ep2_dp2_restarts_and_resumes_bit_for_bit(runs: dict) -> None:
    # torchrun --max-restarts 1 restarts all 4 ranks from the step-2 checkpoint: each loads its 2 experts per layer
    # (its FSDP shard of them) and of their Adam moments, the data position and the RNG states. Step 3, computed
    # again, is the first attempt's exactly (==), load figures included. (The whole run equals one process: the
    # test above, with this run.)
    run = runs["root"] / "ep2-qwen3-moe"
    assert sorted(row["step"] for row in metrics(run)) == STEPS
    keys = ("loss", "grad_norm", "moe_load_max_mean", "moe_load_min_mean")
    assert_resumed_bit_for_bit(runs["ep2"].stdout, run, KILL, 2, keys)


def test_checkpoints_resume_across_layouts_ep2_to_ep1_and_one_process_to_ep2(runs: dict) -> None:
    # The same 4 ranks: ep 2's checkpoint of step 2 resumed with ep 1, and one process's resumed with ep 2; steps 3
    # and 4 and the final weights are the uninterrupted one-process run's (within the layouts' rounding). LoRA's
    # ep 2 checkpoint too, with ep 1: the experts' adapters (and their Adam moments) are saved whole.
    root = runs["root"]
    for run, source, name in (("resume", "ep2", "qwen3-moe"), ("resume-ep2", "one", "qwen3-moe"),
                              ("resume", "ep2", "lora")):  # fmt: skip
        checkpoint = root / f"{run}-{name}" / "checkpoints" / "step-2"
        assert f"resumed from {checkpoint} at step 2" in runs["ep2"].stdout, (source, runs["ep2"].stdout[-3000:])
        assert_same_run(root / f"{run}-{name}", root / f"one-{name}", [3, 4])


@pytest.mark.parametrize("name", (*MOE, "lora"))
def test_export_and_generate_read_the_ep2_checkpoint_as_the_one_process_one(
    runs: dict, models: dict[str, Path], name: str
) -> None:
    # Each rank saved its own experts: exported, they are the per-expert files of the one-process run's export.
    # LoRA's: the adapters merged into the per-expert weights (the experts' lora_B back in peft's layout).
    from safetensors.torch import load_file

    step = Path("checkpoints") / "step-4"
    root = runs["root"]
    project = runs["lora" if name == "lora" else "project"]
    assert_read_as_one_process(project, root / f"ep2-{name}" / step, root / f"one-{name}" / step,
                               WEIGHTS_TOLERANCE, generates=name != "lora")  # fmt: skip
    exported = load_file(root / f"ep2-{name}" / "exported-step-4" / "model.safetensors")
    assert any(".experts.3." in key for key in exported)
    if name == "lora":  # trained: merged, each expert's weights moved from the pretrained ones
        pretrained = load_file(models["qwen3-moe"] / "model.safetensors")
        for key in ("model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
            assert (exported[key] - pretrained[key]).abs().max().item() > 1e-4, key


def test_a_dense_model_or_unshareable_experts_are_refused_at_new_and_in_preflight(
    runs: dict, models: dict[str, Path], tmp_path: Path
) -> None:
    # Run time: the ep project pointed at a dense Qwen3 stops in preflight, before anything is built.
    code, _, stderr = preflight_answers(runs["one"].stdout)["dense"]
    assert (code, stderr) == (2, (
        "preflight.py: error: parallel.ep = 2: Qwen3ForCausalLM declares no expert-parallel plan (transformers' "
        "Qwen3Config.base_model_ep_plan is empty: a dense model has no experts to share out); use --parallel.ep 1\n"
    ))  # fmt: skip
    # A mixture-of-experts model whose experts the ep ranks cannot share out equally, from its config.json.
    code, _, stderr = preflight_answers(runs["one"].stdout)["three-experts"]
    assert (code, stderr) == (2, (
        "preflight.py: error: the model's 3 experts (its config.json) must be divisible by parallel.ep (2), which "
        "shares them out equally; e.g. --parallel.ep 1\n"
    ))  # fmt: skip
    assert not (runs["root"] / "refused").exists()
    # fsdp2gen new: one line, exit 2, nothing written (templates/hf_plans.json: qwen3 declares no ep plan); and an
    # MoE model whose experts the GPUs cannot share out equally.
    version = json.loads((REPO / "templates" / "hf_plans.json").read_text())["transformers"]
    config = models["qwen3"] / "config.json"
    new = fsdp2gen("new", str(tmp_path / "dense"), "--yes", "--family", "hf", "--hf-model", str(models["qwen3"]),
                   "--gpus", "4", "--ep", "2")  # fmt: skip
    assert (new.returncode, new.stderr) == (2, (
        f"fsdp2gen: error: --ep: Qwen3ForCausalLM ({config}: model_type qwen3) declares no expert-parallel plan in "
        f"transformers {version} (its config class's base_model_ep_plan is empty: a dense model has no experts to "
        "share out); use --ep 1\n"
    ))  # fmt: skip
    config = models["mixtral"] / "config.json"
    new = fsdp2gen("new", str(tmp_path / "odd"), "--yes", "--family", "hf", "--hf-model", str(models["mixtral"]),
                   "--gpus", "8", "--ep", "8")  # fmt: skip
    assert (new.returncode, new.stderr) == (2, (
        f"fsdp2gen: error: --ep: {config} has num_local_experts 4, which 8 GPUs cannot share out equally; e.g. --ep 4\n"
    ))  # fmt: skip
    assert not (tmp_path / "dense").exists() and not (tmp_path / "odd").exists()


def test_the_readme_table_says_which_model_types_ep_runs_from_their_declared_plans(runs: dict) -> None:
    # The words the README's table calls applied are expert_parallel.py's PLAN_WORDS; the rows come from the plans
    # of the installed transformers (templates/hf_plans.json, checked in tests/test_hf_parallel.py).
    source = (runs["project"] / "expert_parallel.py").read_text()
    applied = sorted(re.findall(r'"(\w+)"', re.search(r"PLAN_WORDS = \((.*?)\)", source).group(1)))
    listed = re.search(r"set hf_ep_words = (\[.*?\])", (REPO / "templates" / "project" / "README.md.jinja").read_text())
    assert applied == sorted(json.loads(listed.group(1))) == ["ep_dispatch_experts", "grouped_gemm"]
    plans = json.loads((REPO / "templates" / "hf_plans.json").read_text())["models"]
    readme = (runs["project"] / "README.md").read_text()
    for model_type in ("qwen3_moe", "mixtral", "qwen3"):
        ep = "yes" if plans[model_type]["ep"] else "no: no ep plan"
        assert re.search(rf"^\| `{model_type}` \| {plans[model_type]['class']} \| [^|]+ \| {ep} \|", readme, re.M)
    # A plan with words expert_parallel.py does not apply (Gemma 4's ep plan also splits its dense MLP).
    others = {name: sorted(set(plan["ep"]) - set(applied)) for name, plan in plans.items()}
    name, words = next((name, words) for name, words in sorted(others.items()) if words)
    assert re.search(rf"^\| `{name}` \|.*\| no: plan word {', '.join(words)} not applied \|", readme, re.M)
