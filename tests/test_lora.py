"""LoRA (`--lora`, family hf): peft adapters added to the model built on the meta device, sharded with
fully_shard, trained on 4 gloo ranks (FSDP over 4; and a `--lora --tp 2` project at tp 2 x dp 2, in the same launch);
a tiny Llama made here with transformers, no network; and the `--lora --tp 2` project on the same Llama with its
lm_head tied to its embeddings.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, save_tiny_llama, torchrun
from tests.helpers.scripts import run_scripts
from tests.helpers.several_runs import launch_several

TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "0",
         "--training.lr", "1e-2", "--job.device", "cpu", "--job.log_every", "1", "--eval.every", "0",
         "--lora.rank", "4", "--lora.alpha", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny pretrained Llama (with a tokenizer), a `--lora` project, and a 4-step run on 4 ranks saved at steps 2
    and 4; and (in the same launch: tests/helpers/several_runs.py) its resume from step 2, in `resumed`, from a copy
    of the run's folder without the step-4 checkpoint and with the metrics of steps 1-2. Then a `--lora --tp 2`
    project's same run at tp 2 x dp 2, in `tp` (each adapted layer's base_layer split as the model's plan says, its
    lora_B or lora_A to match: tensor_parallel.lora_styles), and its resume from step 2 at tp 1 (dp 4), in
    `tp_at_1`; and the tp project's run at tp 2 x dp 2 of the same Llama with its lm_head tied to its embeddings
    (tie_word_embeddings, as small Qwen3 models have it), in `tp_tied`."""
    root = tmp_path_factory.mktemp("lora")
    save_tiny_llama(root / "model", "the cat sat on the mat " * 50)
    save_tiny_llama(root / "tied", "the cat sat on the mat " * 50, tie_word_embeddings=True)
    project = generate(root / "run", "--family", "hf", "--hf-model", str(root / "model"), "--lora", "--gpus", "2",
                       "--fp32")  # fmt: skip
    tp_project = generate(root / "run-tp", "--family", "hf", "--hf-model", str(root / "model"), "--lora", "--gpus",
                          "4", "--tp", "2", "--fp32")  # fmt: skip
    out, resumed, tp, tp_at_1, tp_tied = root / "out", root / "resumed", root / "tp", root / "tp-at-1", root / "tp-tied"
    run = [*TRAIN, "--training.steps", "4", "--checkpoint.interval", "2"]

    def interrupted(folder: Path) -> dict:
        return {"from": str(folder), "remove": ["checkpoints/step-4"], "metrics_lines": 2}

    result = launch_several(project, [
        [*run, "--job.output_dir", str(out)],
        {"args": [*run, "--job.output_dir", str(resumed)], "interrupted": interrupted(out)},
        {"args": [*run, "--job.output_dir", str(tp)], "project": str(tp_project)},
        {"args": [*run, "--job.output_dir", str(tp_at_1), "--parallel.tp", "1"], "project": str(tp_project),
         "interrupted": interrupted(tp)},
        {"args": [*run, "--model.path", str(root / "tied"), "--job.output_dir", str(tp_tied)],
         "project": str(tp_project)},
    ], root / "runs.json", nproc=4)  # fmt: skip
    # rank 4: (64 + 64) x 4 per attention projection (k, v: 64 + 32), (64 + 128) x 4 per MLP one, x 2 blocks. The
    # tied model has one (vocab, dim) matrix less.
    assert result.stdout.count("model: 123,200 parameters, 8,192 of them trainable (the others frozen)") == 4
    assert result.stdout.count("model: 102,720 parameters, 8,192 of them trainable (the others frozen)") == 1
    assert "resume: this run changes parallel.tp 2 -> 1" in result.stdout
    return {"root": root, "project": project, "model": root / "model", "out": out, "resumed": resumed, "tp": tp,
            "tp_at_1": tp_at_1, "tied": root / "tied", "tp_tied": tp_tied}  # fmt: skip


@pytest.fixture(scope="module")
def probed(lora: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/helpers/lora_probe.py on the run's step-4 checkpoint, 2 ranks: the folder of its probe.json and
    model_output.pt (the sharded model's logits on a fixed input)."""
    folder = tmp_path_factory.mktemp("lora-probe")
    torchrun(lora["project"], str(HELPERS / "lora_probe.py"), *TRAIN, "--job.output_dir", str(lora["out"]),
             env={"PROBE_OUT": str(folder / "probe.json")})  # fmt: skip
    return folder


def test_only_the_adapters_train_and_have_optimizer_state(lora: dict, probed: Path) -> None:
    report = json.loads((probed / "probe.json").read_text())
    # Every pretrained weight is still the file's, bit for bit.
    assert report["frozen_equal"] == report["frozen_names"] and len(report["frozen_names"]) == 21
    # 7 target layers x 2 blocks x (A, B); B starts at zero, so a nonzero B has been trained.
    norms = report["adapter_norms"]
    assert len(norms) == 28 and all(norms[name] > 0 for name in norms if "lora_B" in name), norms
    # AdamW's two moments per adapter value, on each rank for its shards; nothing for the frozen weights.
    for sizes in report["sizes"]:
        assert sizes["optimizer_state"] == 2 * sizes["adapters"], report["sizes"]
        assert sizes["adapters"] * 3 < sizes["frozen"]
    assert sum(s["adapters"] for s in report["sizes"]) == 8_192
    # The checkpoint holds the adapters and their optimizer state only.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(lora["out"] / "checkpoints" / "step-4").read_metadata().state_dict_metadata
    model_keys = [key for key in keys if key.startswith("train.model.")]
    assert len(model_keys) == 28 and all(".lora_" in key for key in model_keys)
    assert all(".lora_" in key for key in keys if key.startswith("train.optimizer.state."))


@pytest.fixture(scope="module")
def one_process(lora: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The project's one-process runs, in ONE Python process (run_scripts; an hf project's imports cost ~6 CPU-s a
    process): "one", the 4-step run without torchrun; "merged" and "adapter", scripts/export.py of the 4-rank run's
    step-4 checkpoint, the merged model and the PEFT adapter; "one-adapter", "tp-adapter" and "tp-merged", the
    exports of "one"'s and of the tp 2 x dp 2 run's step-4 checkpoints; "no-match", train.py with
    lora.target_modules that match nothing; then "readme": the export and generate lines of the generated README's
    Run section, as printed (after their `python`), in "project", a copy of the project with the 4-rank run in its
    outputs/ (what they name).
    name -> (exit code, stdout, stderr) ("readme": "lines" -> the lines, "results" -> theirs); "root" -> the folder
    of their outputs (each in root/NAME)."""
    from tests.test_newcomer_path import bash_blocks

    root = tmp_path_factory.mktemp("lora-one-process")
    project = root / "project"
    shutil.copytree(lora["project"], project)
    shutil.copytree(lora["out"], project / "outputs")
    step_4 = str(lora["out"] / "checkpoints" / "step-4")
    runs = {
        "one": ["train.py", *TRAIN, "--training.steps", "4", "--job.output_dir", str(root / "one")],
        "merged": ["scripts/export.py", step_4, "--output", str(root / "merged")],
        "adapter": ["scripts/export.py", step_4, "--output", str(root / "adapter"), "--adapter"],
        "one-adapter": ["scripts/export.py", str(root / "one" / "checkpoints" / "step-4"), "--output",
                        str(root / "one-adapter"), "--adapter"],
        "tp-adapter": ["scripts/export.py", str(lora["tp"] / "checkpoints" / "step-4"), "--output",
                       str(root / "tp-adapter"), "--adapter"],
        "tp-merged": ["scripts/export.py", str(lora["tp"] / "checkpoints" / "step-4"), "--output",
                      str(root / "tp-merged")],
        "no-match": ["train.py", *TRAIN, "--lora.target_modules", "attn_proj", "--job.output_dir",
                     str(root / "no-match")],
        "one-tied": ["train.py", *TRAIN, "--training.steps", "4", "--model.path", str(lora["tied"]),
                     "--job.output_dir", str(root / "one-tied")],
        "one-tied-adapter": ["scripts/export.py", str(root / "one-tied" / "checkpoints" / "step-4"), "--output",
                             str(root / "one-tied-adapter"), "--adapter"],
        "tp-tied-adapter": ["scripts/export.py", str(lora["tp_tied"] / "checkpoints" / "step-4"), "--output",
                            str(root / "tp-tied-adapter"), "--adapter"],
    }  # fmt: skip
    run_block = bash_blocks((project / "README.md").read_text().split("\n## Run\n", 1)[1])[0]
    lines = [line for line in run_block if "scripts/generate.py" in line or "scripts/export.py" in line]
    results = run_scripts(project, *runs.values(), *(shlex.split(line)[1:] for line in lines))
    return {"root": root, **dict(zip(runs, results, strict=False)),
            "readme": {"lines": lines, "results": results[len(runs):]}}  # fmt: skip


def test_four_ranks_equal_one_process_and_resume_is_exact(lora: dict, one_process: dict) -> None:
    four = [r["loss"] for r in metrics(lora["out"])]
    # One process: train.py without torchrun, in one_process's Python process.
    code, _, stderr = one_process["one"]
    assert code == 0, stderr[-3000:]
    one = [r["loss"] for r in metrics(one_process["root"] / "one")]
    assert len(four) == 4 and all(abs(a - b) <= 1e-5 for a, b in zip(one, four, strict=True)), (one, four)
    # Resume from step 2 (adapters and optimizer from the checkpoint, base weights from the pretrained files): the
    # lora fixture's second run.
    assert [r["loss"] for r in metrics(lora["resumed"])] == four


def test_tensor_parallel_lora_equals_one_process_and_exports_the_same_adapter(lora: dict, one_process: dict) -> None:
    """tp 2 x dp 2 (the adapted layers' base_layer split by the model's plan, lora_B split with q/k/v/gate/up, lora_A
    with o/down) equals one process step by step, and so does its resume at tp 1; its checkpoint exports the adapter
    one process's exports, and the merged model of the FSDP run's checkpoint."""
    import torch
    from safetensors.torch import load_file

    one = [(r["loss"], r["grad_norm"]) for r in metrics(one_process["root"] / "one")]
    for run in ("tp", "tp_at_1"):
        steps = [(r["loss"], r["grad_norm"]) for r in metrics(lora[run])]
        assert len(steps) == 4, (run, steps)
        for (loss, norm), (one_loss, one_norm) in zip(steps, one, strict=True):
            assert abs(loss - one_loss) <= 1e-5 and abs(norm - one_norm) <= 2e-5, (run, steps, one)
    for name in ("one-adapter", "tp-adapter", "tp-merged", "merged"):
        assert one_process[name][0] == 0, one_process[name][2][-3000:]
    # The final adapters, as PEFT's format holds them (every adapter whole, whatever the layout it trained in).
    root = one_process["root"]
    tp, reference = (load_file(root / kind / "adapter_model.safetensors") for kind in ("tp-adapter", "one-adapter"))
    assert len(reference) == 28 and tp.keys() == reference.keys()
    assert all(torch.any(reference[key] != 0) for key in reference if "lora_B" in key)  # trained
    for key, value in reference.items():
        assert (tp[key] - value).abs().max().item() <= 2e-5, key
    tp, fsdp = (load_file(root / kind / "model.safetensors") for kind in ("tp-merged", "merged"))
    assert tp.keys() == fsdp.keys()
    assert all((tp[key] - fsdp[key]).abs().max().item() <= 2e-5 for key in fsdp)


def test_tensor_parallel_lora_on_a_tied_lm_head_equals_one_process(lora: dict, one_process: dict) -> None:
    """A Llama whose lm_head shares its embedding's matrix (tie_word_embeddings): tp 2 x dp 2 (both split by
    vocabulary rows, one parameter; tensor_parallel.apply_tensor_parallel) equals one process step by step; the
    checkpoints hold the 28 adapters and not the frozen tied matrix under lm_head's name (which get_state_dict's
    ignore_frozen_params leaves: checkpoint.without_tied_frozen), and export the same adapter."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    one = [(r["loss"], r["grad_norm"]) for r in metrics(one_process["root"] / "one-tied")]
    steps = [(r["loss"], r["grad_norm"]) for r in metrics(lora["tp_tied"])]
    assert len(steps) == 4 and len(one) == 4, (steps, one)
    for (loss, norm), (one_loss, one_norm) in zip(steps, one, strict=True):
        assert abs(loss - one_loss) <= 1e-5 and abs(norm - one_norm) <= 1e-5, (steps, one)
    keys = FileSystemReader(lora["tp_tied"] / "checkpoints" / "step-4").read_metadata().state_dict_metadata
    model_keys = [key for key in keys if key.startswith("train.model.")]
    assert len(model_keys) == 28 and all(".lora_" in key for key in model_keys), model_keys
    for name in ("one-tied-adapter", "tp-tied-adapter"):
        assert one_process[name][0] == 0, one_process[name][2][-3000:]
    root = one_process["root"]
    tp, reference = (load_file(root / f"{kind}-tied-adapter" / "adapter_model.safetensors") for kind in ("tp", "one"))
    assert len(reference) == 28 and tp.keys() == reference.keys()
    assert all(torch.any(reference[key] != 0) for key in reference if "lora_B" in key)  # trained
    # Adam divides each gradient element by its magnitude: an element whose terms nearly cancel keeps the layouts'
    # roundoff at up to lr x 1e-3 (measured 9.2e-6 on one element of a gate_proj's lora_A at lr 1e-2; the others
    # under 6e-7), as in the test above.
    for key, value in reference.items():
        assert (tp[key] - value).abs().max().item() <= 2e-5, key


def export_merged_and_adapter(project: Path, checkpoint: Path, dest: Path) -> None:
    """scripts/export.py of `checkpoint` twice, in one Python process (run_scripts): the merged model into
    dest/merged, the PEFT adapter into dest/adapter. (test_qlora.py; test_lora.py makes the same two runs in its
    one_process fixture.)"""
    runs = [["scripts/export.py", str(checkpoint), "--output", str(dest / kind), *args]
            for kind, args in {"merged": [], "adapter": ["--adapter"]}.items()]  # fmt: skip
    for code, _, stderr in run_scripts(project, *runs):
        assert code == 0, stderr[-3000:]


def test_exported_adapter_and_merged_model_reproduce_the_trained_logits(
    lora: dict, probed: Path, one_process: dict
) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    expected = torch.load(probed / "model_output.pt")  # the sharded model's, from the step-4 checkpoint
    # The exports of that checkpoint, the merged model and the PEFT adapter (made in one_process's process).
    for kind in ("merged", "adapter"):
        assert one_process[kind][0] == 0, one_process[kind][2][-3000:]
    exported = one_process["root"]
    merged = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(lora["model"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, exported / "adapter")
    assert (exported / "adapter" / "adapter_config.json").is_file()
    with torch.no_grad():
        for model in (merged, adapted):
            logits = model.eval()(expected["tokens"]).logits
            assert (logits - expected["logits"]).abs().max().item() <= 1e-5


def test_lora_target_modules_that_match_nothing_stop_with_one_line(one_process: dict) -> None:
    # As `python train.py ... --lora.target_modules attn_proj` (in one_process's Python process).
    code, _, stderr = one_process["no-match"]
    assert code == 2
    assert stderr.splitlines()[-1] == (
        "train.py: error: lora.target_modules ['attn_proj'] match no layer of the model; its linear layers are "
        "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lora"], "LoRA adapts a pretrained Hugging Face model; use --family hf --hf-model MODEL"),
        (["--family", "hf", "--hf-model", "org/model", "--lora", "--from-scratch"], "LoRA adapts pretrained weights"),
        (["--family", "hf", "--hf-model", "org/model", "--lora", "--checkpoint", "full"],
         "LoRA checkpoints hold the adapters only, in the sharded styles"),
    ],
)  # fmt: skip
def test_lora_refuses_what_it_cannot_adapt(flags: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "fsdp2gen", "new", str(tmp_path / "run"), "--yes", *flags],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert message in result.stderr


def test_the_run_sections_generate_command_works_on_a_lora_run(one_process: dict) -> None:
    """The generated README's Run section samples from a LoRA run through the merged export (generate.py alone would
    refuse a checkpoint of adapters): its export and generate lines, as printed, on the run in outputs/ (run in
    one_process's Python process, after its other runs)."""
    lines, results = one_process["readme"]["lines"], one_process["readme"]["results"]
    assert [line.split()[:2] for line in lines] == [["python", "scripts/export.py"], ["python", "scripts/generate.py"]]
    for line, (code, _, stderr) in zip(lines, results, strict=True):
        assert code == 0, f"{line}: {stderr[-2000:]}"
    assert results[-1][1].strip(), "generate.py printed no continuation"
