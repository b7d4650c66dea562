"""QLoRA (`--qlora`, family hf): LoRA adapters on a base whose adapted linear layers' frozen weights are torchao
NF4 tensors, quantized shard by shard while loading and all-gathered in NF4 by fully_shard. A tiny Llama made here
(hidden 256: every rank's rows of each weight hold whole 64 x 256 NF4 groups on 2 and 4 ranks) with a chat
template; an sft project (document masking on) trained on 2 gloo ranks, no network.

Two torchrun launches: the 4-step run and its resume from step 2 on 2 ranks (one launch), and
tests/helpers/qlora_probe.py on 4 ranks over that run's checkpoint (the NF4 shards against torchao, the next step's
loss against one process, the NF4 after that step, and the memory of a larger model's load). One probe, on 4 ranks:
every boundary between 2 ranks' rows is one between 4 ranks' too. The generator's refusals of --qlora are rows of
tests/test_bad_input_generator.py (docs/bad-inputs-generator.md).
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, save_tiny_llama, torchrun
from tests.helpers.several_runs import launch_several, preflight_answers
from tests.test_lora import export_merged_and_adapter

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "alpha beta gamma delta red green blue one two three four five six seven".split()
SPECIAL = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# k and v as wide as q (4 key-value heads): 256 x 256 and 512 x 256 weights split into 64 or 128 rows of 256.
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512)
TRAIN = ["--training.seq_len", "32", "--training.global_batch_size", "4", "--training.warmup_steps", "0",
         "--training.lr", "1e-2", "--job.device", "cpu", "--job.log_every", "1", "--eval.every", "0",
         "--lora.rank", "4", "--lora.alpha", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def qlora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model (and a larger one, fp16, for the memory measurement), chat data prepared with the project's
    prepare_chat.py, a `--qlora --task sft` project, and its 4-step run saved at steps 2 and 4."""
    root = tmp_path_factory.mktemp("qlora")
    rng = random.Random(0)
    chats = [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
              "response": " ".join(rng.choices(WORDS, k=rng.randint(1, 20)))} for _ in range(200)]  # fmt: skip
    (root / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    text = " ".join(WORDS) * 20
    save_tiny_llama(root / "model", text, special_tokens=SPECIAL, chat_template=TEMPLATE, **SHAPE)
    # 4 x 25 MiB of fp16 weights under NF4 per rank on 4 ranks: well above the noise of resident memory.
    save_tiny_llama(root / "large", text, special_tokens=SPECIAL, chat_template=TEMPLATE, dtype="float16",
                    hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                    intermediate_size=2816)  # fmt: skip
    project = generate(root / "run", "--family", "hf", "--hf-model", str(root / "model"), "--qlora", "--task", "sft",
                       "--gpus", "2", "--fp32")  # fmt: skip
    out, resumed = root / "out", root / "resumed"
    train = [*TRAIN, "--data.path", str(root / "data")]
    # In one launch (tests/helpers/several_runs.py): first (rank 0) the project's prepare_chat.py, then preflight.py
    # with lora.target_modules lm_head (test_linears_that_nf4_cannot_hold_on_these_ranks_stop_before_anything_is_built),
    # then the run, and its resume from step 2 in `resumed`, from a copy of the run's folder without the step-4
    # checkpoint and with the metrics of steps 1-2.
    prepare = ["scripts/prepare_chat.py", str(root / "chats.jsonl"), "--output", str(root / "data")]
    lm_head = ["--world-size", "2", *train, "--lora.target_modules", "lm_head", "--job.output_dir",
               str(root / "lm-head")]  # fmt: skip
    run = [*train, "--training.steps", "4", "--checkpoint.interval", "2"]
    interrupted = {"from": str(out), "remove": ["checkpoints/step-4"], "metrics_lines": 2}
    runs = [[*run, "--job.output_dir", str(out)],
            {"args": [*run, "--job.output_dir", str(resumed)], "interrupted": interrupted}]  # fmt: skip
    result = launch_several(project, {"runs": runs, "scripts": [prepare], "preflight": {"lm_head": lm_head}},
                            root / "runs.json", nproc=2)  # fmt: skip
    # rank 4 on the 7 linear layers of 2 blocks: (256 + 256) x 4 x 4 attention, (256 + 512) x 4 x 3 MLP, per block.
    assert "model: 1,510,656 parameters, 34,816 of them trainable (the others frozen)" in result.stdout
    return {"root": root, "project": project, "model": root / "model", "out": out, "train": train, "resumed": resumed,
            "lm_head": preflight_answers(result.stdout)["lm_head"]}  # fmt: skip


def probe(qlora: dict, nproc: int, output_dir: Path, **env: str) -> dict:
    """tests/helpers/qlora_probe.py on `nproc` ranks over a copy of the run (it adds a step and model_output.pt)."""
    shutil.copytree(qlora["out"], output_dir)
    report = output_dir.parent / f"probe-{nproc}.json"
    torchrun(qlora["project"], str(HELPERS / "qlora_probe.py"), *qlora["train"], "--job.output_dir", str(output_dir),
             nproc=nproc, env={"PROBE_OUT": str(report), **env})  # fmt: skip
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def probed(qlora: dict) -> dict:
    """The probe on 4 ranks (with the larger model's memory), its report and output folder. (One probe: 4 ranks
    split each weight's rows more finely than the run's 2, whose shards train, resume and are checkpointed above.)"""
    out = qlora["root"] / "probed"
    return {"report": probe(qlora, 4, out, MEMORY_MODEL=str(qlora["root"] / "large")), "out": out}


def check_probe(report: dict) -> None:
    # The 7 linear layers of 2 blocks are adapted; each one's frozen weight is NF4, and on every rank each NF4
    # shard is bit for bit the same rows of torchao's to_nf4 of the whole weight (values, scales, factors, mean).
    assert report["adapted_layers"] == report["nf4_weights"] == 14
    for rank in report["ranks"]:
        assert rank["nf4_equal"] == [True] * 14
        # ... and none of it changed in the training step.
        assert rank["nf4_unchanged"] is True
    # The step after the checkpoint (train.py's train_step, packed chats with document masking) has the loss of one
    # fp32 process: from_pretrained's model, its adapted weights dequantized from NF4, with peft adapters; and the
    # checkpoint's logits are that model's.
    assert report["documents_masked"] is True
    assert abs(report["step_loss"] - report["reference_loss"]) <= 1e-5, report
    assert report["reference_logits_diff"] <= 1e-5, report


def test_on_4_ranks_nf4_shards_equal_torchao_a_step_equals_one_process_and_memory_holds_a_quarter(
    probed: dict,
) -> None:
    check_probe(probed["report"])
    memory = probed["report"]["ranks"][1]["memory"]
    print(memory)
    # Rank 1 holds its NF4 shards: 4.13 bits per weight, about a quarter of its fp16 share, plus its unquantized
    # parameters (embeddings, norms: ~1 MiB) and a few MiB of Python objects (6.6 measured in CI, 5-7 here);
    # nothing else stays resident: one fp16 copy of the adapted weights left behind would add ~49 MiB.
    assert memory["nf4_share_mib"] / memory["nf4_fp16_mib"] == pytest.approx(4.127 / 16, abs=1e-3)
    held = memory["nf4_share_mib"] + memory["dense_share_mib"]
    assert held < memory["VmRSS"] < held + 12 < 0.6 * memory["fp16_share_mib"], memory
    # Its peak: that plus constants, whatever the model's size: up to 64 MiB of fp32 slices read at a time
    # (nf4.READ_BUDGET) and their mapped file pages, and torchao's working memory for one chunk of 2**20 values
    # (~150 MiB: each value's distance to the 16 levels, in fp32, twice) (measured here: 200-250 MiB).
    assert memory["peak_mib"] < memory["VmRSS"] + 2 * 64 + 160, memory


def test_resume_is_bit_exact(qlora: dict) -> None:
    # The qlora fixture's second run: steps 3 and 4 resumed from the step-2 checkpoint.
    two = [r["loss"] for r in metrics(qlora["out"])]
    assert len(two) == 4 and [r["loss"] for r in metrics(qlora["resumed"])] == two


def test_exported_adapter_on_the_dequantized_base_and_merged_model_give_the_trained_logits(
    qlora: dict, probed: dict, tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = probed["out"]  # the step-4 checkpoint, and the sharded model's logits on a fixed input
    expected = torch.load(out / "model_output.pt")
    export_merged_and_adapter(qlora["project"], out / "checkpoints" / "step-4", tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    # The base the adapters were trained on: the pretrained weights, the adapted ones through NF4 and back.
    spec = importlib.util.spec_from_file_location("project_nf4", qlora["project"] / "nf4.py")
    nf4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nf4)
    base = AutoModelForCausalLM.from_pretrained(qlora["model"], dtype=torch.float32)
    with torch.no_grad():
        for name, module in base.named_modules():
            if name.rsplit(".", 1)[-1] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}:
                module.weight.copy_(nf4.dequantized(module.weight))
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        for model in (merged, adapted):
            logits = model.eval()(expected["tokens"]).logits
            assert (logits - expected["logits"]).abs().max().item() <= 1e-5


def test_linears_that_nf4_cannot_hold_on_these_ranks_stop_before_anything_is_built(qlora: dict) -> None:
    # lm_head (320 x 256) holds 5 groups of 64 x 256 values: 2.5 on each of 2 ranks. (`python preflight.py`, run in
    # the qlora fixture's launch.)
    code, _, stderr = qlora["lm_head"]
    assert code == 2 and not (qlora["root"] / "lm-head").exists()
    assert stderr.splitlines()[-1] == (
        "preflight.py: error: qlora: lm_head.weight (320 x 256) cannot be stored in NF4 on 2 shards: each shard "
        "must hold whole rows and a multiple of 16384 values (64-value blocks, their scales in groups of 256); use "
        "--parallel.dp_shard 1 --parallel.dp_replicate 2 (HSDP), or leave lm_head out of lora.target_modules"
    )


def test_qlora_with_tensor_or_pipeline_parallelism_is_refused_by_its_own_line() -> None:
    # The hf family has tp and pp: --qlora with either is still refused, by its own line.
    from fsdp2gen.questions import validate

    hf = {"family": "hf", "hf_model": "org/model", "pretrained": True, "qlora": True, "lora": True, "gpus": 8}
    assert validate({**hf, "tp": 2})["qlora"].startswith("--qlora with tensor parallelism is not built yet")
    assert validate({**hf, "pp": 2})["qlora"].startswith("--qlora with pipeline parallelism is not built yet")
