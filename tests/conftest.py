from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fsdp2gen.cli import app

# One compute thread per process, for this pytest worker (set before any test module imports torch) and every process
# it starts. The suite runs 3 workers on 2 cores: a process with 2 intra-op threads spins its second thread waiting for
# a core another process holds (a 1-process 10-step run of the default 1-GPU llama project under load: 65-75 CPU-s with
# 2 threads, 30-31 with 1; the suite's tiny models lose less). torchrun sets it only for --nproc-per-node > 1. The
# numbers a test compares are computed under the same setting on both sides.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
HELPERS = REPO / "tests" / "helpers"  # probes and reference loops, run by path inside generated projects

# pytest-xdist (addopts: --dist loadfile --no-loadscope-reorder) hands whole files to the 3 workers in collection
# order. The files that take minutes go first, longest first, so that none of them is left running alone at the end
# while the other worker idles (xdist's own reordering puts files with many tests first, which left these last).
SLOW_FILES_FIRST = (
    "test_training_runs.py", "test_pipeline_parallel.py", "test_hf.py", "test_benchmarks.py",
    "test_plan_simulation.py", "test_real_data.py", "test_expert_parallel.py", "test_hf_moe.py", "test_moe.py",
    "test_hf_parallel.py",
    "test_option_numerics.py", "test_document_masking.py", "test_launchers.py", "test_float8.py",
    "test_context_parallel.py", "test_custom.py", "test_run_ownership.py", "test_plan.py", "test_plan_families.py",
    "test_resume_contract.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: rank for rank, name in enumerate(SLOW_FILES_FIRST)}
    # A stable sort: each file's tests stay together and in their order; the other files follow, as collected.
    items.sort(key=lambda item: order.get(item.path.name, len(order)))


def pytest_collection_finish(session: pytest.Session) -> None:
    # The test modules, torch and the libraries they import live until the worker exits: keep them out of the
    # garbage collector's full passes (each walks every object; with torch loaded that is a large share of the
    # CPU of the in-process tests). Objects the tests make are collected as usual.
    gc.freeze()


def fsdp2gen(*args: str, cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (`python -m fsdp2gen`), stdin not a terminal."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp2gen", *args],
        cwd=cwd,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=120,
    )


def invoke(*args: str, input: str | None = None):
    """Run the CLI in-process (typer's CliRunner), for prompts answered through `input`."""
    return CliRunner().invoke(app, list(args), input=input)


def generate(dest: Path, *options: str) -> Path:
    result = fsdp2gen("new", str(dest), "--yes", *options)
    assert result.returncode == 0, result.stderr
    return dest


@contextmanager
def project_modules(project: Path) -> Iterator[None]:
    """Import a generated project's modules in this process (its folder first on sys.path), and forget them
    afterwards, sys.path too (a project script may add its folder itself): the other files on this xdist worker
    import other projects' modules under the same names (config, model_args, ...), set aside meanwhile."""
    others = {path.stem: sys.modules.pop(path.stem) for path in project.glob("*.py") if path.stem in sys.modules}
    before, search_path = set(sys.modules), list(sys.path)
    sys.path.insert(0, str(project))
    try:
        yield
    finally:
        sys.path[:] = search_path
        for name in set(sys.modules) - before:
            if str(project) in (getattr(sys.modules[name], "__file__", None) or ""):
                del sys.modules[name]
        sys.modules.update(others)


def tree(root: Path) -> dict[str, bytes]:
    """Relative path -> content, for every file under `root`."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# A model that trains in a second per step on 2 CPU ranks, for the tests that run generated projects.
TINY = [
    "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.max_seq_len", "64",
    "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
    "--training.lr", "1e-2", "--job.log_every", "1",
]  # fmt: skip


def save_tiny_llama(
    folder: Path,
    text: str,
    special_tokens: tuple[str, ...] = ("<|endoftext|>",),
    chat_template: str | None = None,
    dtype: str | None = None,
    **shape: int,
) -> Path:
    """A pretrained-model folder as save_pretrained writes it: a 2-layer Llama (hidden 64, vocabulary 320; `shape`:
    other LlamaConfig sizes) with random weights (seed 0; saved in `dtype`, e.g. "float16", default fp32), and a
    byte-level BPE tokenizer of 300 tokens trained on `text`, eos <|endoftext|>."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=300, min_frequency=1, special_tokens=list(special_tokens))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=320, max_position_embeddings=64)  # fmt: skip
    config = LlamaConfig(**(sizes | shape))
    model = AutoModelForCausalLM.from_config(config, **({"dtype": getattr(torch, dtype)} if dtype else {}))
    model.save_pretrained(folder)
    return folder


def save_tiny_models(root: Path, configs: dict) -> dict[str, Path]:
    """{name: folder}: each transformers config of `configs` ({name: config}) as a pretrained-model folder root/name,
    as save_pretrained writes it (no tokenizer), with the random weights of from_config after seed 0."""
    import torch
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folders[name])
    return folders


def metrics(output_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The records of `output_dir/metrics.jsonl` (one per step), or of another file of rows: `name`."""
    return [json.loads(line) for line in (output_dir / name).read_text().splitlines()]


def torchrun_env() -> dict[str, str]:
    # One thread per rank: 2 ranks on 2 cores; more threads only add contention.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def preflight_cases(project: Path, cases: dict[str, list[str]], folder: Path, pythonpath: str = "") -> dict[str, list]:
    """{case: [exit code, stdout, stderr]} of `python preflight.py ARGS` for each case's ARGS, all run in one process
    by tests/helpers/preflight_driver.py (torch imported once, not per case); PYTHONPATH the project's unless given."""
    (folder / "cases.json").write_text(json.dumps(cases))
    driver = subprocess.run(
        [sys.executable, str(HELPERS / "preflight_driver.py"), str(folder / "cases.json")],
        cwd=project, env={**torchrun_env(), "PYTHONPATH": pythonpath or str(project)}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    return json.loads(driver.stdout)


def torchrun(
    project: Path, *args: str, nproc: int = 2, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `args` (a script and its options) under torchrun, `nproc` gloo ranks, in `project`; fail the test
    with the output's tail unless it succeeds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    # PYTHONPATH: scripts outside the project's root (tests/, this repository's probes) import its modules.
    env = {**torchrun_env(), "PYTHONPATH": str(project), **(env or {})}
    result = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One generated project per precision, shared by the tests that only read or run them."""
    root = tmp_path_factory.mktemp("projects")
    return {p: generate(root / f"run-{p}", "--gpus", "2", "--precision", p) for p in ("fp32", "bf16", "fp16")}


@pytest.fixture(scope="session")
def checkpoint_projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One generated project per checkpoint style other than dcp (which `projects` covers), in mixed precision."""
    root = tmp_path_factory.mktemp("checkpoint-projects")
    styles = {"dcp-async": "bf16", "full": "fp16"}
    return {
        style: generate(root / f"run-{style}", "--gpus", "2", "--precision", precision, "--checkpoint", style)
        for style, precision in styles.items()
    }


def run_own_tests(project: Path, *paths: str, nproc: int | None = None) -> str:
    """Run a generated project's own pytest suite (or `paths` of it), on `nproc` ranks (its tests' default: 2 on
    CPU); fail with its output unless it passes."""
    env = {**torchrun_env(), **({"NPROC": str(nproc)} if nproc else {})}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths],
                            cwd=project, env=env, capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout
