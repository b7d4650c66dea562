"""`fsdp2gen check`: every rule on a corpus of bad and good scripts, real mistakes planted in a generated
train.py, generated projects clean, output formats and exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2gen.check import RULES, CheckInputError, check_source
from tests.conftest import REPO, fsdp2gen, invoke

CORPUS = Path(__file__).resolve().parent / "check_corpus"
CORPUS_SCRIPTS = sorted(CORPUS.glob("*.py"))
EXPECT = re.compile(r"#\s*expect:\s*(FSDP\d{3})")


def expected(script: Path) -> list[tuple[int, str]]:
    """(line, code) of every `# expect: FSDPxxx` comment in `script`."""
    lines = script.read_text().splitlines()
    return [(number, match.group(1)) for number, line in enumerate(lines, 1) for match in EXPECT.finditer(line)]


def found(source: str, path: str = "train.py") -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in check_source(source, path)]


@pytest.mark.parametrize("script", CORPUS_SCRIPTS, ids=lambda p: p.name)
def test_corpus_script_gives_exactly_the_expected_findings(script: Path) -> None:
    assert found(script.read_text(), str(script)) == expected(script)


def test_every_rule_has_bad_scripts_that_trip_it_and_good_scripts_that_do_not() -> None:
    for code in RULES:
        prefix = code.lower()
        bad = [p for p in CORPUS_SCRIPTS if p.name.startswith(f"{prefix}_bad")]
        good = [p for p in CORPUS_SCRIPTS if p.name.startswith(f"{prefix}_good")]
        assert bad and good, code
        assert all(any(c == code for _, c in expected(p)) for p in bad), code
        assert all(expected(p) == [] for p in good), code
    # One registration per rule: each code has its own check function.
    assert len({rule.check for rule in RULES.values()}) == len(RULES)
    # Aliased imports are part of the corpus: `fully_shard as fs`, `torch as th`, `MixedPrecisionPolicy as MP`.
    corpus_text = "\n".join(p.read_text() for p in CORPUS_SCRIPTS)
    for alias in (
        "fully_shard as fs",
        "import torch as th",
        "MixedPrecisionPolicy as MP",
        "import torch.distributed as dist",
    ):
        assert alias in corpus_text


def test_generated_examples_pass_clean() -> None:
    """The template is correct by design: a finding on a golden project means the rule is wrong."""
    examples = sorted(p for p in (REPO / "generated_examples").iterdir() if p.is_dir())
    assert len(examples) >= 3
    for example in examples:
        result = fsdp2gen("check", str(example))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", ""), example


def test_freshly_generated_projects_of_every_precision_pass_clean(projects: dict[str, Path]) -> None:
    result = invoke("check", *(str(project) for project in projects.values()))
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", ""), result.stdout


def _plant(source: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def _line_of(source: str, text: str) -> int:
    return source[: source.index(text)].count("\n") + 1


TO_EMPTY = "    model.to_empty(device=device)\n"
DEVICE_ID = 'device_id=device if device.type == "cuda" else None'
BARRIER = "    dist.barrier()\n    dist.destroy_process_group()"
FLOAT8_CALL = "        convert_blocks_to_float8([block for _, block in blocks], device)\n"
ROOT_SHARD = "    fully_shard(model, **root_options)\n"
# Each mistake, planted in the generated train.py as (old, new) edits, is reported once, on the line holding `at`.
PLANTED: dict[str, tuple[list[tuple[str, str]], str]] = {
    # train_step's loss (evaluate's, indented deeper, stays right) computed by calling forward directly.
    "FSDP003": (
        [
            (
                '\n        loss = model_loss(model, *batch, reduction="sum", chunks=chunks) * scale',
                "\n        loss = model.forward(batch.inputs, batch.targets)",
            )
        ],
        "model.forward(batch.inputs",
    ),
    "FSDP004": ([(TO_EMPTY, TO_EMPTY + "    torch.save(model.state_dict(), 'm.pt')\n")], "torch.save("),
    "FSDP005": (
        # The call's arguments stay: any no_sync call is the mistake.
        [("model.set_requires_gradient_sync(", "model.no_sync(")],
        "model.no_sync(",
    ),
    "FSDP006": ([("    initialize(model, config, device)\n", "")], TO_EMPTY),
    "FSDP007": (
        [("        torch.cuda.set_device(device)\n", ""), (DEVICE_ID, "timeout=None")],
        "dist.init_process_group(",
    ),
    "FSDP008": ([(TO_EMPTY, TO_EMPTY + "    model.load_state_dict(torch.load('m.pt'))\n")], "torch.load("),
    "FSDP009": (
        [("reduce_dtype=getattr(torch, parallel.reduce_dtype))", "reduce_dtype=torch.bfloat16)")],
        "MixedPrecisionPolicy(",
    ),
    "FSDP010": ([(BARRIER, "    dist.destroy_process_group()")], "dist.destroy_process_group()"),
    "FSDP011": (
        # Moved into shard_model, after the root's fully_shard.
        [(FLOAT8_CALL, "        pass\n"), (ROOT_SHARD, ROOT_SHARD + "    convert_blocks_to_float8(blocks, device)\n")],
        "convert_blocks_to_float8(blocks",
    ),
}


@pytest.mark.parametrize("code", sorted(PLANTED))
def test_mistakes_planted_in_a_generated_train_py_are_found(code: str) -> None:
    source = (
        (REPO / "generated_examples" / "llama-8gpu-bf16-float8-compile-selectiveac-prefetch-tensorboard-wandb")
        .joinpath("train.py")
        .read_text()
    )
    assert found(source) == []
    replacements, at = PLANTED[code]
    planted = _plant(source, *replacements)
    assert found(planted) == [(_line_of(planted, at), code)]


def test_optimizer_before_sharding_and_root_first_in_a_generated_train_py() -> None:
    source = (REPO / "generated_examples" / "llama-1gpu-fp32" / "train.py").read_text()
    # An optimizer above the sharding, and the root sharded before its blocks.
    early = "    early = torch.optim.AdamW(model.parameters())\n    fully_shard(model)\n"
    loop = "    for block in blocks:\n        fully_shard("
    planted = _plant(source, (loop, early + loop))
    line = _line_of(planted, early)
    assert found(planted) == [(line, "FSDP001"), (line + 1, "FSDP002")]


HELPERS = """import torch
from torch.distributed.fsdp import fully_shard

def build_optimizer(model):
    return torch.optim.AdamW(model.parameters())

def shard_model(model):
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)

def main():
    model = torch.nn.Transformer()
{body}
"""
NAMED_DTYPE = """import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
{assign}
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=low)
"""
TEARDOWN = """import torch.distributed as dist

def main():
    rank = dist.get_rank()
{body}
    dist.destroy_process_group()
"""
# Issue 16's known misses, each with its correct twin: (source, [(line, code)] expected).
MISSES: dict[str, tuple[str, list[tuple[int, str]]]] = {
    "optimizer-helper-before-shard-helper": (
        HELPERS.format(body="    optimizer = build_optimizer(model)\n    shard_model(model)"),
        [(14, "FSDP001")],
    ),
    "shard-helper-before-optimizer-helper": (
        HELPERS.format(body="    shard_model(model)\n    optimizer = build_optimizer(model)"),
        [],
    ),
    "bf16-bound-to-a-name": (NAMED_DTYPE.format(assign="low = torch.bfloat16"), [(4, "FSDP009")]),
    "bf16-bound-to-a-name-in-a-function": (
        "import torch\nfrom torch.distributed.fsdp import MixedPrecisionPolicy as MP\n\ndef policy():\n"
        "    low = getattr(torch, 'bfloat16')\n    return MP(param_dtype=low, reduce_dtype=low)\n",
        [(6, "FSDP009")],
    ),
    "fp32-bound-to-a-name": (NAMED_DTYPE.format(assign="low = torch.float32"), []),
    "barrier-only-on-rank-0": (TEARDOWN.format(body="    if rank == 0:\n        dist.barrier()"), [(7, "FSDP010")]),
    "barrier-only-on-get-rank-0": (
        TEARDOWN.format(body="    if dist.get_rank() == 0:\n        dist.barrier()"),
        [(7, "FSDP010")],
    ),
    "barrier-when-world-size-above-1": (
        TEARDOWN.format(body="    if dist.get_world_size() > 1:\n        dist.barrier()"),
        [],
    ),
    "barrier-on-every-rank": (TEARDOWN.format(body="    dist.barrier()"), []),
}


@pytest.mark.parametrize("case", sorted(MISSES))
def test_issue_16_misses_are_found_and_their_correct_twins_are_clean(case: str) -> None:
    source, want = MISSES[case]
    assert found(source) == want


def test_text_output_is_one_ruff_style_line_per_finding_and_exit_1() -> None:
    result = fsdp2gen("check", str(CORPUS))
    assert result.returncode == 1 and result.stderr == ""
    *lines, summary = result.stdout.splitlines()
    want = [(str(p), line, code) for p in CORPUS_SCRIPTS for line, code in expected(p)]
    pattern = re.compile(
        r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>FSDP\d{3}) (?P<message>.+); fix: (?P<fix>.+)$"
    )
    parsed = [pattern.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m["path"], int(m["line"]), m["code"]) for m in parsed] == want
    assert all(m["fix"] == RULES[m["code"]].fix for m in parsed)
    assert summary == f"Found {len(want)} problems in {len({p for p, _, _ in want})} files."


def test_json_output_lists_findings_with_every_field() -> None:
    script = CORPUS / "fsdp008_bad.py"
    result = invoke("check", "--format", "json", str(script))
    assert result.exit_code == 1
    findings = json.loads(result.stdout)
    assert [(f["line"], f["code"]) for f in findings] == expected(script)
    first = findings[0]
    assert first == {
        "path": str(script),
        "line": 7,
        "col": 9,
        "code": "FSDP008",
        "message": "torch.load without weights_only=True can run arbitrary pickled code",
        "fix": "pass weights_only=True",
    }
    clean = invoke("check", "--format", "json", str(CORPUS / "fsdp008_good.py"))
    assert (clean.exit_code, json.loads(clean.stdout)) == (0, [])


def test_folders_are_searched_for_python_files_skipping_hidden_ones(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("import torch\ntorch.load('x.pt')\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text("import torch\ntorch.load('x.pt')\n")
    (tmp_path / "notes.txt").write_text("torch.load('x.pt')\n")
    result = invoke("check", "--format", "json", str(tmp_path))
    assert [(f["path"], f["line"], f["code"]) for f in json.loads(result.stdout)] == [
        (str(tmp_path / "pkg" / "train.py"), 2, "FSDP008")
    ]


def test_syntax_error_is_bad_input_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("import torch\ntorch.load('x.pt')\n")
    broken = tmp_path / "train.py"
    broken.write_text("import torch\n\ndef main(:\n    pass\n")
    result = invoke("check", str(tmp_path))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == f"fsdp2gen: error: {broken}:3: invalid syntax; fix the file or exclude it\n"


@pytest.mark.parametrize(
    "content,reason",
    [(b"\xff\xfe\x00x", "not UTF-8 text"), (None, "no such file or folder; pass Python files or folders")],
)
def test_unreadable_input_is_bad_input(tmp_path: Path, content: bytes | None, reason: str) -> None:
    target = tmp_path / "train.py"
    if content is not None:
        target.write_bytes(content)
    result = invoke("check", str(target))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"fsdp2gen: error: {target}: ") and reason in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_utf8_byte_order_mark_is_valid_python(tmp_path: Path) -> None:
    """Python runs a file that starts with a UTF-8 BOM (some Windows editors write one); check reads it too, and
    its findings keep their line numbers."""
    target = tmp_path / "train.py"
    target.write_bytes(b"\xef\xbb\xbfimport torch\nstate = torch.load('x.pt')\n")
    assert (
        subprocess.run([sys.executable, "-c", f"compile(open({str(target)!r}, 'rb').read(), 'f', 'exec')"]).returncode
        == 0
    )
    result = fsdp2gen("check", str(target))
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith(f"{target}:2:"), result.stdout


@pytest.mark.parametrize(
    "expression,limit",
    [(" + ".join(["1"] * 100_000), "recursion"), ("-" * 100_000 + "1", "parser stack")],
    ids=["100k-term-sum", "100k-unary-minus"],
)
def test_too_deeply_nested_code_is_one_line_of_bad_input(tmp_path: Path, expression: str, limit: str) -> None:
    target = tmp_path / "train.py"
    target.write_text(f"import torch\nx = {expression}\n")
    message = f"{target}: code nested too deeply to analyse (Python's {limit} limit); fix the file or exclude it"
    with pytest.raises(CheckInputError) as raised:
        check_source(target.read_text(), str(target))
    assert str(raised.value) == message
    result = invoke("check", str(target))
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}\n")


def test_unknown_format_is_bad_input() -> None:
    result = invoke("check", "--format", "xml", str(CORPUS))
    assert (result.exit_code, result.stderr) == (2, "fsdp2gen: error: --format xml: choose text or json\n")


def test_noqa_only_silences_the_codes_it_names() -> None:
    source = "import torch\nstate = torch.load('a.pt')  # fsdp2gen: noqa FSDP001\n"
    assert found(source) == [(2, "FSDP008")]
    assert found(source.replace("FSDP001", "FSDP008")) == []
    assert found(source.replace(" FSDP001", "")) == []
    # A string that looks like the comment is not a comment.
    assert found("import torch\nstate = torch.load('# fsdp2gen: noqa FSDP008')\n") == [(2, "FSDP008")]


def test_the_checker_and_planner_never_import_torch_and_load_lazily() -> None:
    code = (
        "import sys, fsdp2gen.cli\n"
        "lazy = [m for m in ('fsdp2gen.check', 'fsdp2gen.plan') if m in sys.modules]\n"
        "import fsdp2gen.check, fsdp2gen.plan\n"
        "print(lazy, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "[] False\n"


def test_readme_documents_every_rule() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## fsdp2gen check") :]
    for code, rule in RULES.items():
        assert f"| {code} | {rule.catches} | {rule.fix} |" in section, code
    assert "# fsdp2gen: noqa FSDP" in section


def test_a_generated_pp_project_passes_clean_and_pp_mistakes_planted_in_its_pipeline_py_are_found(
    tmp_path: Path,
) -> None:
    from tests.conftest import generate

    project = generate(tmp_path / "pp", "--gpus", "4", "--pp", "2")
    result = fsdp2gen("check", str(project))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    source = (project / "pipeline.py").read_text()
    assert found(source) == []
    cut = "        first = sum(layers[:index])\n"
    mistakes = {
        # An optimizer over the whole meta model, built before the other stages' blocks are deleted from it.
        "FSDP012": ("        optimizer = torch.optim.AdamW(stage.parameters())\n", "optimizer = "),
        # The stage handed to the pipeline before the cut.
        "FSDP013": ("        early = PipelineStage(stage, index, n_stages, device)\n", "early = "),
    }
    for code, (line, at) in mistakes.items():
        planted = _plant(source, (cut, line + cut))
        # (An optimizer in this file also makes it train the meta model it builds, which FSDP006 reports: this
        # file has no to_empty, train.py's parallelize does it.)
        assert [f for f in found(planted) if f[1] != "FSDP006"] == [(_line_of(planted, at), code)], code
    # The stage's blocks renumbered from 0 in a new list instead of deleted by name.
    renumber = "        stage.layers = nn.ModuleList(list(stage.layers.values())[first : first + layers[index]])\n"
    planted = _plant(source, ("        if index > 0:\n", renumber + "        if index > 0:\n"))
    assert found(planted) == [(_line_of(planted, renumber), "FSDP014")]
