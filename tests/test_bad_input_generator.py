"""The generator's bad-input contract (issue 16): any bad input to `fsdp2gen` (new, update, plan, check) gives
exactly one line on stderr naming the problem and the fix, exit code 2, no traceback, and nothing written.

CASES is the table; docs/bad-inputs-generator.md lists the same cases with their messages (a test keeps the two
in step). Each case runs the CLI as a process of its own (see run_cli), in a folder of its own whose files,
modes, inodes and mtimes must be the same afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.meta
import pytest
import yaml

from fsdp2gen.cli import main
from fsdp2gen.questions import load_answers_file, questions, validate
from tests.conftest import REPO, fsdp2gen

COPIER = str(Path(sys.executable).parent / "copier")
DOC = REPO / "docs" / "bad-inputs-generator.md"
SUMMARY = REPO / "docs" / "bad-inputs.md"  # its generator section counts the cases too
GIT_ENV = {
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
}  # fmt: skip
CLOSED = None  # Case.stdin: no stdin at all (`<&-`)

Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # run with cwd = the case's own folder
    message: str  # what follows "fsdp2gen: error: "; a literal, with {d} for the case folder, unless regex
    setup: tuple[Setup, ...] = ()
    stdin: str | None = ""
    regex: bool = False

    def pattern(self, folder: Path) -> str:
        if self.regex:
            return self.message
        return re.escape(self.message).replace(re.escape("{d}"), re.escape(str(folder)))


def described(what: str) -> Callable[[Setup], Setup]:
    """Give a setup function the words the table in docs/ shows for it."""

    def mark(setup: Setup) -> Setup:
        setup.what = what  # type: ignore[attr-defined]
        return setup

    return mark


def short(value: object, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def write(name: str, content: str | bytes) -> Setup:
    @described(f"{name} holds {short(content if isinstance(content, bytes) else content.encode())}")
    def setup(folder: Path) -> None:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return setup


def mkdir(name: str) -> Setup:
    @described(f"{name} is a folder")
    def setup(folder: Path) -> None:
        (folder / name).mkdir(parents=True)

    return setup


def fifo(name: str) -> Setup:
    @described(f"{name} is a FIFO")
    def setup(folder: Path) -> None:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(folder / name)

    return setup


def sparse(name: str, size: int) -> Setup:
    @described(f"{name} is a {size // 2**20} MiB file")
    def setup(folder: Path) -> None:
        with open(folder / name, "wb") as f:
            f.truncate(size)  # sparse: nothing is written to disk

    return setup


RECORDED = (
    "_commit: v0.1.0\n_src_path: https://github.com/fsdp2gen/fsdp2gen.git\nproject_name: p\nfamily: llama\n"
    "gpus: {gpus}\nnodes: {nodes}\nprecision: bf16\ncheckpoint: dcp\nlauncher: torchrun\ntp: 1\n"
    "reshard_after_forward: 'true'\nactivation_checkpointing: none\ncompile: false\nfloat8: false\n"
    "cpu_offload: false\nprefetch: false\ntensorboard: false\n"
)


def project(answers: str | bytes | None = None, *, gpus: int = 2, nodes: int = 1, git: bool = True) -> Setup:
    """A generated project as `update` sees it (p/): its answers file (`answers`, or valid ones for `gpus` x
    `nodes`), committed. Nothing is rendered: each case fails before copier would run."""
    recorded = (
        f"answers of --gpus {gpus} --nodes {nodes}"
        if answers is None
        else f".copier-answers.yml holds {short(answers if isinstance(answers, bytes) else answers.encode())}"
    )

    @described(f"p/ is a {'' if git else 'non-'}git project, {recorded}")
    def setup(folder: Path) -> None:
        path = folder / "p"
        path.mkdir()
        (path / "README.md").write_text("project\n")
        text = RECORDED.format(gpus=gpus, nodes=nodes) if answers is None else answers
        (path / ".copier-answers.yml").write_bytes(text if isinstance(text, bytes) else text.encode())
        if git:
            env = {**os.environ, **GIT_ENV}
            for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "generated"]):
                subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, env=env)

    return setup


# A LlamaForCausalLM config.json's shape keys (a tiny one), for the cases that differ in another key.
LLAMA_SHAPE = ('{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
               '"num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 320, "intermediate_size": 128, '
               '"max_position_embeddings": 64}')  # fmt: skip


def hf_folder(config: str | bytes | None = '{"model_type": "llama"}', weights: bool = True) -> Setup:
    contents = (
        f"config.json holds {short(config if isinstance(config, bytes) else config.encode())}"
        if config is not None
        else "no config.json"
    )

    @described(f"m/: {contents}, {'a' if weights else 'no'} model.safetensors")
    def setup(folder: Path) -> None:
        (folder / "m").mkdir()
        if config is not None:
            write("m/config.json", config)(folder)
        if weights:
            (folder / "m" / "model.safetensors").write_bytes(b"")

    return setup


NEW = ("new", "run", "-y")
MAX_NAME = "a" * 256
LONG_PATH = "/".join(["b" * 200] * 25)  # each name fits, the whole path is over PATH_MAX (4096)
DEPENDENCY = (
    "{name} is the name of a package the project depends on, so `pip install -e .` cannot install it; pick another "
    "name with --project-name or DEST, e.g. --project-name my-{name}"
)
BAD_NAME = (
    "must be lowercase letters, digits, '.', '_' or '-', starting and ending with a letter or digit, "
    "e.g. --project-name my-run"
)
AF = "pass a YAML file of answers like 'gpus: 8'"
# "Billion laughs": 10 lines that expand to 9**10 values (PyYAML: a MemoryError after a minute and GBs).
ALIAS_BOMB = (
    "".join(f"_a{i}: &a{i} [{', '.join([f'*a{i - 1}' if i else '1'] * 9)}]\n" for i in range(10)) + "gpus: *a9\n"
)
LLAMA_FIX = (
    "--family llama starts from a local Hugging Face folder (hf download ID --local-dir DIR fetches a hub model)"
)
HF_FIX = "give a folder written by save_pretrained (config.json + *.safetensors) or a hub id"
RESTORE = "restore it from an earlier commit (git log -- .copier-answers.yml) or fix it by hand"
NOT_INT = "Input should be a valid integer, unable to parse string as an integer"
DEEP = "x = " + "+".join(["1"] * 100_000) + "\n"

CASES = [
    # typer/click's usage errors, one line (OneLineErrors)
    Case("usage-unknown-option", (*NEW, "--gpuz", "2"), r"No such option: --gpuz \(Possible options: .*\)", regex=True),
    Case("usage-missing-dest", ("new",), "Missing argument 'DEST'."),
    Case("usage-unknown-command", ("nw",), "No such command 'nw'. Did you mean 'new'?"),
    Case("usage-option-without-value", (*NEW, "--gpus"), "Option '--gpus' requires an argument."),
    Case("gpus-not-a-number", (*NEW, "--gpus", "abc"), f"Invalid value for '--gpus': 'abc': {NOT_INT}"),
    Case("gpus-float", (*NEW, "--gpus", "1.5"), f"Invalid value for '--gpus': '1.5': {NOT_INT}"),
    Case("gpus-empty", (*NEW, "--gpus", ""), f"Invalid value for '--gpus': '': {NOT_INT}"),
    Case(
        "gpus-5000-digits",
        (*NEW, "--gpus", "9" * 5000),
        f"Invalid value for '--gpus': '{'9' * 56}...: Unable to parse input string as an integer, exceeded maximum "
        "size",
    ),
    Case(
        "family-unknown",
        (*NEW, "--family", "gpt"),
        "Invalid value for '--family': 'gpt' is not one of 'llama', 'hf', 'custom'.",
    ),
    Case(
        "precision-unknown",
        (*NEW, "--precision", "fp8"),
        "Invalid value for '--precision': 'fp8' is not one of 'fp32', 'bf16', 'fp16'.",
    ),
    Case(
        "checkpoint-unknown",
        (*NEW, "--checkpoint", "zip"),
        "Invalid value for '--checkpoint': 'zip' is not one of 'dcp', 'dcp-async', 'full'.",
    ),
    Case(
        "launcher-unknown",
        (*NEW, "--launcher", "k8s"),
        "Invalid value for '--launcher': 'k8s' is not one of 'torchrun', 'slurm', 'ray'.",
    ),
    Case(
        "ac-unknown",
        (*NEW, "--activation-checkpointing", "some"),
        "Invalid value for '--activation-checkpointing': 'some' is not one of 'none', 'selective', 'layer', 'full'.",
    ),
    Case(
        "precision-conflict", (*NEW, "--bf16", "--fp32"), "conflicting precision options --bf16 --fp32; give only one"
    ),
    # numbers: lower and upper bounds, and hints that are themselves accepted
    Case("gpus-zero", (*NEW, "--gpus", "0"), "--gpus: must be at least 1, e.g. --gpus 8"),
    Case("gpus-negative", (*NEW, "--gpus", "-3"), "--gpus: must be at least 1, e.g. --gpus 8"),
    Case(
        "gpus-65",
        (*NEW, "--gpus", "65"),
        "--gpus: 65 is more GPUs than one node has (at most 64); give the GPUs per node, e.g. --gpus 8",
    ),
    Case(
        "gpus-1e20",
        (*NEW, "--gpus", "100000000000000000000"),
        "--gpus: 100000000000000000000 is more GPUs than one node has (at most 64); give the GPUs per node, e.g. "
        "--gpus 8",
    ),
    Case("nodes-zero", (*NEW, "--nodes", "0"), "--nodes: must be at least 1, e.g. --nodes 2"),
    Case("nodes-negative", (*NEW, "--nodes", "-1"), "--nodes: must be at least 1, e.g. --nodes 2"),
    Case(
        "nodes-16385",
        (*NEW, "--nodes", "16385"),
        "--nodes: 16385 nodes is more than any cluster runs as one job (at most 16384), e.g. --nodes 2",
    ),
    Case("tp-zero", (*NEW, "--tp", "0"), "--tp: must be at least 1, e.g. --tp 2"),
    Case("tp-negative", (*NEW, "--tp", "-2"), "--tp: must be at least 1, e.g. --tp 2"),
    Case(
        "tp-not-a-divisor",
        (*NEW, "--tp", "3"),
        "--tp: 3 must divide the 8 GPUs per node (TP stays inside a node), e.g. --tp 2",
    ),
    Case(
        "tp-above-gpus",
        (*NEW, "--gpus", "6", "--tp", "128"),
        "--tp: 128 must divide the 6 GPUs per node (TP stays inside a node), e.g. --tp 6",
    ),
    Case(
        "tp-family-custom",
        (*NEW, "--family", "custom", "--tp", "2"),
        "--tp: tensor parallelism is built in for --family llama and hf only; use --tp 1",
    ),
    Case(
        "tp-hf-qlora",  # --lora with --tp is built (tensor_parallel.lora_styles); QLoRA's NF4 weights are not split
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--gpus", "2", "--tp", "2", "--qlora"),
        "--qlora: --qlora with tensor parallelism is not built yet (NF4 weights are sharded by fully_shard only); use "
        "--tp 1 (or leave out --qlora)",
    ),
    Case(
        "moe-family-hf",
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--moe"),
        "--moe: mixture-of-experts blocks are built in for --family llama only; drop --moe",
    ),
    Case(
        "qlora-family-llama",
        (*NEW, "--qlora"),
        "--qlora: QLoRA quantizes a pretrained Hugging Face model; use --family hf --hf-model MODEL (or leave out "
        "--qlora)",
    ),
    Case(
        "qlora-from-scratch",
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--qlora", "--from-scratch"),
        "--qlora: QLoRA quantizes pretrained weights; drop --from-scratch (or leave out --qlora)",
    ),
    Case(
        "qlora-without-lora",
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--qlora", "--no-lora"),
        "--lora: --qlora is LoRA on an NF4 base; drop --no-lora (--qlora implies --lora)",
    ),
    Case(
        "moe-with-tp",
        (*NEW, "--tp", "2", "--moe"),
        "--moe: --moe with --tp 2: experts are not split by tensor parallelism here; use --tp 1 (FSDP and --ep shard "
        "them)",
    ),
    Case(
        "moe-with-cp",
        (*NEW, "--cp", "2", "--moe"),
        "--cp: context parallelism is not built for mixture-of-experts models (--moe) yet; use --cp 1",
    ),
    Case("cp-zero", (*NEW, "--cp", "0"), "--cp: must be at least 1, e.g. --cp 2"),
    Case("cp-not-a-divisor", (*NEW, "--cp", "3"), "--cp: 3 must divide the 8 GPUs, e.g. --cp 2"),
    Case(
        "cp-times-tp-not-a-divisor",
        (*NEW, "--gpus", "4", "--tp", "4", "--cp", "2"),
        "--cp: 2 x --tp 4 must divide the 4 GPUs, e.g. --cp 1",
    ),
    Case(
        "cp-spans-nodes-not-a-divisor",
        (*NEW, "--gpus", "4", "--nodes", "2", "--cp", "3"),
        "--cp: 3 must divide the 8 GPUs (2 nodes x 4), e.g. --cp 2",
    ),
    Case(
        "cp-family-custom",
        (*NEW, "--family", "custom", "--cp", "2"),
        "--cp: context parallelism is built in for --family llama and hf only; use --cp 1",
    ),
    # An hf model whose config.json says ring attention cannot split its attention (preflight probes the rest).
    Case(
        "cp-hf-softcapped-attention",
        (*NEW, "--family", "hf", "--hf-model", "m", "--gpus", "4", "--cp", "2"),
        "--cp: Gemma2ForCausalLM (m/config.json) soft-caps its attention logits, which ring attention (causal SDPA "
        "over the whole sequence, in pieces) cannot split; use --cp 1",
        (hf_folder('{"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50}'),),
    ),
    Case(
        "cp-hf-linear-attention-layers",
        (*NEW, "--family", "hf", "--hf-model", "m", "--gpus", "4", "--cp", "2"),
        "--cp: Qwen3NextForCausalLM (m/config.json) has linear_attention layers (state carried along the sequence), "
        "which ring attention (causal SDPA over the whole sequence, in pieces) cannot split; use --cp 1",
        (
            hf_folder(
                '{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "layer_types": '
                '["linear_attention", "full_attention"]}'
            ),
        ),  # fmt: skip
    ),
    Case("pp-zero", (*NEW, "--pp", "0"), "--pp: must be at least 1, e.g. --pp 2"),
    Case("pp-not-a-divisor", (*NEW, "--pp", "3"), "--pp: 3 must divide the 8 GPUs, e.g. --pp 2"),
    Case(
        "pp-family-custom",
        (*NEW, "--family", "custom", "--pp", "2"),
        "--pp: pipeline parallelism is built in for --family llama and hf only; use --pp 1",
    ),
    Case("ep-zero", (*NEW, "--moe", "--ep", "0"), "--ep: must be at least 1, e.g. --ep 2"),
    Case(
        "ep-without-moe",
        (*NEW, "--ep", "2"),
        "--ep: expert parallelism needs mixture-of-experts blocks; add --moe, or use --ep 1",
    ),
    Case(
        "ep-not-a-divisor",
        (*NEW, "--moe", "--ep", "3"),
        "--ep: 3 must divide the 8 GPUs per node (expert parallelism borrows the ranks of a node's shard group), "
        "e.g. --ep 2",
    ),
    Case(
        "ep-hf-with-qlora",  # --lora with --ep is built (expert_parallel.apply_lora_expert_parallel); NF4 is not split
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--ep", "2", "--qlora"),
        "--qlora: --qlora with expert parallelism is not built yet (NF4 weights are sharded by fully_shard only); use "
        "--ep 1 (or leave out --qlora)",
    ),
    Case(
        "ep-hf-lora-with-pp",  # LoRA x ep and ep x pp are each proven; the three together are not
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--ep", "2", "--lora", "--pp", "2"),
        "--ep: --ep with --lora is built without --pp only (the experts' adapters are not yet split inside pipeline "
        "stages); use --ep 1 or --pp 1",
    ),
    Case(
        "ep-hf-with-tp",
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--ep", "2", "--tp", "2"),
        "--ep: --ep with --tp for an hf model is not built yet (its experts would need both meshes); use --ep 1 or "
        "--tp 1",
    ),
    Case(
        "ep-hf-beyond-what-cp-leaves",
        (*NEW, "--family", "hf", "--hf-model", "org/model", "--ep", "8", "--cp", "2"),
        "--ep: 8 must divide the 4 GPUs per node that --cp 2 leaves to dp_shard (expert parallelism borrows its "
        "ranks from dp_shard, not from cp), e.g. --ep 4",
    ),
    Case(
        "reshard-zero",
        (*NEW, "--reshard-after-forward", "0"),
        "--reshard-after-forward: must be true, false or a positive integer, e.g. --reshard-after-forward 8",
    ),
    Case(
        "reshard-one",
        (*NEW, "--reshard-after-forward", "1"),
        "--reshard-after-forward: 1 must divide the 8 GPUs and be at least 2; use true, false or a divisor such as "
        "--reshard-after-forward 8",
    ),
    Case(
        "reshard-not-a-divisor",
        (*NEW, "--reshard-after-forward", "3"),
        "--reshard-after-forward: 3 must divide the 8 GPUs and be at least 2; use true, false or a divisor such as "
        "--reshard-after-forward 8",
    ),
    Case(
        "reshard-word",
        (*NEW, "--reshard-after-forward", "yes"),
        "--reshard-after-forward: must be true, false or a positive integer, e.g. --reshard-after-forward 8",
    ),
    Case(
        "reshard-empty",
        (*NEW, "--reshard-after-forward", ""),
        "--reshard-after-forward: must be true, false or a positive integer, e.g. --reshard-after-forward 8",
    ),
    Case(
        "reshard-capitalised",
        (*NEW, "--reshard-after-forward", "True"),
        "--reshard-after-forward: must be lowercase true or false (in a YAML data file quote it: 'true'), e.g. "
        "--reshard-after-forward true",
    ),
    Case(
        "reshard-float",
        (*NEW, "--reshard-after-forward", "4.0"),
        "--reshard-after-forward: must be true, false or a positive integer, e.g. --reshard-after-forward 8",
    ),
    Case(
        "reshard-huge",
        (*NEW, "--reshard-after-forward", "9" * 5000),
        "--reshard-after-forward: 999999999... is more than the 8 GPUs; use true, false or a divisor such as "
        "--reshard-after-forward 8",
    ),
    Case(
        "reshard-one-gpu",
        (*NEW, "--gpus", "1", "--reshard-after-forward", "2"),
        "--reshard-after-forward: 2 needs at least 2 GPUs in all to group; use --reshard-after-forward true or false",
    ),
    Case(
        "reshard-hint-1-gpu-2-nodes",
        (*NEW, "--nodes", "2", "--gpus", "1", "--reshard-after-forward", "4"),
        "--reshard-after-forward: 4 must divide the 2 GPUs and be at least 2; use true, false or a divisor such as "
        "--reshard-after-forward 2",
    ),
    Case(
        "float8-fp32",
        (*NEW, "--float8", "--fp32"),
        "--float8: float8 training runs inside bf16 mixed precision; add --bf16 (or leave out --float8)",
    ),
    # project names
    Case("name-empty", (*NEW, "--project-name", ""), f"--project-name: {BAD_NAME}"),
    Case("name-uppercase", (*NEW, "--project-name", "MyRun"), f"--project-name: {BAD_NAME}"),
    Case("name-trailing-dash", (*NEW, "--project-name", "run-"), f"--project-name: {BAD_NAME}"),
    Case("name-newline", (*NEW, "--project-name", "run\n"), f"--project-name: {BAD_NAME}"),
    Case("name-torch", (*NEW, "--project-name", "torch"), "--project-name: " + DEPENDENCY.format(name="torch")),
    Case(
        "name-pep503-equal",
        (*NEW, "--project-name", "typing_extensions"),
        "--project-name: typing_extensions is the name of a package the project depends on, so `pip install -e .` "
        "cannot install it; pick another name with --project-name or DEST, e.g. --project-name my-typing-extensions",
    ),
    Case(
        "dest-named-torch",
        ("new", "torch", "-y"),
        "project name 'torch' (from DEST's folder name): " + DEPENDENCY.format(name="torch"),
    ),
    Case(
        "dest-named-Numpy",
        ("new", "Numpy", "-y"),
        "project name 'numpy' (from DEST's folder name): " + DEPENDENCY.format(name="numpy"),
    ),
    Case("dest-non-ascii", ("new", "café", "-y"), f"project name 'café' (from DEST's folder name): {BAD_NAME}"),
    # DEST
    Case("dest-empty", ("new", "", "-y"), "DEST is empty; give the folder to create, e.g. fsdp2gen new my-run"),
    Case(
        "dest-name-256-bytes",
        ("new", MAX_NAME, "-y"),
        f"DEST name '{'a' * 40}...' is 256 bytes, more than the 255 a file name may have; choose a shorter DEST",
    ),
    Case(
        "dest-name-256-bytes-utf8",
        ("new", "é" * 128, "-y"),
        f"DEST name '{'é' * 40}...' is 256 bytes, more than the 255 a file name may have; choose a shorter DEST",
    ),
    Case(
        "dest-nested-name-256-bytes",
        ("new", f"a/{MAX_NAME}/b", "-y"),
        f"DEST name '{'a' * 40}...' is 256 bytes, more than the 255 a file name may have; choose a shorter DEST",
    ),
    Case(
        "dest-path-too-long",
        ("new", LONG_PATH, "-y"),
        f"cannot use {LONG_PATH}: File name too long; choose another DEST",
    ),
    Case("dest-is-a-file", NEW, "{d}/run exists and is not a folder; choose another DEST", (write("run", "x"),)),
    Case(
        "dest-inside-a-file",
        ("new", "notes.txt/run", "-y"),
        "cannot create {d}/notes.txt/run: {d}/notes.txt is a file, not a folder; choose another DEST",
        (write("notes.txt", "x"),),
    ),
    Case(
        "dest-not-empty",
        NEW,
        "{d}/run exists, is not empty and holds no project fsdp2gen made (no .copier-answers.yml); choose another "
        "DEST or empty it",
        (write("run/mine.txt", "mine"),),
    ),
    Case(
        "dest-not-empty-force",
        (*NEW, "--force"),
        "{d}/run exists, is not empty and holds no project fsdp2gen made (no .copier-answers.yml); choose another "
        "DEST or empty it",
        (write("run/mine.txt", "mine"),),
    ),
    Case(
        "dest-holds-a-project",
        NEW,
        "{d}/run already holds an fsdp2gen project; choose another DEST, or pass --force to re-render it with these "
        "answers (your edits are kept or shown as conflicts)",
        (write("run/.copier-answers.yml", "gpus: 2\n"),),
    ),
    Case(
        "dest-force-answers-alias",
        (*NEW, "--force"),
        "answers file {d}/run/.copier-answers.yml line 1: anchor &a is refused (YAML anchors and aliases can expand to "
        "billions of values); write each value out",
        (write("run/.copier-answers.yml", "_x: &a 1\ngpus: *a\n"),),
    ),
    Case(
        "dest-not-writable",
        ("new", "/proc/fsdp2gen-run", "-y"),
        r"cannot (write|create) /proc/fsdp2gen-run: .*; choose a DEST you can write to",
        regex=True,
    ),
    # answers files
    Case(
        "answers-file-missing",
        (*NEW, "--answers-file", "a.yml"),
        f"cannot read answers file a.yml: No such file or directory; {AF}",
    ),
    Case(
        "answers-file-folder",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is a folder, not a file; {AF}",
        (mkdir("a.yml"),),
    ),
    Case(
        "answers-file-fifo",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not a regular file (a pipe or a device); {AF}",
        (fifo("a.yml"),),
    ),
    Case(
        "answers-file-device",
        (*NEW, "--answers-file", "/dev/zero"),
        f"answers file /dev/zero is not a regular file (a pipe or a device); {AF}",
    ),
    Case(
        "answers-file-too-large",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is larger than 256 KiB; {AF}",
        (sparse("a.yml", 17 * 2**20),),
    ),
    Case(
        "answers-file-binary",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not UTF-8 text (byte 2); {AF}",
        (write("a.yml", b"\x00\x01\xff\xfe"),),
    ),
    Case(
        "answers-file-latin1",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not UTF-8 text (byte 17); {AF}",
        (write("a.yml", "project_name: caf\xe9\n".encode("latin-1")),),
    ),
    Case(
        "answers-file-invalid-yaml",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not valid YAML (expected the node content, but found '<stream end>' (line 2)); {AF}",
        (write("a.yml", "gpus: [\n"),),
    ),
    Case(
        "answers-file-list",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml must be a mapping of answers like 'gpus: 8', got a list; {AF}",
        (write("a.yml", "- gpus\n"),),
    ),
    Case(
        "answers-file-empty",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml must be a mapping of answers like 'gpus: 8', got an empty document; {AF}",
        (write("a.yml", ""),),
    ),
    Case(
        "answers-file-duplicate-key",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not valid YAML (key 'gpus' appears twice (lines 1 and 3); keep one); {AF}",
        (write("a.yml", "gpus: 2\nnodes: 1\ngpus: 4\n"),),
    ),
    Case(
        "answers-file-duplicate-key-flow",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not valid YAML (key 'gpus' appears twice (lines 1 and 1); keep one); {AF}",
        (write("a.yml", "{gpus: 2, gpus: 4}\n"),),
    ),
    Case(
        "answers-file-alias-bomb",
        (*NEW, "--answers-file", "a.yml"),
        "answers file a.yml line 1: anchor &a0 is refused (YAML anchors and aliases can expand to billions of "
        "values); write each value out",
        (write("a.yml", ALIAS_BOMB),),
    ),
    Case(
        "answers-file-alias",
        (*NEW, "--answers-file", "a.yml"),
        "answers file a.yml line 1: alias *x is refused (YAML anchors and aliases can expand to billions of "
        "values); write each value out",
        (write("a.yml", "gpus: *x\n"),),
    ),
    Case(
        "answers-file-deeply-nested",
        (*NEW, "--answers-file", "a.yml"),
        f"answers file a.yml is not valid YAML (values nested more than 32 deep (line 1)); {AF}",
        (write("a.yml", "gpus: " + "[" * 100000 + "\n"),),
    ),
    Case(
        "answers-file-unknown-key",
        (*NEW, "--answers-file", "a.yml"),
        r"colour in a\.yml: unknown question; known: project_name, family, .*",
        (write("a.yml", "colour: red\n"),),
        regex=True,
    ),
    Case(
        "answers-file-gpus-word",
        (*NEW, "--answers-file", "a.yml"),
        "gpus in a.yml: 'eight' is not an integer, e.g. gpus: 8",
        (write("a.yml", "gpus: eight\n"),),
    ),
    Case(
        "answers-file-gpus-float",
        (*NEW, "--answers-file", "a.yml"),
        "gpus in a.yml: 4.5 is not an integer, e.g. gpus: 8",
        (write("a.yml", "gpus: 4.5\n"),),
    ),
    Case(
        "answers-file-gpus-bool",
        (*NEW, "--answers-file", "a.yml"),
        "gpus in a.yml: True is not an integer, e.g. gpus: 8",
        (write("a.yml", "gpus: true\n"),),
    ),
    Case(
        "answers-file-gpus-nan",
        (*NEW, "--answers-file", "a.yml"),
        "gpus in a.yml: nan is not an integer, e.g. gpus: 8",
        (write("a.yml", "gpus: .nan\n"),),
    ),
    Case(
        "answers-file-gpus-100",
        (*NEW, "--answers-file", "a.yml"),
        "gpus in a.yml: 100 is more GPUs than one node has (at most 64); give the GPUs per node, e.g. --gpus 8",
        (write("a.yml", "gpus: 100\n"),),
    ),
    Case(
        "answers-file-compile-word",
        (*NEW, "--answers-file", "a.yml"),
        "compile in a.yml: 'maybe' is not true or false, e.g. compile: false",
        (write("a.yml", "compile: maybe\n"),),
    ),
    Case(
        "answers-file-family-list",
        (*NEW, "--answers-file", "a.yml"),
        "family in a.yml: ['llama'] is not a string, e.g. family: llama",
        (write("a.yml", "family: [llama]\n"),),
    ),
    Case(
        "answers-file-reshard-float",
        (*NEW, "--answers-file", "a.yml"),
        "reshard_after_forward in a.yml: 4.5 is not a string, e.g. reshard_after_forward: 'true'",
        (write("a.yml", "reshard_after_forward: 4.5\n"),),
    ),
    Case(
        "answers-file-reshard-4-of-2",
        (*NEW, "--answers-file", "a.yml"),
        "reshard_after_forward in a.yml: 4 must divide the 2 GPUs and be at least 2; use true, false or a divisor "
        "such as --reshard-after-forward 2",
        (write("a.yml", "gpus: 2\nreshard_after_forward: 4\n"),),
    ),
    Case(
        "answers-file-contradicts-flag",
        (*NEW, "--answers-file", "a.yml", "--fp32"),
        "--precision fp32 contradicts precision: fp16 in a.yml; drop one of them",
        (write("a.yml", "precision: fp16\n"),),
    ),
    Case(
        "answers-file-tp-against-flag-gpus",
        (*NEW, "--answers-file", "a.yml", "--gpus", "6"),
        "tp in a.yml: 4 must divide the 6 GPUs per node (TP stays inside a node), e.g. --tp 3",
        (write("a.yml", "tp: 4\n"),),
    ),
    # --interactive without answers on stdin
    Case(
        "interactive-stdin-empty",
        ("new", "run", "--interactive"),
        "stdin ended before --family was answered; give it as --family VALUE, or pass --yes to use the defaults",
    ),
    Case(
        "interactive-stdin-closed",
        ("new", "run", "--interactive"),
        "--interactive needs stdin to read answers from, but stdin is closed; give the answers as flags or "
        "--answers-file, or pass --yes to use the defaults",
        stdin=CLOSED,
    ),
    Case(
        "interactive-stdin-invalid-answer",
        ("new", "run", "--interactive"),
        "--family: 'gpt' is not one of llama, hf, custom (answer read from stdin)",
        stdin="gpt\nllama\n",
    ),
    Case(
        "interactive-stdin-not-a-number",
        ("new", "run", "--interactive"),
        "--gpus: 'eight' is not a valid int (answer read from stdin)",
        stdin="llama\neight\n",
    ),
    # family hf
    Case(
        "hf-without-model",
        (*NEW, "--family", "hf"),
        "--hf-model: required with --family hf: a local folder with config.json and *.safetensors, or a hub id, e.g. "
        "--hf-model meta-llama/Llama-3.2-1B",
    ),
    Case(
        "hf-no-such-folder",
        (*NEW, "--family", "hf", "--hf-model", "./m"),
        f"--hf-model: ./m is not a folder with config.json; {HF_FIX}",
    ),
    Case(
        "hf-folder-without-config",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        f"--hf-model: m is not a folder with config.json; {HF_FIX}",
        (hf_folder(config=None),),
    ),
    Case(
        "hf-not-an-id",
        (*NEW, "--family", "hf", "--hf-model", "not an id!"),
        "--hf-model: not an id! is neither a folder with config.json nor a hub id like meta-llama/Llama-3.2-1B",
    ),
    Case(
        "hf-config-not-json",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        f"--hf-model: m/config.json is not valid JSON (Expecting value, line 1); {HF_FIX}",
        (hf_folder(config="not json"),),
    ),
    Case(
        "hf-config-not-an-object",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        f"--hf-model: m/config.json holds a JSON list, not an object; {HF_FIX}",
        (hf_folder(config="[1, 2]"),),
    ),
    Case(
        "hf-config-without-model-type",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        f"--hf-model: m/config.json has no model_type, so transformers cannot tell the architecture; {HF_FIX}",
        (hf_folder(config="{}"),),
    ),
    Case(
        "hf-config-binary",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        f"--hf-model: model config m/config.json is not UTF-8 text (byte 0); {HF_FIX}",
        (hf_folder(config=b"\xff\xfe"),),
    ),
    Case(
        "hf-pretrained-without-safetensors",
        (*NEW, "--family", "hf", "--hf-model", "m"),
        "--pretrained: m has no *.safetensors weights to load; save the model there with save_pretrained, or pass "
        "--from-scratch to start from its random init",
        (hf_folder(weights=False),),
    ),
    Case(
        "hf-model-custom-family",
        (*NEW, "--family", "custom", "--hf-model", "gpt2"),
        "--hf-model: only applies to --family hf or --family llama; drop it or add --family hf",
    ),
    # The built-in llama (the default family) starts from a local Llama folder only: shape, weights, tokenizer.
    Case(
        "llama-hf-model-hub-id",
        (*NEW, "--hf-model", "gpt2"),
        f"--hf-model: gpt2 is not a folder with config.json; {LLAMA_FIX}",
    ),
    Case(
        "llama-hf-model-without-config",
        (*NEW, "--hf-model", "m"),
        f"--hf-model: m is not a folder with config.json; {LLAMA_FIX}",
        (hf_folder(config=None),),
    ),
    Case(
        "llama-hf-model-without-tokenizer",
        (*NEW, "--hf-model", "m"),
        "--hf-model: m has no tokenizer.json; save the model's tokenizer there with its save_pretrained",
        (hf_folder(),),
    ),
    Case(
        "llama-hf-model-other-architecture",
        (*NEW, "--family", "llama", "--hf-model", "m"),
        "--hf-model: m: it is a Qwen2ForCausalLM, not a LlamaForCausalLM; the built-in llama takes Llama checkpoints "
        "only: train it with --family hf",
        (hf_folder('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}'), write("m/tokenizer.json", "{}")),
    ),
    # The project's own rules (hf_llama_config.py), run by the generator: the lines training stops with.
    Case(
        "llama-hf-model-yarn-rope",
        (*NEW, "--family", "llama", "--hf-model", "m"),
        '--hf-model: m: its rotary embeddings use "yarn" scaling, which the built-in llama does not have (it has '
        '"llama3"); train it with --family hf',
        (
            hf_folder(LLAMA_SHAPE[:-1] + ', "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}'),
            write("m/tokenizer.json", "{}"),
        ),
    ),
    Case(
        "llama-hf-model-partial-rotary",
        (*NEW, "--family", "llama", "--hf-model", "m"),
        "--hf-model: m: its rotary embeddings turn part of each head (partial_rotary_factor = 0.5), the built-in "
        "llama's turn all of it; train it with --family hf",
        (hf_folder(LLAMA_SHAPE[:-1] + ', "partial_rotary_factor": 0.5}'), write("m/tokenizer.json", "{}")),
    ),
    Case(
        "llama-hf-model-llama3-rope-incomplete",
        (*NEW, "--family", "llama", "--hf-model", "m"),
        '--hf-model: m: its "llama3" rotary scaling has no low_freq_factor, original_max_position_embeddings; give '
        "them in config.json's rope_parameters (Llama 3.1's: factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0, "
        "original_max_position_embeddings 8192)",
        (
            hf_folder(
                LLAMA_SHAPE[:-1] + ', "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}'
            ),
            write("m/tokenizer.json", "{}"),
        ),
    ),
    Case(
        "llama-hf-model-with-moe",
        (*NEW, "--hf-model", "m", "--moe"),
        "--moe: --moe with --hf-model: a Llama checkpoint has no experts to load; drop --moe (or --hf-model to train "
        "experts from scratch)",
        (hf_folder('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'), write("m/tokenizer.json", "{}")),
    ),
    Case(
        "pretrained-without-family",
        (*NEW, "--from-scratch"),
        "--pretrained: only applies to --family hf; drop it or add --family hf",
    ),
    # update
    Case(
        "update-empty-path",
        ("update", ""),
        "PATH is empty; give the generated project's folder, e.g. fsdp2gen update .",
    ),
    Case("update-not-a-folder", ("update", "p"), "p is not a folder; pass the path of a generated project"),
    Case(
        "update-no-answers-file",
        ("update", "p"),
        "p has no .copier-answers.yml; only projects generated by fsdp2gen or copier can be updated",
        (mkdir("p"),),
    ),
    Case(
        "update-answers-invalid-yaml",
        ("update", "p"),
        "answers file p/.copier-answers.yml is not valid YAML (expected the node content, but found '<stream end>' "
        "(line 2)); "
        f"{RESTORE}",
        (project("gpus: [\n"),),
    ),
    Case(
        "update-answers-not-a-mapping",
        ("update", "p"),
        f"answers file p/.copier-answers.yml must be a mapping of answers like 'gpus: 8', got a list; {RESTORE}",
        (project("- 1\n"),),
    ),
    Case(
        "update-answers-empty",
        ("update", "p"),
        "answers file p/.copier-answers.yml must be a mapping of answers like 'gpus: 8', got an empty document; "
        f"{RESTORE}",
        (project(""),),
    ),
    Case(
        "update-answers-binary",
        ("update", "p"),
        f"answers file p/.copier-answers.yml is not UTF-8 text (byte 0); {RESTORE}",
        (project(b"\xff\x00"),),
    ),
    Case(
        "update-answers-duplicate-key",
        ("update", "p"),
        "answers file p/.copier-answers.yml is not valid YAML (key 'gpus' appears twice (lines 1 and 2); keep "
        f"one); {RESTORE}",
        (project("gpus: 2\ngpus: 4\n"),),
    ),
    Case(
        "update-answers-alias-bomb",
        ("update", "p"),
        "answers file p/.copier-answers.yml line 1: anchor &a0 is refused (YAML anchors and aliases can expand to "
        "billions of values); write each value out",
        (project(ALIAS_BOMB),),
    ),
    Case(
        "update-answers-no-version",
        ("update", "p"),
        "p/.copier-answers.yml records no template version (_commit/_src_path); it was rendered from a folder that is "
        "not a git repository, so there is no version to update from",
        (project("gpus: 2\n"),),
    ),
    Case(
        "update-answers-commit-not-a-string",
        ("update", "p"),
        "_commit in p/.copier-answers.yml must be a string, got list; restore the value copier wrote (git log -p -- "
        ".copier-answers.yml)",
        (project("_commit: [1]\n_src_path: x\n"),),
    ),
    Case(
        "update-recorded-answer-invalid",
        ("update", "p"),
        "gpus in p/.copier-answers.yml: must be at least 1, e.g. --gpus 8",
        (project(gpus=0),),
    ),
    Case(
        "update-not-git",
        ("update", "p"),
        "p is not a git repository; run `git init && git add -A && git commit -m init` there first",
        (project(git=False),),
    ),
    Case(
        "update-uncommitted-changes",
        ("update", "p"),
        "p has uncommitted changes; commit or stash them, then update",
        (project(), write("p/notes.txt", "x")),
    ),
    Case(
        "update-tp-against-project-gpus",
        ("update", "p", "--tp", "3"),
        "--tp: 3 must divide the 2 GPUs per node (TP stays inside a node), e.g. --tp 2",
        (project(gpus=2),),
    ),
    Case(
        "update-gpus-100",
        ("update", "p", "--gpus", "100"),
        "--gpus: 100 is more GPUs than one node has (at most 64); give the GPUs per node, e.g. --gpus 8",
        (project(),),
    ),
    Case(
        "update-family-hf-without-model",
        ("update", "p", "--family", "hf"),
        "--hf-model: required with --family hf: a local folder with config.json and *.safetensors, or a hub id, e.g. "
        "--hf-model meta-llama/Llama-3.2-1B",
        (project(),),
    ),
    Case(
        "update-reshard-hint",
        ("update", "p", "--reshard-after-forward", "4"),
        "--reshard-after-forward: 4 must divide the 2 GPUs and be at least 2; use true, false or a divisor such as "
        "--reshard-after-forward 2",
        (project(gpus=1, nodes=2),),
    ),
    # check
    Case(
        "check-fifo",
        ("check", "x.py"),
        "x.py: not a regular file (a pipe, a device or a socket); pass Python files or folders",
        (fifo("x.py"),),
    ),
    Case(
        "check-device",
        ("check", "/dev/null"),
        "/dev/null: not a regular file (a pipe, a device or a socket); pass Python files or folders",
    ),
    Case(
        "check-fifo-in-folder",
        ("check", "src"),
        "src/x.py: not a regular file (a pipe, a device or a socket); pass Python files or folders",
        (write("src/a.py", "x = 1\n"), fifo("src/x.py")),
    ),
    Case(
        "check-deep-expression",
        ("check", "deep.py"),
        "deep.py: code nested too deeply to analyse (Python's recursion limit); fix the file or exclude it",
        (write("deep.py", DEEP),),
    ),
    Case(
        "check-nul-bytes",
        ("check", "nul.py"),
        "nul.py: invalid syntax (source code string cannot contain null bytes); fix the file or exclude it",
        (write("nul.py", b"x = 1\x00\n"),),
    ),
    Case(
        "check-not-utf8",
        ("check", "l.py"),
        "l.py: cannot read (not UTF-8 text, byte 8); save it as UTF-8 or exclude it",
        (write("l.py", "s = 'caf\xe9'\n".encode("latin-1")),),
    ),
    Case(
        "check-syntax-error",
        ("check", "s.py"),
        "s.py:1: invalid syntax; fix the file or exclude it",
        (write("s.py", "def (:\n"),),
    ),
    Case("check-missing", ("check", "nope.py"), "nope.py: no such file or folder; pass Python files or folders"),
    Case("check-empty-path", ("check", ""), "an empty PATH was given; pass Python files or folders"),
    Case(
        "check-format-unknown",
        ("check", "--format", "xml", "s.py"),
        "--format xml: choose text or json",
        (write("s.py", "x = 1\n"),),
    ),
    # plan
    Case(
        "plan-gpus-zero",
        ("plan", "--size", "8b", "--gpus", "0"),
        "--gpus must be at least 1, got 0; give --gpus 1 or more",
    ),
    Case(
        "plan-gpus-65",
        ("plan", "--size", "8b", "--gpus", "65"),
        "--gpus must be at most 64, got 65; give --gpus 64 or less",
    ),
    Case(
        "plan-nodes-huge",
        ("plan", "--size", "8b", "--nodes", "100000000000000000000"),
        "--nodes must be at most 16384, got 100000000000000000000; give --nodes 16384 or less",
    ),
    Case(
        "plan-tp-negative",
        ("plan", "--size", "8b", "--tp", "-1"),
        "--tp must be at least 1, got -1; give --tp 1 or more",
    ),
    Case(
        "plan-batch-zero",
        ("plan", "--size", "8b", "--batch", "0"),
        "--batch must be at least 1, got 0; give --batch 1 or more",
    ),
    Case(
        "plan-batch-huge",
        ("plan", "--size", "8b", "--batch", "1000000"),
        "--batch must be at most 65536, got 1000000; give --batch 65536 or less",
    ),
    Case(
        "plan-seq-negative",
        ("plan", "--size", "8b", "--seq", "-8"),
        "--seq must be at least 1, got -8; give --seq 1 or more",
    ),
    Case(
        "plan-seq-huge",
        ("plan", "--size", "8b", "--seq", "100000000"),
        "--seq must be at most 16777216, got 100000000; give --seq 16777216 or less",
    ),
    Case(
        "plan-gpus-not-a-number",
        ("plan", "--size", "8b", "--gpus", "nan"),
        f"Invalid value for '--gpus': 'nan': {NOT_INT}",
    ),
    Case(
        "plan-size-unknown",
        ("plan", "--size", "1t"),
        "--size 1t: unknown size; choose one of debug, 125m, 1b, 3b, 8b, 70b, 405b, debug-moe, qwen3-30b-a3b, "
        "deepseek-v3",
    ),
    Case(
        "plan-config-missing",
        ("plan", "--config", "nope.toml"),
        "config file nope.toml not found; pass a generated project's config.toml",
    ),
    Case(
        "plan-config-fifo",
        ("plan", "--config", "config.toml"),
        "config file config.toml is not a regular file (a pipe or a device); pass a generated project's config.toml",
        (fifo("config.toml"),),
    ),
    Case(
        "plan-config-folder",
        ("plan", "--config", "c"),
        "config file c is a folder, not a file; pass a generated project's config.toml",
        (mkdir("c"),),
    ),
    Case(
        "plan-config-binary",
        ("plan", "--config", "config.toml"),
        "config file config.toml is not UTF-8 text (byte 0); pass a generated project's config.toml",
        (write("config.toml", b"\xff\xfe"),),
    ),
    Case(
        "plan-config-deeply-nested",
        ("plan", "--config", "config.toml"),
        "config.toml: nested too deeply to read; pass a generated project's config.toml",
        (write("config.toml", "a = " + "[" * 100_000 + "]" * 100_000 + "\n"),),
    ),
    Case(
        "plan-config-layers-huge",
        ("plan", "--config", "config.toml"),
        "config.toml: model.n_layers must be from 1 to 4096, got 1000000000; fix that value in the file",
        (write("config.toml", "[model]\nn_layers = 1000000000\n"),),
    ),
    Case(
        "plan-config-nan",
        ("plan", "--config", "config.toml"),
        "config.toml: model.norm_eps must be a finite number >= 0, got nan; fix that value in the file",
        (write("config.toml", "[model]\nnorm_eps = nan\n"),),
    ),
    Case(
        "plan-config-seq-zero",
        ("plan", "--config", "config.toml"),
        "config.toml: training.seq_len must be an int from 1 to 16777216, got 0; fix that value in the file",
        (write("config.toml", "[training]\nseq_len = 0\n"),),
    ),
    Case(
        "plan-answers-duplicate-key",
        ("plan", "--config", "config.toml"),
        "answers file .copier-answers.yml is not valid YAML (key 'gpus' appears twice (lines 1 and 2); keep one); "
        "fix or delete it",
        (write("config.toml", ""), write(".copier-answers.yml", "gpus: 2\ngpus: 4\n")),
    ),
    Case(
        "plan-answers-alias-bomb",
        ("plan", "--config", "config.toml"),
        "answers file .copier-answers.yml line 1: anchor &a0 is refused (YAML anchors and aliases can expand to "
        "billions of values); write each value out",
        (write("config.toml", ""), write(".copier-answers.yml", ALIAS_BOMB)),
    ),
    Case(
        "plan-answers-gpus-huge",
        ("plan", "--config", "config.toml"),
        ".copier-answers.yml: gpus must be an int from 1 to 64, got 1000; fix it there or give --gpus",
        (write("config.toml", ""), write(".copier-answers.yml", "gpus: 1000\n")),
    ),
]


def snapshot(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every entry under `root` (itself included, .git left out: git refreshes its index when it runs):
    mode, inode, mtime and size, so that anything written, replaced, touched or re-created shows."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name != ".git"]
        for path in [Path(folder)] + [Path(folder) / name for name in files]:
            info = path.lstat()
            entries[str(path.relative_to(root))] = (info.st_mode, info.st_ino, info.st_mtime_ns, info.st_size)
    return entries


def run_cli(argv: tuple[str, ...], cwd: Path, stdin: str | None, timeout: float = 30) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `fsdp2gen *argv`, run as its own process: a fork of this one, whose
    fds 0-2 are files (stdin None: no fd 0 at all, as with `<&-`), calling the CLI's main() as the console
    script does, an uncaught exception printed as the interpreter prints it. A fork costs milliseconds where
    a new interpreter costs half a second of imports; tests/test_cli.py runs the real entry point."""
    with tempfile.TemporaryFile() as given, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        given.write((stdin or "").encode())
        given.seek(0)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            status = 1
            try:
                os.chdir(cwd)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                if stdin is None:
                    os.close(0)
                    sys.stdin = None
                else:
                    os.dup2(given.fileno(), 0)
                    sys.stdin = open(0, closefd=False)
                sys.argv = ["fsdp2gen", *argv]
                try:
                    main()
                    status = 0
                except SystemExit as error:
                    status = error.code if isinstance(error.code, int) else (error.code is not None)
                    if isinstance(error.code, str):
                        print(error.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                os._exit(status)
        deadline = time.monotonic() + timeout
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:  # e.g. blocked reading a FIFO
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"fsdp2gen {' '.join(argv)[:200]} still ran after {timeout} s")
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(waited[1]), out.read().decode(), err.read().decode()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_obeys_the_contract(case: Case, tmp_path: Path) -> None:
    for setup in case.setup:
        setup(tmp_path)
    before = snapshot(tmp_path)
    status, stdout, stderr = run_cli(case.argv, tmp_path, case.stdin)
    assert status == 2, stderr
    assert "Traceback" not in stderr + stdout
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert re.fullmatch("fsdp2gen: error: " + case.pattern(tmp_path), stderr[:-1]), stderr
    assert snapshot(tmp_path) == before  # nothing written, touched, removed or re-created
    OBSERVED[case.id] = stderr[:-1].replace(str(tmp_path), "<tmp>")


def test_case_ids_are_unique() -> None:
    assert len({case.id for case in CASES}) == len(CASES)


def test_new_fills_an_existing_empty_folder_in_place(tmp_path: Path) -> None:
    """`fsdp2gen new .` in an empty folder, and `new DEST` of an empty folder: the folder itself stays (the
    caller's shell may be in it), with its inode and mode; the project's files are moved into it."""
    for dest, cwd, argv in ((tmp_path / "here", tmp_path / "here", "."), (tmp_path / "there", tmp_path, "there")):
        dest.mkdir()
        dest.chmod(0o750)
        inode = dest.stat().st_ino
        result = fsdp2gen("new", argv, "-y", cwd=cwd)
        assert result.returncode == 0, result.stderr
        assert (dest.stat().st_ino, stat.S_IMODE(dest.stat().st_mode)) == (inode, 0o750)
        assert (dest / "train.py").is_file() and (dest / ".copier-answers.yml").is_file()
        assert yaml.safe_load((dest / ".copier-answers.yml").read_text())["project_name"] == dest.name
        assert not [p for p in dest.iterdir() if p.name.startswith(".fsdp2gen-")]  # the staging folder is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "there"]


def _suggestion(message: str) -> tuple[str, str] | None:
    """The `--flag VALUE` a message suggests (after 'e.g.', 'such as' or 'use'), as (answer name, value)."""
    found = re.search(r"(?:e\.g\.|such as|use) --([a-z-]+) (\S+?)[;,)]?(?: |$)", message)
    return (found.group(1).replace("-", "_"), found.group(2)) if found else None


SUGGESTING = [
    {"gpus": 0}, {"gpus": 65}, {"nodes": 0}, {"nodes": 20000}, {"tp": 0}, {"tp": 3}, {"gpus": 6, "tp": 4},
    {"gpus": 6, "tp": 128}, {"gpus": 3, "tp": 2}, {"gpus": 1, "tp": 2}, {"family": "custom", "tp": 2},
    {"cp": 0}, {"cp": 3}, {"gpus": 4, "tp": 4, "cp": 2}, {"gpus": 4, "nodes": 3, "tp": 2, "cp": 5},
    {"family": "custom", "cp": 2}, {"reshard_after_forward": "0"},
    {"reshard_after_forward": "1"},
    {"reshard_after_forward": "3"}, {"reshard_after_forward": "True"}, {"reshard_after_forward": "9" * 50},
    {"gpus": 1, "nodes": 2, "reshard_after_forward": "4"}, {"gpus": 1, "nodes": 1, "reshard_after_forward": "yes"},
    {"gpus": 1, "nodes": 3, "reshard_after_forward": "2"}, {"gpus": 6, "nodes": 5, "reshard_after_forward": "4"},
    {"project_name": "Run"}, {"project_name": "torch"}, {"project_name": "jinja2"}, {"family": "hf"},
    {"moe": True, "ep": 0}, {"moe": True, "ep": 3}, {"moe": True, "ep": 4, "gpus": 6}, {"moe": True, "ep": 99},
    {"family": "hf", "hf_model": "org/model", "ep": 8, "cp": 2}, {"family": "hf", "hf_model": "org/model", "ep": 6,
    "cp": 3, "gpus": 12},
]  # fmt: skip


@pytest.mark.parametrize("given", SUGGESTING, ids=lambda given: ",".join(f"{k}={v}"[:24] for k, v in given.items()))
def test_every_suggested_fix_is_itself_accepted(given: dict) -> None:
    """Each message's `e.g. --flag VALUE` is fed back: that answer must then be valid (wrong hints of issue 16:
    `--gpus 1 --nodes 2 --reshard-after-forward 4` suggested 1, itself refused)."""
    # The answers `new` would use: the given ones over the defaults, family questions where they apply.
    asked = {name: q.default for name, q in questions().items() if not q.when and "{{" not in str(q.default)}
    answers = {**asked, **given}
    answers |= {name: q.default for name, q in questions().items() if q.when and q.applies(answers)} | given
    problems = validate(answers)
    assert problems, given
    for message in problems.values():
        suggested = _suggestion(message)
        assert suggested, message
        flag_name, value = suggested
        question = questions()[flag_name]
        fixed = {**answers, flag_name: question.convert(value) if question.type != "str" else value}
        assert flag_name not in validate(fixed), (message, validate(fixed))


def test_natural_yaml_types_are_the_answers_they_mean(tmp_path: Path) -> None:
    """`reshard_after_forward: true` or `: 4` (YAML's bool and int) are the answers "true" and "4";
    `gpus: "4"` is 4. A whole run with `: 4` records the string copier's template expects."""
    path = tmp_path / "a.yml"
    for text, expected in (
        ("reshard_after_forward: true\n", {"reshard_after_forward": "true"}),
        ("reshard_after_forward: false\n", {"reshard_after_forward": "false"}),
        ("reshard_after_forward: 4\ngpus: '4'\ncompile: 'yes'\n",
         {"reshard_after_forward": "4", "gpus": 4, "compile": True}),
    ):  # fmt: skip
        path.write_text(text)
        assert load_answers_file(path) == expected
    path.write_text("reshard_after_forward: 4\n")
    result = fsdp2gen("new", str(tmp_path / "run"), "-y", "--answers-file", str(path), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["answers"]["reshard_after_forward"] == "4"


def test_hf_from_scratch_needs_only_a_valid_config(tmp_path: Path) -> None:
    hf_folder(weights=False)(tmp_path)
    result = fsdp2gen("new", "run", "-y", "--family", "hf", "--hf-model", "m", "--from-scratch", "--dry-run",
                      cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_copier_copy_applies_the_same_checks(tmp_path: Path) -> None:
    """`copier copy` of templates/ runs copier.yml's validators: the same bounds and names are refused, before
    anything is written. (copier prints its own traceback around the message; that format is copier's.)"""
    template = str(REPO / "templates")
    for data, dest, message in (
        (["--data", "gpus=100"], "run", "100 is more GPUs than one node has (at most 64)"),
        ([], "torch", "torch is the name of a package the project depends on"),
    ):
        result = subprocess.run([COPIER, "copy", "--defaults", *data, template, str(tmp_path / dest)],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
        assert not (tmp_path / dest).exists()


def test_a_question_reads_a_later_answer_only_where_it_is_defined() -> None:
    """copier renders a question's validator, default and condition with the answers it has so far: all of them
    when they are given (fsdp2gen new, --data), only the earlier questions' when it asks one by one or takes the
    defaults. A later question named there without an `is defined` guard breaks those copies ("'cp' is undefined":
    test_copier_update.py's copier copy --defaults)."""
    spec = yaml.safe_load((REPO / "templates" / "copier.yml").read_text())
    names = [name for name in spec if not name.startswith("_")]
    env = jinja2.Environment(extensions=["jinja2_ansible_filters.AnsibleCoreFiltersExtension"])
    unguarded = []
    for position, name in enumerate(names):
        fields = spec[name] if isinstance(spec[name], dict) else {}
        for field, text in fields.items():
            if isinstance(text, str) and "{" in text:
                read = jinja2.meta.find_undeclared_variables(env.parse(text)) & set(names[position + 1 :])
                unguarded += [(name, field, later) for later in read if f"{later} is defined" not in text]
    assert unguarded == []


def test_dependency_names_are_refused_as_project_names() -> None:
    """copier.yml's list of refused project names holds every dependency of the generated pyproject.toml."""
    pyproject = (REPO / "templates" / "project" / "pyproject.toml.jinja").read_text()
    dependencies = {name.lower() for name in re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?[<>=~!]', pyproject)}
    assert {"torch", "numpy", "transformers", "safetensors", "pytest", "tensorboard"} <= dependencies
    for name in dependencies:
        normal = re.sub(r"[-_.]+", "-", name)
        assert "is the name of a package" in validate({"project_name": normal}).get("project_name", ""), name


# case id -> the line it printed (<tmp> for its folder), as test_bad_input_obeys_the_contract saw it: the table in
# docs/ shows these lines (FSDP2GEN_UPDATE_DOCS=1 writes them there).
OBSERVED: dict[str, str] = {}
TABLE_HEAD = "| Test id | Command | Given | stderr (the one line) | Exit |\n|---|---|---|---|---|\n"


def shell_word(word: str) -> str:
    """`word` as the table shows it in a command line: quoted where a shell needs it, long ones shortened."""
    if len(word) > 40:
        return f"'{word[:12]}…({len(word)} chars)'"
    if "\n" in word:
        return "$'" + word.replace("\n", "\\n") + "'"
    return word if word and word.isascii() and shlex.quote(word) == word else f"'{word}'"


def shown_command(case: Case) -> str:
    command = "fsdp2gen " + " ".join(map(shell_word, case.argv))
    if case.stdin is CLOSED:
        return f"{command} <&-"
    if case.stdin:
        return f"printf {shell_word(case.stdin)} | {command}"
    return f"{command} < /dev/null" if "--interactive" in case.argv else command


def row_start(case: Case) -> str:
    """The table row of `case` up to its line: id, command, what the folder holds ('|' escaped for Markdown)."""
    given = "; ".join(getattr(setup, "what", setup.__name__) for setup in case.setup)
    return f"| `{case.id}` | `{markdown(shown_command(case))}` | {markdown(given)} | "


def markdown(cell: str) -> str:
    return cell.replace("|", "\\|")


def short_runs(line: str) -> str:
    """`line` with every run of one character longer than 40 shortened, as shell_word shortens long words."""
    return re.sub(r"(.)\1{40,}", lambda run: f"{run[1] * 12}…({len(run[0])} chars)", line)


def test_the_doc_is_the_table_of_cases() -> None:
    """docs/bad-inputs-generator.md has one row per case, in order, each made from the case: its command, what the
    folder holds, and the line it prints (for a regex case, a line its pattern matches). With
    FSDP2GEN_UPDATE_DOCS=1, in a run of the whole file (every case records its line), the table and its count
    are written from the cases."""
    text = DOC.read_text()
    head, _, rest = text.partition(TABLE_HEAD)
    rows, _, tail = rest.partition("\n\n")
    if os.environ.get("FSDP2GEN_UPDATE_DOCS") == "1":
        assert len(OBSERVED) == len(CASES), "run the whole file, so that every case records its line"
        table = "\n".join(f"{row_start(case)}{markdown(short_runs(OBSERVED[case.id]))} | 2 |" for case in CASES)
        head = re.sub(r"\d+ cases\.", f"{len(CASES)} cases.", head)
        DOC.write_text(f"{head}{TABLE_HEAD}{table}\n" + (f"\n{tail}" if tail else ""))
        SUMMARY.write_text(re.sub(r"\d+ cases, each", f"{len(CASES)} cases, each", SUMMARY.read_text()))
        return
    assert f"{len(CASES)} cases." in head and f"{len(CASES)} cases, each with its one line" in SUMMARY.read_text()
    lines = rows.splitlines()
    assert [re.match(r"\| `([^`]+)`", line)[1] for line in lines] == [case.id for case in CASES]
    for case, row in zip(CASES, lines, strict=True):
        assert row.startswith(row_start(case)) and row.endswith(" | 2 |"), (row_start(case), row)
        line = row[len(row_start(case)) : -len(" | 2 |")].replace("\\|", "|")
        if case.regex:
            assert re.fullmatch("fsdp2gen: error: " + case.message, line), (case.id, line)
        else:
            assert line == short_runs("fsdp2gen: error: " + case.message.replace("{d}", "<tmp>")), case.id
