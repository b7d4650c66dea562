"""The fsdp2gen CLI: options, prompts, defaults without a terminal, and bad input."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from fsdp2gen import __version__
from tests.conftest import fsdp2gen, invoke, tree


def answers_of(project: Path) -> dict:
    return yaml.safe_load((project / ".copier-answers.yml").read_text())


def test_version_and_help() -> None:
    assert fsdp2gen("--version").stdout == f"fsdp2gen {__version__}\n"
    top = fsdp2gen("--help")
    assert top.returncode == 0 and "new" in top.stdout
    new = fsdp2gen("new", "--help")
    assert new.returncode == 0
    for option in ("--family", "--gpus", "--nodes", "--precision", "--bf16", "--fp16", "--fp32", "--checkpoint"):
        assert option in new.stdout
    # Choices and help come from the template's copier.yml.
    assert "fp32|bf16|fp16" in new.stdout and "dcp|dcp-async|full" in new.stdout
    assert "GPUs per node" in new.stdout


def test_every_option_reaches_the_answers_file(tmp_path: Path) -> None:
    result = fsdp2gen(
        "new", str(tmp_path / "run"), "--family", "llama", "--gpus", "4", "--nodes", "3",
        "--precision", "fp16", "--checkpoint", "dcp", "--launcher", "slurm", "--project-name", "trial-7",
        "--tp", "2", "--no-moe", "--ep", "1", "--cp", "2", "--pp", "1", "--reshard-after-forward", "4",
        "--activation-checkpointing", "full", "--compile",
        "--cpu-offload", "--no-prefetch", "--tensorboard", "--no-float8", "--tokenizer", "gpt2", "--wandb",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing was missing, so no defaults were announced
    answers = answers_of(tmp_path / "run")
    assert {k: v for k, v in answers.items() if not k.startswith("_")} == {
        "project_name": "trial-7", "family": "llama", "hf_model": "", "gpus": 4, "nodes": 3, "precision": "fp16",
        "checkpoint": "dcp", "launcher": "slurm", "tp": 2, "moe": False, "ep": 1, "cp": 2, "pp": 1,
        "reshard_after_forward": "4",
        "activation_checkpointing": "full", "compile": True, "float8": False, "cpu_offload": True, "prefetch": False,
        "tensorboard": True, "tokenizer": "gpt2", "task": "pretrain", "qlora": False, "lora": False, "wandb": True,
    }  # fmt: skip
    config = (tmp_path / "run" / "config.toml").read_text()
    for line in ("cp = 2", "reshard_after_forward = 4", "activation_checkpointing = \"full", "compile = true",
                 "cpu_offload = true", "tensorboard = true", "wandb = true"):  # fmt: skip
        assert re.search(rf"^{line}\b", config, flags=re.M), line
    assert "prefetch_blocks" not in config
    assert re.search(r'^tokenizer = "gpt2"$', config, flags=re.M)
    assert answers["_commit"] == f"v{__version__}"
    assert answers["_src_path"].startswith("https://")


@pytest.mark.parametrize("flag,precision", [("--bf16", "bf16"), ("--fp16", "fp16"), ("--fp32", "fp32")])
def test_precision_shortcuts(tmp_path: Path, flag: str, precision: str) -> None:
    result = fsdp2gen("new", str(tmp_path / "run"), "-y", flag)
    assert result.returncode == 0, result.stderr
    assert answers_of(tmp_path / "run")["precision"] == precision


def test_without_a_terminal_missing_answers_take_defaults_and_are_announced(tmp_path: Path) -> None:
    result = fsdp2gen("new", str(tmp_path / "run"), "--gpus", "2")
    assert result.returncode == 0
    assert result.stderr == (
        "fsdp2gen: stdin is not a terminal; using defaults family=llama, nodes=1, precision=bf16, "
        "checkpoint=dcp, launcher=torchrun (pass --yes to accept silently)\n"
    )
    answers = answers_of(tmp_path / "run")
    assert (answers["gpus"], answers["nodes"], answers["precision"]) == (2, 1, "bf16")


def test_yes_accepts_defaults_silently(tmp_path: Path) -> None:
    result = fsdp2gen("new", str(tmp_path / "run"), "-y")
    assert result.returncode == 0 and result.stderr == ""
    assert answers_of(tmp_path / "run")["gpus"] == 8


def test_output_lists_files_and_next_commands(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    result = fsdp2gen("new", str(dest), "-y", "--nodes", "2")
    lines = result.stdout.splitlines()
    files = tree(dest)
    assert lines[0] == (
        f"Created {dest} (project_name=run, family=llama, hf_model='', gpus=8, nodes=2, precision=bf16, "
        "checkpoint=dcp, launcher=torchrun, tp=1, moe=False, ep=1, cp=1, pp=1, reshard_after_forward=true, "
        "activation_checkpointing=none, compile=False, "
        "float8=False, cpu_offload=False, prefetch=False, tensorboard=False, tokenizer='', task=pretrain, qlora=False, "
        "lora=False, wandb=False) "
        f"with {len(files)} files:"
    )
    assert {line.strip() for line in lines[1 : 1 + len(files)]} == set(files)
    assert f"  cd {dest}" in lines
    cpu = "NPROC=2 DEVICE=cpu scripts/launch_local.sh --training.global_batch_size 8 --training.seq_len 128"
    # A short warm-up (config.toml's 100 steps would keep 20 steps' learning rate near 0), and one machine's ranks
    # shard one copy: config.toml's dp_replicate = 2 (a replica per node) would leave 2 CPU ranks nothing to shard.
    why = "; --parallel.dp_replicate 1 shards over all of them (dp_replicate = 2: one replica per node)"
    one_machine = "--training.warmup_steps 2 --parallel.dp_replicate 1"
    assert f"  {cpu} {one_machine} --training.steps 20   # 2 CPU processes, gloo{why}" in lines
    assert (
        f"  scripts/launch_local.sh --job.output_dir outputs-gpu --parallel.dp_replicate 1   # 8 GPU(s) with nccl{why}"
        in lines
    )
    assert any("scripts/launch_multinode.sh" in line for line in lines[1 + len(files) :])


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdin as a terminal: an invalid answer is asked again (from a pipe it is an error, see below)."""
    monkeypatch.setattr("fsdp2gen.cli._stdin_is_terminal", lambda: True)


@pytest.mark.usefixtures("terminal")
def test_prompts_ask_for_missing_answers_only(tmp_path: Path) -> None:
    # family, nodes, precision and checkpoint are asked (gpus was given); an invalid answer is asked again.
    result = invoke("new", str(tmp_path / "run"), "--gpus", "2", "--interactive", input="llama\n0\n2\nfp16\n\nslurm\n")
    assert result.exit_code == 0, result.output
    prompts = re.findall(r"^(.*?) \[.*?\]: ", result.output, flags=re.M)
    assert prompts == [
        "Model family to train (llama, hf, custom)",
        "Number of nodes",
        "Number of nodes",
        "Training precision (bf16 and fp16 keep fp32 master weights and fp32 gradient reduction) (fp32, bf16, fp16)",
        "Checkpoint style (dcp, dcp-async, full)",
        "How jobs are launched (torchrun scripts are always included) (torchrun, slurm, ray)",
    ]
    assert "Error: must be at least 1, e.g. --nodes 2" in result.output
    answers = answers_of(tmp_path / "run")
    assert (answers["gpus"], answers["nodes"], answers["precision"], answers["checkpoint"]) == (2, 2, "fp16", "dcp")
    assert answers["launcher"] == "slurm"


@pytest.mark.usefixtures("terminal")
def test_prompt_rejects_a_non_integer_and_an_unknown_choice(tmp_path: Path) -> None:
    result = invoke("new", str(tmp_path / "run"), "--interactive", input="gpt\nllama\nabc\n4\n1\nbf16\ndcp\ntorchrun\n")
    assert result.exit_code == 0, result.output
    assert "Error: 'gpt' is not one of llama, hf, custom" in result.output
    assert "Error: 'abc' is not a valid int" in result.output
    assert answers_of(tmp_path / "run")["gpus"] == 4


def test_piped_answers_get_no_second_chance(tmp_path: Path) -> None:
    # A retry would read the next line, meant for the next question: the first invalid answer is an error.
    result = invoke("new", str(tmp_path / "run"), "--interactive", input="llama\n0\n2\n")
    assert result.exit_code == 2
    assert result.stderr.endswith(
        "fsdp2gen: error: --gpus: must be at least 1, e.g. --gpus 8 (answer read from stdin)\n"
    )
    assert not (tmp_path / "run").exists()


def test_no_interactive_never_prompts(tmp_path: Path) -> None:
    result = invoke("new", str(tmp_path / "run"), "--no-interactive", input="should not be read\n")
    assert result.exit_code == 0
    assert "using defaults" in result.output


FLOAT8_NEEDS_BF16 = (
    "fsdp2gen: error: --float8: float8 training runs inside bf16 mixed precision; add --bf16 (or leave out --float8)\n"
)
BAD_INPUT = [
    (["--gpus", "0"], "fsdp2gen: error: --gpus: must be at least 1, e.g. --gpus 8"),
    (["--gpus", "-1"], "fsdp2gen: error: --gpus: must be at least 1, e.g. --gpus 8"),
    (["--gpus", "abc"], "fsdp2gen: error: Invalid value for '--gpus': "),
    (["--nodes", "0"], "fsdp2gen: error: --nodes: must be at least 1, e.g. --nodes 2"),
    (["--family", "gpt"], "fsdp2gen: error: Invalid value for '--family': "),
    (["--precision", "fp8"], "fsdp2gen: error: Invalid value for '--precision': "),
    (["--checkpoint", "zip"], "fsdp2gen: error: Invalid value for '--checkpoint': "),
    (["--checkpoint", "async"], "fsdp2gen: error: Invalid value for '--checkpoint': "),
    (["--bf16", "--fp32"], "fsdp2gen: error: conflicting precision options --bf16 --fp32; give only one"),
    (
        ["--family", "hf"],
        "fsdp2gen: error: --hf-model: required with --family hf: a local folder with config.json "
        "and *.safetensors, or a hub id, e.g. --hf-model meta-llama/Llama-3.2-1B",
    ),
    (
        ["--family", "hf", "--hf-model", "/no/such/folder"],
        "fsdp2gen: error: --hf-model: /no/such/folder is not a "
        "folder with config.json; give a folder written by save_pretrained (config.json + *.safetensors) or a hub id",
    ),
    (
        ["--family", "hf", "--hf-model", "not an id!"],
        "fsdp2gen: error: --hf-model: not an id! is neither a folder "
        "with config.json nor a hub id like meta-llama/Llama-3.2-1B",
    ),
    (
        ["--hf-model", "gpt2"],
        "fsdp2gen: error: --hf-model: gpt2 is not a folder with config.json; --family llama starts from a local "
        "Hugging Face folder (hf download ID --local-dir DIR fetches a hub model)",
    ),
    (
        ["--family", "llama", "--pretrained"],
        "fsdp2gen: error: --pretrained: only applies to --family hf; drop it or add --family hf",
    ),
    (["--from-scratch"], "fsdp2gen: error: --pretrained: only applies to --family hf; drop it or add --family hf"),
    (["--fp16", "--precision", "bf16"], "fsdp2gen: error: conflicting precision options --fp16 --precision bf16"),
    (["--reshard-after-forward", "yes"],
     "fsdp2gen: error: --reshard-after-forward: must be true, false or a positive integer, e.g. "
     "--reshard-after-forward 8\n"),
    (["--gpus", "8", "--reshard-after-forward", "3"],
     "fsdp2gen: error: --reshard-after-forward: 3 must divide the 8 GPUs and be at least 2; use true, false or a "
     "divisor such as --reshard-after-forward 8\n"),
    (["--activation-checkpointing", "some"], "fsdp2gen: error: Invalid value for '--activation-checkpointing': "),
    (["--gpus", "6", "--tp", "4"],
     "fsdp2gen: error: --tp: 4 must divide the 6 GPUs per node (TP stays inside a node), e.g. --tp 3\n"),
    (["--tp", "0"], "fsdp2gen: error: --tp: must be at least 1, e.g. --tp 2\n"),
    (["--float8", "--fp32"], FLOAT8_NEEDS_BF16),
    (["--float8", "--fp16"], FLOAT8_NEEDS_BF16),
]  # fmt: skip


@pytest.mark.parametrize("options,message", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_answers_exit_2_with_one_line_and_write_nothing(tmp_path: Path, options: list[str], message: str) -> None:
    result = fsdp2gen("new", "run", "-y", *options, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(message), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_non_empty_destination_is_refused_even_with_force(tmp_path: Path) -> None:
    """A non-empty DEST that holds no fsdp2gen project is never written to: --force only updates a project
    fsdp2gen made (tests/test_force.py)."""
    dest = tmp_path / "run"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):
        result = fsdp2gen("new", str(dest), "-y", *force)
        assert result.returncode == 2
        assert result.stderr == (
            f"fsdp2gen: error: {dest} exists, is not empty and holds no project fsdp2gen made (no "
            ".copier-answers.yml); choose another DEST or empty it\n"
        )
        assert tree(dest) == {"notes.txt": b"mine"}


def test_empty_destination_folder_is_fine(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert fsdp2gen("new", str(tmp_path / "run"), "-y").returncode == 0
    assert (tmp_path / "run" / "train.py").is_file()


def test_destination_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("x")
    result = fsdp2gen("new", str(tmp_path / "run"), "-y")
    assert result.returncode == 2
    assert result.stderr == f"fsdp2gen: error: {tmp_path / 'run'} exists and is not a folder; choose another DEST\n"


def test_unwritable_destination(tmp_path: Path) -> None:
    # /proc refuses new folders even to root, which ignores permission bits.
    result = fsdp2gen("new", "/proc/fsdp2gen-run", "-y")
    assert result.returncode == 2
    assert result.stderr.startswith("fsdp2gen: error: cannot write /proc/fsdp2gen-run: ")
    assert result.stderr.rstrip().endswith("choose a DEST you can write to")
    assert len(result.stderr.splitlines()) == 1


def test_nested_destination_parents_are_created(tmp_path: Path) -> None:
    result = fsdp2gen("new", str(tmp_path / "a" / "b" / "run"), "-y")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "a" / "b" / "run" / "train.py").is_file()
    # The staging folder lived in the nearest existing ancestor and is gone.
    assert [p.name for p in tmp_path.iterdir()] == ["a"]
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["run"]


def test_hf_model_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    result = fsdp2gen("new", "run", "-y", "--family", "hf", "--hf-model", "weights", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "fsdp2gen: error: --hf-model: weights is not a folder with config.json; give a folder written by "
        "save_pretrained (config.json + *.safetensors) or a hub id\n"
    )
    assert not (tmp_path / "run").exists()


def test_hf_answers_and_config(tmp_path: Path) -> None:
    # A hub id needs no folder at generation time; pretrained is the default, and announced.
    result = fsdp2gen("new", str(tmp_path / "hub"), "--family", "hf", "--hf-model", "meta-llama/Llama-3.2-1B")
    assert result.returncode == 0, result.stderr
    assert "using defaults gpus=8, nodes=1, precision=bf16, checkpoint=dcp, launcher=torchrun, pretrained=True" in (
        result.stderr
    )
    answers = answers_of(tmp_path / "hub")
    assert (answers["family"], answers["hf_model"], answers["pretrained"]) == ("hf", "meta-llama/Llama-3.2-1B", True)
    config = (tmp_path / "hub" / "config.toml").read_text()
    assert 'path = "meta-llama/Llama-3.2-1B"\npretrained = true ' in config
    # A local folder, given relative to the current directory, is written as an absolute path.
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    # A from-scratch model needs only a transformers config (no weights).
    (tmp_path / "models" / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    result = fsdp2gen("new", "local", "-y", "--family", "hf", "--hf-model", "models/tiny", "--from-scratch",
                      cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert answers_of(tmp_path / "local")["hf_model"] == "models/tiny"
    config = (tmp_path / "local" / "config.toml").read_text()
    assert f'path = "{tmp_path / "models" / "tiny"}"\npretrained = false ' in config
    # transformers is a dependency of hf projects; a llama project reaches it only through its optional [eval] extra
    # (lm-eval's Hugging Face model class scores the `export.py --format hf` folder).
    assert '"transformers>=' in (tmp_path / "local" / "pyproject.toml").read_text()
    assert fsdp2gen("new", str(tmp_path / "llama"), "-y").returncode == 0
    llama = tomllib.loads((tmp_path / "llama" / "pyproject.toml").read_text())["project"]
    assert [d for d in llama["dependencies"] if "transformers" in d or "lm_eval" in d] == []
    assert llama["optional-dependencies"]["eval"] == ["lm_eval[hf]>=0.4.13"]
    # The built-in llama may start from a Hugging Face checkpoint (none here); pretrained is the hf family's.
    assert answers_of(tmp_path / "llama")["hf_model"] == "" and "pretrained" not in answers_of(tmp_path / "llama")


@pytest.mark.usefixtures("terminal")
def test_prompts_ask_for_the_hf_model_of_family_hf(tmp_path: Path) -> None:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"")  # pretrained (the default) needs weights
    # An empty answer is refused and asked again; pretrained is not asked (its default is used).
    result = invoke("new", str(tmp_path / "run"), "--family", "hf", "--gpus", "2", "--nodes", "1", "--fp32",
                    "--checkpoint", "dcp", "--launcher", "torchrun", "--interactive",
                    input=f"\n{tmp_path / 'tiny'}\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    prompts = re.findall(r"^(.*?) \[.*?\]: ", result.output, flags=re.M)
    assert prompts == [QUESTION_HF_MODEL, QUESTION_HF_MODEL]
    assert "Error: required with --family hf" in result.output
    answers = answers_of(tmp_path / "run")
    assert (answers["hf_model"], answers["pretrained"]) == (str(tmp_path / "tiny"), True)


QUESTION_HF_MODEL = (
    "Hugging Face model: a local folder with config.json and *.safetensors, or a hub id (family hf); for family "
    "llama, a local Llama folder to start from (its shape, weights and tokenizer)"
)
