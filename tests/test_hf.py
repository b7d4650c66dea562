"""Family hf: tiny Llama-, Qwen2- and GPT-2-style models (untied and tied embeddings), made here by transformers
and saved with save_pretrained, loaded sharded on 2 gloo ranks by a generated project, trained and exported.

No network: every model is a local folder written by the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import generate, metrics, torchrun_env
from tests.helpers.scripts import captured_in_this_process, run_in_this_process

# hidden 64, 2 layers: each model is a few hundred KB.
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
TEXT = "the cat sat on the mat\nthe dog sat on the log\n" * 40
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "2",
         "--training.lr", "1e-2", "--job.device", "cpu", "--job.log_every", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> model folder. Dropout off: runs on different numbers of ranks must be comparable exactly."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    root = tmp_path_factory.mktemp("hf-models")
    gqa = {"intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 64}
    configs = {
        "llama-untied": LlamaConfig(**SIZES, **gqa, tie_word_embeddings=False),
        "qwen2-tied": Qwen2Config(**{**SIZES, "vocab_size": 320}, **gqa, tie_word_embeddings=True),
        "gpt2-tied": GPT2Config(
            **SIZES, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
        ),  # fmt: skip
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[name])
    # A byte-level BPE tokenizer (about 280 tokens) saved with the Qwen2 model, as a hub model has one.
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=280, min_frequency=1, special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(folders["qwen2-tied"])
    return folders


@pytest.fixture(scope="module")
def project(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("hf") / "run", "--family", "hf", "--hf-model", str(models["qwen2-tied"]),
                    "--gpus", "2", "--fp32")  # fmt: skip


def edited_model(model: Path, folder: Path, edit: Callable[[dict], object]) -> Path:
    """A copy of `model` in `folder` whose model.safetensors `edit` changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def halve_the_norm(weights: dict) -> None:
    weights["model.norm.weight"] = weights["model.norm.weight"][:32].clone()


@pytest.fixture(scope="module")
def one_process(project: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The project's one-process runs, in this process (captured_in_this_process: an hf train.py's imports cost
    ~6 CPU-s a process; the models fixture made them here), one after the other; name -> (exit code, stdout,
    stderr), "root" -> their folder (root / name: a run's output folder):
    - "prepare": scripts/prepare_data.py of TEXT into root / "tokens" (the qwen2-tied run's data);
    - "llama-untied", "gpt2-tied": 5 steps of each model, and "NAME-export": scripts/export.py of its step 5;
    - "seed-0", "seed-0-again", "seed-1": 2 steps of a Llama with dropout, seeded 0, 0, 1 ("llama-dropout": its
      folder, "tokens.bin" its data);
    - "shape": a run of a Qwen2 whose model.norm.weight has half its shape ("shape-model"), which stops;
    - "shard-class": a run whose parallel.shard_modules names no class of the model, which stops."""
    root = tmp_path_factory.mktemp("one-process")
    (root / "text.txt").write_text(TEXT)
    runs = {"prepare": ["scripts/prepare_data.py", str(root / "text.txt"), "--output", str(root / "tokens"),
                        "--val-fraction", "0"]}  # fmt: skip
    for name in ("llama-untied", "gpt2-tied"):
        runs[name] = ["train.py", *TRAIN, "--model.path", str(models[name]), "--training.steps", "5",
                      "--job.output_dir", str(root / name)]  # fmt: skip
        runs[f"{name}-export"] = ["scripts/export.py", str(root / name / "checkpoints" / "step-5"), "--output",
                                  str(root / name / "exported")]  # fmt: skip
    # Dropout on, and every sample the same (test_training_seed_seeds_every_run_of_a_pretrained_model).
    dropout = root / "llama-dropout"
    shutil.copytree(models["llama-untied"], dropout)
    config = json.loads((dropout / "config.json").read_text())
    (dropout / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    np.tile(np.arange(16, dtype=np.uint16), 5).tofile(root / "tokens.bin")  # 4 windows of 16 + 1 tokens
    for run, seed in {"seed-0": 0, "seed-0-again": 0, "seed-1": 1}.items():
        runs[run] = ["train.py", *TRAIN, "--training.steps", "2", "--training.seed", str(seed), "--model.path",
                     str(dropout), "--data.path", str(root / "tokens.bin"), "--eval.every", "0",
                     "--data.document_mask", "false", "--job.output_dir", str(root / run)]  # fmt: skip
    # The runs that stop, last.
    shape = edited_model(models["qwen2-tied"], root / "shape-model", halve_the_norm)
    runs["shape"] = ["train.py", *TRAIN, "--model.path", str(shape), "--job.output_dir", str(root / "shape")]
    runs["shard-class"] = ["train.py", *TRAIN, "--parallel.shard_modules", "Qwen2Layer", "--job.output_dir",
                           str(root / "shard-class")]  # fmt: skip
    return {"root": root, **{name: captured_in_this_process(project, *argv) for name, argv in runs.items()}}


@pytest.fixture(scope="module")
def two_ranks(
    project: Path, models: dict[str, Path], bf16_sharded_model: Path, one_process: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict:  # fmt: skip
    """ONE 2-rank launch of tests/helpers/hf_load_probe.py (an hf project's imports cost ~6 CPU-s a process): first
    the project's check_pretrained.py checks of every model (--pretrained), then the two loads of the bf16 sharded
    model (--both); then (--then-train, train.train() per run) "qwen2-tied", 5 steps of the Qwen2 on one_process's
    prepared tokens, also saved as a Hugging Face folder at step 5 (checkpoint.save_format "hf"), and last a run of a
    copy of the Qwen2 without model.norm.weight ("missing-model"), which stops the launch (test_weights_missing_...).
    name -> output folder, "result" -> the launch."""
    root = tmp_path_factory.mktemp("two-ranks")
    assert one_process["prepare"][0] == 0, one_process["prepare"][2][-3000:]
    missing = edited_model(models["qwen2-tied"], root / "missing-model", lambda w: w.pop("model.norm.weight"))
    runs = [[*TRAIN, "--model.path", str(models["qwen2-tied"]), "--training.steps", "5", "--data.path",
             str(one_process["root"] / "tokens"), "--eval.every", "0", "--checkpoint.save_format", "hf",
             "--job.output_dir", str(root / "qwen2-tied")],
            [*TRAIN, "--model.path", str(missing), "--job.output_dir", str(root / "missing")]]  # fmt: skip
    (root / "runs.json").write_text(json.dumps(runs))
    probe = Path(__file__).parent / "helpers" / "hf_load_probe.py"
    pretrained = ",".join(map(str, models.values()))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(probe),
         str(bf16_sharded_model), "--both", "--pretrained", pretrained, "--job.device", "cpu", "--then-train",
         str(root / "runs.json")],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(result.stdout)
    return {"qwen2-tied": root / "qwen2-tied", "missing-model": missing, "result": result}


@pytest.fixture(scope="module")
def loads(two_ranks: dict) -> str:
    """The stdout of the two_ranks launch, whose probe checks come first."""
    return two_ranks["result"].stdout


def test_sharded_pretrained_models_equal_from_pretrained(loads: str, models: dict[str, Path]) -> None:
    # Every model: logits vs the plain from_pretrained model, every weight and buffer bit for bit, then GPT-2 from
    # scratch (its scaled residual projections are the init transformers skips under FSDP2 unless train.py's init
    # says otherwise). (The project's own test_pretrained_weights_load_sharded_and_equal_from_pretrained makes the
    # same checks of a ~100 MB model of its configured architecture, and its memory: run below.)
    assert "MISMATCH" not in loads
    found = re.findall(r"rank (\d): (\S+): logits max \|diff\| (\S+);", loads)
    assert sorted((rank, Path(folder).name) for rank, folder, _ in found) == sorted(
        (rank, name) for rank in "01" for name in models
    )
    assert max(float(diff) for _, _, diff in found) <= 1e-5
    assert "from scratch: " in loads


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-tied", "gpt2-tied"])
def test_five_steps_then_export_loads_with_from_pretrained(
    project: Path, models: dict[str, Path], name: str, one_process: dict, two_ranks: dict
) -> None:
    # qwen2-tied trains on 2 ranks, then its checkpoint and its export continue a prompt alike (generate.py). The
    # untied and GPT-2 exports do not depend on the ranks: one process trains and exports (the one_process
    # fixture's runs, one Python process: an hf train.py's imports cost ~6 CPU-s a process).
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path = one_process["root"] / name if name != "qwen2-tied" else two_ranks["qwen2-tied"]
    checkpoint, exported = tmp_path / "checkpoints" / "step-5", tmp_path / "exported"
    export = ["scripts/export.py", str(checkpoint), "--output", str(exported)]
    if name == "qwen2-tied":
        # Real text through the model's own tokenizer (data.tokenizer ""): scripts/prepare_data.py (one_process's
        # "prepare") writes the shards. The text is too short for a validation split (tests/test_real_data.py has
        # one).
        assert one_process["prepare"][0] == 0, one_process["prepare"][2][-3000:]
        tokens = one_process["root"] / "tokens"
        tokenizer = AutoTokenizer.from_pretrained(models[name])
        expected = [*tokenizer(TEXT, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        assert np.fromfile(tokens / "train-00000.bin", dtype=np.uint16).tolist() == expected
        assert tokenizer.decode(expected[:-1]) == TEXT
        # Trained on 2 ranks by the two_ranks fixture's launch, which also saved it as a Hugging Face folder at step 5
        # (checkpoint.save_format "hf"), checked against the export below.
        # generate.py finds the tokenizer through the run's model.path, or in the exported folder; the checkpoint
        # and its export are the same weights, so they continue the prompt alike.
        prompt = ["--prompt", "the cat", "--max-new-tokens", "8"]
        # export.py and generate.py involve nothing distributed: run in this process (captured_in_this_process).
        exported_run, from_checkpoint, from_export, sampled = (captured_in_this_process(project, *argv) for argv in (
            export,
            ["scripts/generate.py", str(checkpoint), *prompt],
            ["scripts/generate.py", "--exported", str(exported), *prompt],
            ["scripts/generate.py", "--exported", str(exported), *prompt, "--temperature", "1", "--top-k", "10"],
        ))  # fmt: skip
        assert exported_run[0] == 0, exported_run
        # stderr has transformers' progress bars.
        assert from_checkpoint[0] == 0 and from_checkpoint[1].strip(), from_checkpoint
        assert from_export[:2] == from_checkpoint[:2]
        assert sampled[0] == 0, sampled
    else:
        trained, exported_run = one_process[name], one_process[f"{name}-export"]
        assert trained[0] == 0, trained[2][-3000:]
        assert exported_run[0] == 0, exported_run[2][-3000:]
    losses = [record["loss"] for record in metrics(tmp_path)]
    assert len(losses) == 5 and losses[-1] < losses[0], losses

    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info  # no missing or unexpected weights
    tied = name.endswith("-tied")
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    # The exported weights are the trained ones (not the pretrained ones), bit for bit.
    dcp_to_torch_save(checkpoint, tmp_path / "step-5.pt")
    trained = torch.load(tmp_path / "step-5.pt", weights_only=True)["train"]["model"]
    pretrained = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert any(not torch.equal(value, pretrained[key]) for key, value in model.state_dict().items())
    if name == "qwen2-tied":
        assert (exported / "tokenizer.json").is_file()
        # The folder saved at step 5 (each rank its slices, consolidated): the export's tied weights bit for bit (so
        # its logits), with config.json, generation_config.json and the tokenizer; the checkpoint has none of it.
        saved, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-5", dtype=torch.float32,
                                                           output_loading_info=True)  # fmt: skip
        assert {key: value for key, value in info.items() if value} == {}, info
        assert saved.get_output_embeddings().weight is saved.get_input_embeddings().weight
        assert all(torch.equal(value, saved.state_dict()[key]) for key, value in model.state_dict().items())
        tokens = torch.randint(280, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(saved.eval()(tokens).logits, model.eval()(tokens).logits)
        assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(saved.name_or_path))
        tokenizer = AutoTokenizer.from_pretrained(saved.name_or_path)
        assert tokenizer(TEXT)["input_ids"] == AutoTokenizer.from_pretrained(models[name])(TEXT)["input_ids"]
        assert not any(path.suffix == ".safetensors" for path in checkpoint.iterdir())
    if name == "llama-untied":
        # This model's folder has no tokenizer. A run that named one (data.tokenizer) exports it with the model:
        # the same checkpoint, as a run with --data.tokenizer would have written its checkpoint.json.
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        assert not any(path.name.startswith("tokenizer") for path in exported.iterdir())
        info["config"]["data"]["tokenizer"] = str(models["qwen2-tied"])
        (checkpoint / "checkpoint.json").write_text(json.dumps(info))
        again = tmp_path / "exported-with-tokenizer"
        # export.py involves nothing distributed: in this process (run_in_this_process), not a process of its own.
        run_in_this_process(project, "scripts/export.py", str(checkpoint), "--output", str(again))
        tokenizer, expected = AutoTokenizer.from_pretrained(again), AutoTokenizer.from_pretrained(models["qwen2-tied"])
        assert tokenizer(TEXT)["input_ids"] == expected(TEXT)["input_ids"]
        assert tokenizer.eos_token == expected.eos_token == "<|endoftext|>"


def test_generated_hf_projects_own_tests_pass(project: Path) -> None:
    # Its tests make a tiny model (and a ~100 MB one to measure memory) of the configured architecture. The
    # checkpoint code is the llama projects' (tested there); here: the sharded load, the from-scratch init (the
    # same on 1 and 2 ranks and HSDP), the export. Not run here, because they are the same test code on the same
    # family-independent code, run by test_training_runs.py in the llama projects: test_unknown_config_key_is_rejected
    # (config.py's parser) and test_loss_decreases_on_a_repeated_batch (metrics.py's fields; the hf loss falling on 2
    # ranks: test_five_steps_then_export_loads_with_from_pretrained[qwen2-tied] above, and its numbers against the
    # record: test_loss_history.py's hf-fp32).
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_training.py",
         "tests/test_checkpoint.py", "-k", "pretrained or from_scratch or export"],
        cwd=project, env=torchrun_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert re.search(r"^3 passed, 10 deselected in ", result.stdout, flags=re.M), result.stdout[-2000:]
    growth = re.findall(
        r"rank (\d): \S+: logits [^;]*; build_model_meta peak \+(\S+) MiB, full model (\S+) MiB", result.stdout
    )
    print(growth)  # (rank, MiB the rank grew while loading, MiB of the full model)
    # Each rank (rank 0 too) reads its own slices: its shards plus the file pages it maps, under 1.5x the model.
    assert len(growth) == 2 and all(float(grew) < 1.5 * float(full) for _, grew, full in growth), growth


def test_wrong_shard_class_stops_with_a_clear_message(one_process: dict) -> None:
    # one_process's "shard-class" run (one process: which classes the model has does not depend on the ranks).
    code, _, stderr = one_process["shard-class"]
    assert code == 2
    message = stderr.strip().splitlines()[-1]
    assert message.startswith("train.py: error: parallel.shard_modules: no module of class Qwen2Layer in the model; ")
    assert "Qwen2DecoderLayer" in message


def test_weights_missing_from_the_files_stop_every_rank_with_one_line(two_ranks: dict) -> None:
    # Found while loading (after the model is built on meta), not by preflight: the ranks stop together, rank 0
    # prints the one line, and every rank exits 2 after leaving the process group (no SIGABRT at exit). (The two_ranks
    # launch's last run, which stops it; the qwen2-tied run before it says no error.)
    folder, result = two_ranks["missing-model"], two_ranks["result"]
    assert result.returncode != 0
    assert re.findall(r"^train\.py: error: .*$", result.stderr, flags=re.M) == [
        f"train.py: error: {folder} lacks 1 weight(s) of Qwen2ForCausalLM, e.g. ['model.norm.weight']; its keys must "
        "be the model's state_dict() keys, or those transformers converts into them (e.g. per-expert MoE weights); "
        "its config.json must be the one the weights were saved with"
    ]
    # torchrun's summary names the first rank to end (its root cause); it may stop the others once that one ends.
    assert re.search(r"Root Cause .*\n.*\n.*\n.*\n.*\n\s*exitcode\s*: 2 ", result.stderr), result.stderr[-2000:]
    assert "terminate called" not in result.stderr and "SIGABRT" not in result.stderr


def test_training_seed_seeds_every_run_of_a_pretrained_model(one_process: dict) -> None:
    # Dropout on, and every sample the same (so that the seed's data order changes nothing): the losses depend
    # only on the dropout masks, which training.seed must decide, also when the weights are loaded, not drawn.
    # The three runs one after the other in one Python process (one_process's, after other runs; each starts from the
    # test process's RNG state, whatever it is): the seed, not a fresh process, must make a run's dropout masks.
    runs = ("seed-0", "seed-0-again", "seed-1")
    assert [one_process[run][0] for run in runs] == [0, 0, 0], one_process["seed-1"][2][-3000:]
    first, again, other = ([record["loss"] for record in metrics(one_process["root"] / run)] for run in runs)
    assert len(first) == 2 and again == first
    assert other[0] != first[0]


@pytest.fixture(scope="module")
def bf16_sharded_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama saved in bf16 across several safetensors files (an index), as hub models are."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES, intermediate_size=128, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    folder = tmp_path_factory.mktemp("hf-bf16") / "llama-bf16"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


def test_bf16_sharded_files_load_bit_identical_to_from_pretrained_by_either_path(loads: str) -> None:
    # Two loads (--both, in the loads launch). Every rank sees the folder: DCP's HuggingFaceStorageReader, no
    # warning. A rank that does not (rank 1 given a folder that does not exist): rank 0 reads and broadcasts, and
    # says so once. bf16 files converted to the fp32 shards exactly as from_pretrained(dtype=float32) converts them.
    lines = [line for line in loads.splitlines() if line.endswith(": equal") or line.startswith("warning: ")]
    assert [re.sub(r" do not see the files of .*", "", line) for line in lines] == [
        "every-rank: equal", "warning: rank(s) [1]", "blind: equal"
    ], loads  # fmt: skip


def test_a_weight_of_another_shape_stops_with_one_line(one_process: dict) -> None:
    # Checked against the files' headers before any rank reads a slice: one line, exit 2. One process (one_process's
    # "shape" run): the error takes the path of test_weights_missing_from_the_files_stop_every_rank_with_one_line's
    # (model.py's first_error: gathered from every rank, rank 0 prints it), whose 2 ranks show that every rank stops.
    code, _, stderr = one_process["shape"]
    folder = one_process["root"] / "shape-model"
    assert code == 2, stderr[-3000:]
    assert re.findall(r"^train\.py: error: .*$", stderr, flags=re.M) == [
        f"train.py: error: {folder} has model.norm.weight of shape [32] but the model's is [64]; its config.json "
        "must be the one the weights were saved with"
    ], stderr[-3000:]


def test_op_level_activation_checkpointing_keeps_the_numbers_of_a_model_with_qkv_bias(
    models: dict[str, Path], tmp_path: Path
) -> None:
    # Qwen2's q/k/v projections have a bias (aten.addmm, not aten.mm): selective keeps every other one's output
    # like llama's; whatever it keeps, the losses and gradient norms are those of no checkpointing.
    # Which outputs the policy keeps does not depend on the number of ranks (tests/test_op_level_ac.py runs every
    # mode on 2 ranks): both runs one process's, in this process (captured_in_this_process: the models fixture
    # imported torch and transformers here).
    project = generate(tmp_path / "sac", "--family", "hf", "--hf-model", str(models["qwen2-tied"]), "--gpus", "2",
                       "--fp32", "--activation-checkpointing", "selective")  # fmt: skip
    modes = ("none", "selective")
    results = [captured_in_this_process(
        project, "train.py", *TRAIN, "--parallel.activation_checkpointing", mode, "--training.steps", "3",
        "--job.output_dir", str(tmp_path / mode)) for mode in modes]  # fmt: skip
    assert [code for code, _, _ in results] == [0, 0], results[-1][2][-3000:]
    runs = {mode: [(row["loss"], row["grad_norm"]) for row in metrics(tmp_path / mode)] for mode in modes}
    assert len(runs["none"]) == 3 and runs["selective"] == runs["none"], runs
