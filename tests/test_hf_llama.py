"""The built-in llama and Hugging Face checkpoints (hf_checkpoint.py): a tiny LlamaForCausalLM made here with
save_pretrained, with Llama 3.1/3.2's rotary scaling ("llama3", as the checkpoints users start from have it),
loaded by `fsdp2gen new --family llama --hf-model` projects under every layout (1, 2 and 4 ranks, tensor and
pipeline parallel, both) equal to transformers' weights and logits; trained, then exported with
`scripts/export.py --format hf` and saved with `checkpoint.save_format = "hf"`, loaded by from_pretrained with
the trained model's logits; HF -> ours -> HF bit for bit, config.json's rotary scaling included. In-process:
checkpoints without rotary scaling and with transformers 4's `rope_scaling`, and the 1-rank resume. Two launches
in all."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, fsdp2gen, generate, metrics, project_modules, save_tiny_llama, torchrun
from tests.helpers.scripts import captured_in_this_process, run_in_this_process

PROBE = str(REPO / "tests" / "helpers" / "hf_llama_probe.py")
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 20
TRAIN = ["--job.device", "cpu", "--training.seq_len", "32", "--training.global_batch_size", "8",
         "--training.warmup_steps", "1", "--training.lr", "1e-2", "--checkpoint.interval", "2",
         "--eval.every", "0", "--job.log_every", "1"]  # fmt: skip


# Llama 3.1's rotary scaling, its wavelengths scaled down to this model's 64 positions: with head_dim 16 and theta
# 10000 (wavelengths 6.3, 19.9, 62.8, 199, ...) each of its three bands has some (6.3 < 48 / 6 is kept, 19.9 is
# interpolated, those above 48 are divided by the factor).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 6.0, "original_max_position_embeddings": 48}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer LlamaForCausalLM (hidden 64, GQA, vocabulary 320, untied, Llama 3.1's rotary scaling) and its
    tokenizer, as the hub has them."""
    return save_tiny_llama(tmp_path_factory.mktemp("hf-llama") / "tiny-llama", TEXT, rope_parameters=LLAMA3_ROPE)


@pytest.fixture(scope="module")
def project(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("hf-llama") / "run", "--family", "llama", "--hf-model", str(llama),
                    "--gpus", "2", "--fp32")  # fmt: skip


def probe_lines(output: str) -> dict[str, str]:
    """The probe's "weights: ..." and "... logits max |diff| D" lines, by their first words."""
    found = {}
    for line in output.splitlines():
        if line.startswith(("weights", "sharded logits", "plain logits")):
            key, _, value = line.partition(": ") if line.startswith("weights") else line.rpartition(" ")
            found[key] = value
    return found


def assert_equal_to_transformers(output: str, n_weights: int, sharded: bool) -> None:
    found = probe_lines(output)
    assert found.get("weights") == f"{n_weights} equal", output[-3000:]
    assert float(found["plain logits max |diff|"]) <= 1e-5
    if sharded:
        assert float(found["sharded logits max |diff|"]) <= 1e-5
    else:
        assert "sharded logits max |diff|" not in found


def test_hf_to_ours_to_hf_is_bit_exact(project: Path, llama: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    reference = hf_model.state_dict()
    hf_config = json.loads((llama / "config.json").read_text())
    with project_modules(project):
        adapter = importlib.import_module("hf_checkpoint")
        model_module = importlib.import_module("model")
        config_module = importlib.import_module("config")
        config = config_module.load_config(project / "config.toml")
        # The shape is the checkpoint's (config.json), whatever model.size says, its rotary scaling too.
        assert (config.model.dim, config.model.n_layers, config.model.vocab_size) == (64, 2, 320)
        rope = ("type", "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")
        assert [getattr(config.model, f"rope_{key}") for key in rope] == ["llama3", 8, 1, 6, 48]
        # config.json back: every key transformers' LlamaConfig wrote that the model defines, rope_parameters too.
        written = adapter.hf_config(config.model)
        assert {key: written[key] for key in written.keys() & hf_config.keys() - {"bos_token_id", "eos_token_id"}} == {
            key: hf_config[key] for key in written.keys() & hf_config.keys() - {"bos_token_id", "eos_token_id"}
        }
        assert written["rope_parameters"] == LLAMA3_ROPE
        # `fsdp2gen plan --config` plans that shape too: 2 x 64 x 320 embeddings + 2 blocks + the final norm.
        planned = fsdp2gen("plan", "--config", str(project / "config.toml"), "--gpus", "2")
        assert planned.returncode == 0, planned.stderr
        blocks = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)
        assert f"{(2 * 64 * 320 + blocks + 64) / 1e6:.2f}M parameters, 2 blocks, dim 64" in planned.stdout
        ours = adapter.from_hf(reference, tie_embeddings=False)
        model = model_module.Model(config.model)
        model.init_weights(seed=0)  # the rotary tables; then the weights
        model.load_state_dict(ours, strict=True)  # every weight of ours, no other
        # The same function: each weight lands where transformers' forward uses it (w1 and w3 have one shape).
        tokens = torch.randint(320, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert (model.eval()(tokens) - hf_model(tokens).logits).abs().max().item() <= 1e-5
        back = adapter.to_hf({name: tensor.clone() for name, tensor in model.state_dict().items()}, False)
        assert back.keys() == reference.keys()
        assert all(torch.equal(back[key], reference[key]) for key in reference)
        # Tied: lm_head.weight is left out, as transformers' own files leave it out, and comes back as the embedding.
        tied = {key: value for key, value in reference.items() if key != "lm_head.weight"}
        assert adapter.to_hf(adapter.from_hf(tied, tie_embeddings=True), True).keys() == tied.keys()

        # The same weights without rotary scaling, and with Llama 3.1's scaling as transformers 4 wrote it (and the
        # hub's Llama 3.1 files still are): rope_theta and rope_scaling. transformers' logits, all positions.
        plain, old = tmp_path / "plain", tmp_path / "transformers-4"
        legacy = {key: value for key, value in hf_config.items() if key != "rope_parameters"}
        legacy |= {"rope_theta": 10000.0, "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}
        unscaled = {**hf_config, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
        for folder, content in ((plain, unscaled), (old, legacy)):
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(content))
            (folder / "model.safetensors").symlink_to(llama / "model.safetensors")
        tokens = torch.randint(320, (2, 64), generator=torch.Generator().manual_seed(2))
        logits = {}
        for folder, kind in ((plain, "default"), (old, "llama3"), (llama, "llama3")):
            args = config_module.parse_args(["--config", str(project / "config.toml"), "--model.hf_checkpoint",
                                             str(folder)]).model  # fmt: skip
            assert args.rope_type == kind
            model = model_module.Model(args)
            model.init_weights(seed=0)
            model.load_state_dict(ours)
            theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            with torch.no_grad():
                logits[folder] = theirs(tokens).logits
                assert (model.eval()(tokens) - logits[folder]).abs().max().item() <= 1e-5, folder
            expected = {"rope_theta": 10000.0, "rope_type": "default"} if kind == "default" else LLAMA3_ROPE
            assert adapter.hf_config(args)["rope_parameters"] == expected
        # The scaling matters here: transformers' logits with and without it differ.
        assert (logits[llama] - logits[plain]).abs().max().item() > 1e-3


def test_loaded_trained_exported_and_saved_in_hf_format(project: Path, llama: Path, tmp_path: Path) -> None:
    """2 ranks: the loaded model equals transformers', trains 4 steps saving HF folders too; 1 rank: the same load,
    then the run resumes from its step-4 checkpoint on 1 rank to step 6. Then export --format hf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    common = [*TRAIN, "--job.output_dir", str(out), "--checkpoint.save_format", "hf", "--checkpoint.keep_last", "2"]
    first = torchrun(project, PROBE, "--train", *common, "--training.steps", "4")
    assert_equal_to_transformers(first.stdout, 21, sharded=True)
    losses = [record["loss"] for record in metrics(out)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["step-2", "step-4"]
    # The resume source is untouched: the DCP checkpoint holds only its own files.
    assert not any("safetensors" in p.name for p in (out / "checkpoints" / "step-4").iterdir())

    # One process: `python hf_llama_probe.py`, run in this process (torch and transformers are imported here).
    code, stdout, stderr = captured_in_this_process(project, PROBE, "--train", *common, "--training.steps", "6")
    assert code == 0, stderr[-3000:]
    assert_equal_to_transformers(stdout, 21, sharded=True)
    assert "resumed from" in stdout and "at step 4" in stdout, stdout[-2000:]
    assert len(metrics(out)) == 6
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["step-4", "step-6"]  # keep_last 2

    exported, native = tmp_path / "exported", tmp_path / "native"
    # Both exports in this process (run_in_this_process: export.py involves nothing distributed; a process of their
    # own would import torch again).
    for folder, form in ((exported, "hf"), (native, "native")):
        run_in_this_process(project, "scripts/export.py", str(out / "checkpoints" / "step-6"), "--output", str(folder),
                            "--format", form)  # fmt: skip
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in exported.iterdir()}  # fmt: skip
    # Llama 3.1's rotary scaling leaves with the model (the logits below depend on it).
    for folder in (exported, out / "hf" / "step-6"):
        assert json.loads((folder / "config.json").read_text())["rope_parameters"] == LLAMA3_ROPE
    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    saved = AutoModelForCausalLM.from_pretrained(out / "hf" / "step-6", dtype=torch.float32).state_dict()
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())
    pretrained = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).state_dict()
    assert not torch.equal(model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           pretrained["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    # The tokenizer came with the checkpoint and leaves with the export.
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert (
        tokenizer("the quick brown fox")["input_ids"]
        == AutoTokenizer.from_pretrained(llama)("the quick brown fox")["input_ids"]
    )

    # The trained model's logits: the native export in this project's own Model.
    import safetensors.torch

    with project_modules(project):
        model_module = importlib.import_module("model")
        ours = model_module.Model(model_module.ModelArgs(**json.loads((native / "config.json").read_text())))
        ours.init_weights(seed=0)
        ours.load_state_dict(safetensors.torch.load_file(native / "model.safetensors"))
    tokens = torch.randint(320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (model.eval()(tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert difference <= 1e-5


# Each layout as a config of ONE project generated with --tp 2 --pp 2 on 4 ranks (its rendered code has both), all
# checked in one 4-rank launch (hf_llama_probe.py --layouts: a launch's ranks import torch and transformers once):
# tp 2 x FSDP 2, pp 2 x FSDP 2, and tp 2 x pp 2.
LAYOUTS = {
    "4-ranks-tp2": ["--parallel.pp", "1"],
    "4-ranks-pp2": ["--parallel.tp", "1"],
    "4-ranks-tp2-pp2": [],
}


@pytest.fixture(scope="module")
def layouts(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> the probe's output for that layout of LAYOUTS."""
    root = tmp_path_factory.mktemp("layouts")
    project = generate(root / "run", "--family", "llama", "--hf-model", str(llama), "--fp32", "--gpus", "4", "--tp",
                       "2", "--pp", "2")  # fmt: skip
    (root / "layouts.json").write_text(json.dumps(LAYOUTS))
    result = torchrun(project, PROBE, "--layouts", str(root / "layouts.json"), "--job.device", "cpu", nproc=4)
    parts = re.split(r"^layout (\S+)$", result.stdout, flags=re.M)  # [before, name, its lines, name, ...]
    found = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert sorted(found) == sorted(LAYOUTS), result.stdout[-3000:]
    return found


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_loads_transformers_weights(layouts: dict[str, str], name: str) -> None:
    # Pipeline stages run only inside the schedule: their gathered weights run in a plain Model.
    assert_equal_to_transformers(layouts[name], 21, sharded="pp2" not in name)


def test_a_checkpoint_the_built_in_llama_cannot_take_stops_in_one_line(
    project: Path, llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Run time (the folder changed after `fsdp2gen new`, or --model.hf_checkpoint): train.py's config parsing
    refuses it with one line and exit code 2, before anything is built."""
    config = json.loads((llama / "config.json").read_text())
    variants = {
        "qwen2": {**config, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
        "yarn": {**config, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "yarn", "factor": 4.0}},
        "llama3-incomplete": {**config, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 32.0}},
        # As transformers 4 wrote it.
        "old-rope-scaling": {
            **{key: value for key, value in config.items() if key != "rope_parameters"},
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        "biases": {**config, "attention_bias": True},
    }
    for name, content in variants.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(content))
    (tmp_path / "empty").mkdir()
    fix = "train it with --family hf"
    scaling = 'scaling, which the built-in llama does not have (it has "llama3"); ' + fix
    cases = {
        "qwen2": f"it is a Qwen2ForCausalLM, not a LlamaForCausalLM; the built-in llama takes Llama checkpoints only: "
        f"{fix}",
        "yarn": f'its rotary embeddings use "yarn" {scaling}',
        "llama3-incomplete": 'its "llama3" rotary scaling has no low_freq_factor, high_freq_factor, '
        "original_max_position_embeddings; give them in config.json's rope_parameters (Llama 3.1's: factor 8.0, "
        "low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192)",
        "old-rope-scaling": f'its rotary embeddings use "linear" {scaling}',
        "biases": f"its attention_bias = True is not the built-in llama's; {fix}",
        "empty": f"{tmp_path / 'empty' / 'config.json'} does not exist; give a Llama folder written by save_pretrained",
    }
    with project_modules(project):
        parse_args = importlib.import_module("config").parse_args
        for name, expected in cases.items():
            folder = tmp_path / name
            with pytest.raises(SystemExit) as stopped:
                parse_args(["--config", str(project / "config.toml"), "--model.hf_checkpoint", str(folder)])
            assert stopped.value.code == 2
            assert capsys.readouterr().err.splitlines() == [f"{Path(sys.argv[0]).name}: error: model.hf_checkpoint "
                                                            f"{folder}: {expected}"]  # fmt: skip
        # llama3 scaling set in config.toml (a model of `size`): its band must not be empty.
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--config", str(project / "config.toml"), "--model.hf_checkpoint", "", "--model.rope_type",
                        "llama3", "--model.rope_high_freq_factor", "1"])  # fmt: skip
        assert stopped.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f'{Path(sys.argv[0]).name}: error: model.rope_type "llama3" interpolates between the wavelengths of '
            "model.rope_high_freq_factor (1.0) and model.rope_low_freq_factor (1.0): the high one must be the larger; "
            "e.g. Llama 3.1's 4.0 and 1.0"
        ]
        # The tokenizer the checkpoint came with, gone: data.tokenizer's own one line.
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--config", str(project / "config.toml"), "--data.tokenizer", str(tmp_path / "empty")])
        assert stopped.value.code == 2
        error = capsys.readouterr().err.splitlines()
        assert len(error) == 1 and "tokenizer.json does not exist" in error[0], error


def test_export_format_hf_without_a_transformers_class_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (A mixture of experts that does not route as Mixtral: tests/test_moe.py.) `python scripts/export.py`, run in
    # this process (run_in_this_process: it refuses before it reads anything; a process of its own imports torch).
    reason = "your own model (model.py) has no Hugging Face transformers class to load it"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        run_in_this_process(REPO / "generated_examples" / "custom-2gpu-fp32", "scripts/export.py", "--format", "hf",
                            "--output", str(tmp_path / "exported"))  # fmt: skip
    assert exit.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"export.py: error: --format hf: {reason}") and stderr.count("\n") == 1
    assert not (tmp_path / "exported").exists()
