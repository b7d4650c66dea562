"""Pipeline parallelism (`fsdp2gen new --pp N`, llama): the blocks split into stages on pp groups of ranks,
micro-batches flowing through them under torch.distributed.pipelining's schedules (pipeline.py).

Real torchrun, gloo, fp32, a tiny 4-block llama, a project rendered by the CLI; every run is compared with one
process (no mesh, no pipeline): losses, gradient norms, validation losses and the final weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp2gen.plan_layout import layout_module
from tests.conftest import generate, metrics, preflight_cases, torchrun_env
from tests.helpers.scripts import captured_in_this_process, run_in_this_process
from tests.helpers.several_runs import assert_resumed_bit_for_bit, launch_several
from tests.test_launchers import launch_two_nodes

# 4 blocks (2 stages of 2, or 4 stages of 1 for Interleaved1F1B), 4 steps of 4 micro-batches per pipeline (1 sample
# each: 8 samples over 2 data ranks), validation and checkpoints after steps 2 and 4. lr 1e-3 as in the expert-
# parallel tests: at 1e-2 Adam turns the fp32 rounding of any sharded run into weight differences above 1e-5.
RUN = [
    "--job.device", "cpu", "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4",
    "--model.n_kv_heads", "2", "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.max_seq_len", "64",
    "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.grad_accum_steps", "4",
    "--training.warmup_steps", "2", "--training.lr", "1e-3", "--training.loss_chunks", "1", "--job.log_every", "1",
    "--training.steps", "4", "--eval.every", "2", "--eval.batches", "1", "--checkpoint.interval", "2",
    "--checkpoint.keep_last", "2",
]  # fmt: skip
TOLERANCE = 1e-5
SCHEDULES = {
    "1F1B": ["--parallel.pp_schedule", "1F1B"],
    "GPipe": ["--parallel.pp_schedule", "GPipe"],
    # 2 stages per rank: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3.
    "Interleaved1F1B": ["--parallel.pp_schedule", "Interleaved1F1B", "--parallel.pp_stages_per_rank", "2"],
}
# Each schedule's run carries one more option of the project it runs in, so that one launch proves both: GPipe
# writes its checkpoints in the background (dcp-async; test_dcp_async_checkpoints_of_pp2_resume_... resumes them),
# Interleaved1F1B recomputes its stages' blocks under op-level selective activation checkpointing (full
# checkpointing runs under DualPipeV below). 1F1B runs the plain project. GPipe and Interleaved1F1B run in one
# project rendered with both options and with CPU offload and prefetch (options_project), in one launch (OPTIONS_RUNS,
# with DualPipeV's run and the uneven stages' run below): GPipe with activation checkpointing off (SCHEDULE_ARGS),
# Interleaved1F1B with its checkpoints written in the background too; both without offload and prefetch.
SCHEDULE_OPTIONS = {
    "1F1B": [],
    "GPipe": ["--checkpoint", "dcp-async"],
    "Interleaved1F1B": ["--activation-checkpointing", "selective"],
}
# CPU offload and prefetch off (options_project's config.toml has them on: the uneven stages' run uses them).
NO_OFFLOAD = ["--parallel.cpu_offload", "false", "--parallel.prefetch_blocks", "0"]
SCHEDULE_ARGS = {"GPipe": ["--parallel.activation_checkpointing", "none", *NO_OFFLOAD], "Interleaved1F1B": NO_OFFLOAD}


def train(project: Path, output_dir: Path, *args: str, nproc: int) -> subprocess.CompletedProcess:
    """train.py on `nproc` gloo ranks under torchrun (1: a plain process)."""
    command = [sys.executable, "train.py", *RUN, "--job.output_dir", str(output_dir), *args]
    if nproc > 1:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    return subprocess.run(command, cwd=project, env={**torchrun_env(), "PYTHONPATH": str(project)},
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def numbers(output_dir: Path) -> dict[int, dict[str, float]]:
    """step -> loss, grad_norm (and val_loss where validated), over the rows of each step."""
    rows: dict[int, dict[str, float]] = {}
    for row in metrics(output_dir):
        rows.setdefault(row["step"], {}).update({k: row[k] for k in ("loss", "grad_norm", "val_loss") if k in row})
    return rows


def weights(output_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The model's weights in the DCP checkpoint of `step`, as full tensors in this process."""
    dcp_to_torch_save(output_dir / "checkpoints" / f"step-{step}", output_dir / f"step-{step}.pt")
    return torch.load(output_dir / f"step-{step}.pt")["train"]["model"]


def differences(got: Path, expected: Path, steps: list[int]) -> dict[str, float]:
    """The largest |difference| of each logged number over `steps`, and of the final weights."""
    mine, theirs = numbers(got), numbers(expected)
    diffs: dict[str, float] = {}
    for step in steps:
        assert mine[step].keys() == theirs[step].keys(), step
        for key, value in theirs[step].items():
            diffs[key] = max(diffs.get(key, 0.0), abs(mine[step][key] - value))
    final = max(steps)
    mine_weights, their_weights = weights(got, final), weights(expected, final)
    assert mine_weights.keys() == their_weights.keys()  # every block, the embedding, norm and output: global names
    diffs["weights"] = max((mine_weights[name] - their_weights[name]).abs().max().item() for name in their_weights)
    return diffs


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("pp") / "pp2", "--gpus", "4", "--pp", "2", "--precision", "fp32")


@pytest.fixture(scope="module")
def options_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pp project with background-saved checkpoints (--checkpoint dcp-async), op-level selective activation
    checkpointing (--activation-checkpointing selective, config.toml's default; GPipe's runs turn it off, DualPipeV's
    runs full checkpointing, the same module's other mode), CPU offload and prefetch (--cpu-offload --prefetch: on in
    config.toml, off in every run but the uneven stages')."""
    return generate(tmp_path_factory.mktemp("pp-options") / "pp2", "--gpus", "4", "--pp", "2", "--fp32",
                    *SCHEDULE_OPTIONS["GPipe"], *SCHEDULE_OPTIONS["Interleaved1F1B"], "--cpu-offload",
                    "--prefetch")  # fmt: skip


@pytest.fixture(scope="module")
def one_process(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run in one process, the whole model, no pipeline (the reference)."""
    output_dir = tmp_path_factory.mktemp("one-process")
    ran(train(project, output_dir, nproc=1))
    return output_dir


@pytest.fixture(scope="module")
def bf16_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pp project in bf16 mixed precision (test_bf16_pp2_x_dp_shard2_equals_bf16_dp_shard2_...)."""
    return generate(tmp_path_factory.mktemp("pp-bf16") / "bf16", "--gpus", "4", "--pp", "2", "--bf16")


# The runs on 4 ranks of the plain pp project, of bf16_project and of options_project (OPTIONS_RUNS, below), made
# in ONE torchrun launch (four_ranks; tests/helpers/several_runs.py: torch imported and the process group joined once,
# then each run's project's train.train(), each with its own config, mesh, seed and output folder): 1F1B and the two
# zero-bubble schedules the plain project runs (pp 2 x dp_shard 2), the resume of one process's step-2 checkpoint
# with pp 2 x dp_replicate 2, bf16_project's pp 2 x dp_shard 2, and last 1F1B's run again with rank 3 SIGKILLed in
# the middle of step 4 (after its forward and backward, before the optimizer step), which torchrun restarts (the
# launch's --max-restarts 1: the restart runs only the killed run, from its step-2 checkpoint). A launch of 4 ranks
# costs ~14 CPU-s before it trains; each of these runs ~2.
PROJECT_RUNS = {
    "1F1B": SCHEDULES["1F1B"],
    "InterleavedZeroBubble": ["--parallel.pp_schedule", "InterleavedZeroBubble", "--parallel.pp_stages_per_rank", "2"],
    "ZBVZeroBubble": ["--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_stages_per_rank", "2"],
    "hsdp-resume": ["--parallel.dp_replicate", "2"],
    "bf16": [],
    "killed": SCHEDULES["1F1B"],
}
# Rank 3 (the last stage, data rank 1) dies in step 4; step 3, logged by the first attempt, is done again.
KILL = {"rank": 3, "step": 4}


# The runs on 2 ranks, in ONE torchrun launch as PROJECT_RUNS are, each in its own project: bf16_project's pp 1 x
# dp_shard 2 (the bf16 test's reference), the pp 2 x dp_shard 1 run of a copy of the pp project whose grad norm is
# not summed over the stages (test_the_grad_norm_summed_...: mutated_project), and the resume with pp 1 of GPipe's
# dcp-async checkpoints (test_dcp_async_checkpoints_...: options_project, from a copy of GPipe's run in OPTIONS_RUNS'
# launch without its step-4 checkpoint).
@pytest.fixture(scope="module")
def mutated_project(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pp project without the all-reduce that sums the squared gradient norms over the pp group: each stage
    clips by its own norm, and rank 0 logs stage 0's."""
    mutated = tmp_path_factory.mktemp("pp-mutated") / "mutated"
    shutil.copytree(project, mutated)
    source = (mutated / "train.py").read_text()
    line = "        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=pp_group)\n"
    assert source.count(line) == 1
    (mutated / "train.py").write_text(source.replace(line, ""))
    return mutated


@pytest.fixture(scope="module")
def two_rank_runs(
    bf16_project: Path,
    mutated_project: Path,
    options_project: Path,
    options_runs: Callable[[], tuple[dict[str, Path], str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Path], str]:
    """The launch of 2 ranks above: run -> output folder, and the launch's stdout."""
    root = tmp_path_factory.mktemp("pp-two-ranks")
    folders = {name: root / name for name in ("bf16-pp1", "mutated", "dcp-async-pp1")}
    gpipe = options_runs()[0]["GPipe"]
    runs = [
        {"args": [*RUN, "--job.output_dir", str(folders["bf16-pp1"]), "--parallel.pp", "1"]},
        # pp 2 on 2 ranks (dp_shard 1) is enough: the norm is summed over the pp group whatever the shard group.
        {"args": [*RUN, "--job.output_dir", str(folders["mutated"]), "--training.steps", "2"],
         "project": str(mutated_project)},
        {"args": [*RUN, "--job.output_dir", str(folders["dcp-async-pp1"]), "--parallel.pp", "1",
                  *SCHEDULE_ARGS["GPipe"]],
         "project": str(options_project),
         "interrupted": {"from": str(gpipe), "remove": ["checkpoints/step-4"]}},
    ]  # fmt: skip
    result = launch_several(bf16_project, runs, root / "runs.json", nproc=2)
    return folders, result.stdout


# The runs of options_project on 4 ranks (pp 2 x dp_shard 2), made in PROJECT_RUNS' launch (four_ranks):
# GPipe's and Interleaved1F1B's (SCHEDULE_ARGS), DualPipeV's under full activation checkpointing
# (test_zero_bubble_schedules_...), and the uneven stages with CPU offload and prefetch (test_uneven_stages_...).
OPTIONS_RUNS = {
    **{name: [*SCHEDULES[name], *SCHEDULE_ARGS[name]] for name in SCHEDULE_ARGS},
    "DualPipeV": ["--parallel.pp_schedule", "DualPipeV", "--parallel.pp_stages_per_rank", "2",
                  "--parallel.activation_checkpointing", "full", *NO_OFFLOAD],
    "uneven": ["--parallel.pp_layers", "1,3", "--parallel.activation_checkpointing", "none", "--parallel.cpu_offload",
               "true", "--parallel.prefetch_blocks", "1"],
}  # fmt: skip


@pytest.fixture(scope="module")
def four_ranks(
    project: Path,
    options_project: Path,
    bf16_project: Path,
    one_process: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[], tuple[dict[str, Path], str]]:
    """PROJECT_RUNS' and OPTIONS_RUNS' runs, in ONE launch of 4 ranks (each run its project's: "project"), made once
    by the first test that asks for one of them: run -> output folder, and the launch's stdout. The hsdp-resume run
    starts from a copy of one process's run without its step-4 checkpoint; the killed run comes last (the restart
    runs it alone)."""
    made: list[tuple[dict[str, Path], str]] = []

    def runs() -> tuple[dict[str, Path], str]:
        if not made:
            root = tmp_path_factory.mktemp("pp-four-ranks")
            folders = {name: root / name for name in [*PROJECT_RUNS, *OPTIONS_RUNS]}
            shutil.copytree(one_process, folders["hsdp-resume"])
            shutil.rmtree(folders["hsdp-resume"] / "checkpoints" / "step-4")
            projects = {"bf16": bf16_project, **dict.fromkeys(OPTIONS_RUNS, options_project)}
            order = [*list(PROJECT_RUNS)[:-1], *OPTIONS_RUNS, "killed"]
            assert list(PROJECT_RUNS)[-1] == "killed"
            argv = []
            for name in order:
                args = {**PROJECT_RUNS, **OPTIONS_RUNS}[name]
                argv.append({"args": [*RUN, "--job.output_dir", str(folders[name]), *args],
                             "project": str(projects.get(name, project))})  # fmt: skip
            argv[-1]["kill"] = KILL
            result = launch_several(project, argv, root / "runs.json", nproc=4, restarts=1)
            made.append((folders, result.stdout))
        return made[0]

    return runs


@pytest.fixture(scope="module")
def project_runs(four_ranks: Callable[[], tuple[dict[str, Path], str]]) -> Callable[[], tuple[dict[str, Path], str]]:
    """PROJECT_RUNS' runs (in four_ranks' launch)."""
    return four_ranks


@pytest.fixture(scope="module")
def options_runs(four_ranks: Callable[[], tuple[dict[str, Path], str]]) -> Callable[[], tuple[dict[str, Path], str]]:
    """OPTIONS_RUNS' runs (in four_ranks' launch)."""
    return four_ranks


@pytest.fixture(scope="module")
def schedule_runs(
    project_runs: Callable[[], tuple[dict[str, Path], str]], options_runs: Callable[[], tuple[dict[str, Path], str]]
) -> Callable[[str], Path]:
    """pp 2 x dp_shard 2 on 4 ranks under a schedule of SCHEDULES, in the project of SCHEDULE_OPTIONS: ranks 0-1
    hold the first stage(s), ranks 2-3 the last, each FSDP-sharded. Each launch is made once, by the first test
    that asks for one of its runs, and its output folders shared (a fixture parametrized by schedule would be torn
    down and run again for each test that names its schedule out of order): 1F1B's in PROJECT_RUNS, GPipe's and
    Interleaved1F1B's in OPTIONS_RUNS, all in four_ranks' launch (tests/helpers/several_runs.py)."""

    def run(schedule: str) -> Path:
        if schedule == "1F1B":  # the plain project's: made in its launch of several runs
            return project_runs()[0]["1F1B"]
        return options_runs()[0][schedule]

    return run


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp2_x_dp_shard2_on_4_ranks_equals_one_process(
    schedule: str, schedule_runs: Callable[[str], Path], one_process: Path
) -> None:
    pp2_dp2 = schedule_runs(schedule)
    # The loss (computed on the last stage, sent to every rank), the gradient norm (summed over the stages), the
    # validation loss (the schedule's forward-only pass) and every final weight. Under Interleaved1F1B the blocks are
    # also wrapped for selective activation checkpointing, which renames their parameters
    # (layers.1._checkpoint_wrapped_module.*): a stage still initialises each of them with its whole-model values
    # (before model.py undid the wrapper's part of the names, every parameter stayed uninitialised memory and the
    # losses were nan).
    assert sorted(numbers(pp2_dp2)) == [1, 2, 3, 4]
    assert all("val_loss" in numbers(pp2_dp2)[step] for step in (2, 4))
    diffs = differences(pp2_dp2, one_process, [1, 2, 3, 4])
    print(diffs)  # the figures README.md quotes (pytest -s)
    assert max(diffs.values()) <= TOLERANCE, diffs


UNEVEN = ["--parallel.pp_layers", "1,3"]  # the first stage (which also holds the embedding) gets 1 block, the last 3
# The same run (OPTIONS_RUNS' "uneven", in options_project) also offloads and prefetches: parallel.cpu_offload (each
# stage's shards, gradients and Adam state in CPU memory, stepped there) and parallel.prefetch_blocks 1 (a stage's
# blocks all-gather the next of its own blocks early). On CPU ranks the offload copies nothing; this proves they
# compose with the schedule, not the copies' speed.
assert OPTIONS_RUNS["uneven"][:2] == UNEVEN


@pytest.fixture(scope="module")
def uneven(options_runs: Callable[[], tuple[dict[str, Path], str]]) -> tuple[Path, str]:
    """pp 2 x dp_shard 2 with uneven stages, CPU offload and prefetch: the output folder, and what rank 0 printed
    (OPTIONS_RUNS', in four_ranks' launch)."""
    folders, stdout = options_runs()
    return folders["uneven"], stdout


def test_uneven_stages_from_pp_layers_with_cpu_offload_and_prefetch_equal_one_process(
    uneven: tuple[Path, str], one_process: Path
) -> None:
    diffs = differences(uneven[0], one_process, [1, 2, 3, 4])
    print(diffs)  # measured (offload and prefetch without uneven stages): weights 6.6e-6, losses 4.8e-7
    assert max(diffs.values()) <= TOLERANCE, diffs


# The whole model on the meta device, counted by module: its size, rank 0's stage (the embedding and block 0), and
# the matmul FLOPs per token (6 x each nn.Linear's weights, + 12 x dim x seq of attention scores per block) of each
# pp rank's stages; beside them what train.py and metrics.py compute.
COUNT_MODEL = """
import json, sys, torch
from config import parse_args
from metrics import pp_rank_flops_per_token
from model import build_model
config = parse_args(sys.argv[1:])
with torch.device("meta"):
    model = build_model(config)
def flops(prefixes, blocks):
    linear = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(prefixes)]
    return 6 * sum(m.weight.numel() for m in linear) + blocks * 12 * config.model.dim * config.training.seq_len
print(json.dumps({
    "whole": sum(p.numel() for p in model.parameters()),
    "rank_0": sum(p.numel() for n, p in model.named_parameters() if n.startswith(("tok_embeddings.", "layers.0."))),
    "counted": [flops(("layers.0.",), 1), flops(("layers.1.", "layers.2.", "layers.3.", "output"), 3)],
    "computed": pp_rank_flops_per_token(config, 4),
}))
"""


def test_the_model_line_counts_the_whole_model_and_each_pp_rank_s_flops_are_its_stages(
    project: Path, uneven: tuple[Path, str], tmp_path: Path
) -> None:
    # COUNT_MODEL in this process (on the meta device, nothing distributed): the project's modules imported here and
    # forgotten after (run_in_this_process), what it prints captured.
    script, printed = tmp_path / "count_model.py", io.StringIO()
    script.write_text(COUNT_MODEL)
    with contextlib.redirect_stdout(printed):
        run_in_this_process(project, str(script), *RUN, *UNEVEN)
    counts = json.loads(printed.getvalue())
    # Rank 0 holds one stage, but says the whole model's size (what a reader compares with the model card).
    assert f"model: {counts['whole']:,} parameters; {counts['rank_0']:,} in rank 0's pipeline stages\n" in uneven[1]
    # metrics.jsonl's mfu_pp_rank_N (on GPUs with a known peak) divides these by the step time.
    assert counts["computed"] == counts["counted"], counts


def test_export_and_generate_read_a_pp_checkpoint_as_the_one_process_one(
    options_project: Path, uneven: tuple[Path, str], one_process: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from tests.helpers.scripts import run_scripts

    runs = []
    for name, output_dir in (("pp", uneven[0]), ("one", one_process)):
        checkpoint, exported = output_dir / "checkpoints" / "step-4", tmp_path / name
        runs.append(["scripts/export.py", str(checkpoint), "--output", str(exported)])
        runs.append(["scripts/generate.py", str(checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "8"])
    pp_export, pp_text, one_export, one_text = run_scripts(options_project, *runs)
    assert pp_export[0] == one_export[0] == 0, (pp_export, one_export)
    mine, theirs = load_file(tmp_path / "pp" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert mine.keys() == theirs.keys()  # every block once, under its global name
    assert max((mine[name] - theirs[name]).abs().max().item() for name in theirs) <= TOLERANCE
    # Greedy decoding from the pp checkpoint continues the prompt as the one-process checkpoint does.
    assert pp_text[0] == one_text[0] == 0 and pp_text[1] == one_text[1] and pp_text[1].strip(), (pp_text, one_text)


def test_a_checkpoint_saved_by_one_process_resumes_with_pp2_x_hsdp_as_the_uninterrupted_run(
    one_process: Path, project_runs: Callable[[], tuple[dict[str, Path], str]]
) -> None:
    # The whole model's checkpoint of step 2, each stage loading its own blocks and their optimizer state, on
    # pp 2 x dp_replicate 2 x dp_shard 1: each stage replicated on 2 ranks, its gradients all-reduced between them
    # (steps 3 and 4, validated and checkpointed, equal one process: the HSDP layout's proof). (PROJECT_RUNS)
    folders, stdout = project_runs()
    run = folders["hsdp-resume"]
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    diffs = differences(run, one_process, [3, 4])
    print(diffs)  # the figures README.md quotes (pytest -s)
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_bf16_pp2_x_dp_shard2_equals_bf16_dp_shard2_without_the_pipeline(
    project_runs: Callable[[], tuple[dict[str, Path], str]], two_rank_runs: tuple[dict[str, Path], str]
) -> None:
    # bf16 mixed precision (fp32 master weights, fp32 gradient reduction) rounds differently from one fp32 process,
    # but a stage computes what the same blocks compute in the whole model sharded over the same 2 ranks, up to the
    # CPU's bf16 kernels: a micro-batch of the schedule is a smaller matmul than the whole batch, which an AVX2 host
    # (bf16 emulated) blocks differently. Measured: losses identical; weights equal on an AVX512 host,
    # 2.1e-6 apart on an AVX2 one; where both differ from one process (a lost precision setting) by 1.1e-3.
    # (pp 2 on 4 ranks: PROJECT_RUNS' "bf16"; pp 1 on 2 ranks: two_rank_runs' "bf16-pp1".)
    diffs = differences(project_runs()[0]["bf16"], two_rank_runs[0]["bf16-pp1"], [1, 2, 3, 4])
    print(diffs)
    assert max(diffs.values()) <= 1e-5, diffs


def test_dcp_async_checkpoints_of_pp2_resume_with_pp1_as_the_uninterrupted_run(
    two_rank_runs: tuple[dict[str, Path], str], one_process: Path
) -> None:
    # The step-2 checkpoint written by two stages (each sharded over 2 ranks), loaded by 2 ranks holding every block.
    # In the background-saved style: the same state dicts (keyed by parameter name) as dcp's, staged and written
    # while training goes on, and read back as dcp's are; GPipe's run (equal to one process:
    # test_pp2_x_dp_shard2_on_4_ranks_equals_one_process[GPipe]) wrote them. (dcp's own pp 2 checkpoints are resumed
    # with pp 2 by test_a_rank_killed_mid_step_..., and read whole by export.py and generate.py in
    # test_export_and_generate_read_a_pp_checkpoint_as_the_one_process_one.) In two_rank_runs' launch, from a copy of
    # GPipe's run without its step-4 checkpoint.
    folders, stdout = two_rank_runs
    run = folders["dcp-async-pp1"]
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in stdout
    diffs = differences(run, one_process, [3, 4])
    print(diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_the_grad_norm_summed_over_the_stages_is_what_makes_it_equal(
    two_rank_runs: tuple[dict[str, Path], str], one_process: Path
) -> None:
    # Not blind to clipping: each stage's own norm (not summed over the pp group) is logged on rank 0 (stage 0) and
    # clips each stage by its own norm, and the run no longer equals one process (mutated_project's run of 2 steps,
    # pp 2 x dp_shard 1, in two_rank_runs' launch).
    diffs = differences(two_rank_runs[0]["mutated"], one_process, [1, 2])
    # Outside the tolerance (measured: grad norm 0.31, final weights 5.0e-5, validation loss 3.3e-4; step 2 clipped).
    assert diffs["grad_norm"] > 0.1 and diffs["weights"] > 3 * TOLERANCE, diffs


PREFLIGHT_REFUSALS = {
    "tied-embeddings": (
        ["--model.tie_embeddings", "true"],
        "model.tie_embeddings shares one matrix between the first and the last of the 2 pipeline stages, which "
        "pipelines cannot; use --model.tie_embeddings false, or --parallel.pp 1",
    ),
    "too-few-blocks": (
        ["--model.n_layers", "1"],
        "model.n_layers (1) leaves a pipeline stage without a block: parallel.pp x pp_stages_per_rank = 2 stages; "
        "use fewer stages (or a deeper model)",
    ),
    "layers-not-summing": (
        ["--parallel.pp_layers", "1,2"],
        "parallel.pp_layers = [1, 2] must give the blocks of each of the 2 stages (parallel.pp x "
        "pp_stages_per_rank), summing to model.n_layers (4); e.g. --parallel.pp_layers 2,2",
    ),
    "empty-stage": (
        ["--parallel.pp_layers", "0,4"],
        "parallel.pp_layers = [0, 4] leaves a pipeline stage without a block; give each stage at least 1, e.g. "
        "--parallel.pp_layers 2,2",
    ),
    "1f1b-micro-batches": (
        ["--training.grad_accum_steps", "1", "--training.global_batch_size", "2"],
        "training.grad_accum_steps (1) is the pipeline's micro-batches per step; parallel.pp_schedule 1F1B needs at "
        "least parallel.pp (2); e.g. --training.grad_accum_steps 2",
    ),
    "interleaved-one-stage": (
        ["--parallel.pp_schedule", "Interleaved1F1B"],
        "parallel.pp_schedule = Interleaved1F1B needs at least 2 stages per rank, but parallel.pp_stages_per_rank "
        "is 1; use --parallel.pp_stages_per_rank 2 (or --parallel.pp_schedule 1F1B)",
    ),
    "1f1b-two-stages": (
        ["--parallel.pp_stages_per_rank", "2"],
        "parallel.pp_schedule = 1F1B runs one stage per rank, but parallel.pp_stages_per_rank is 2; use "
        "--parallel.pp_stages_per_rank 1 (or --parallel.pp_schedule Interleaved1F1B)",
    ),
    "loss-chunks": (
        ["--training.loss_chunks", "2"],
        "training.loss_chunks = 2 with parallel.pp = 2 is not built (the last stage computes the whole logits); "
        "pass --training.loss_chunks 1, or --parallel.pp 1",
    ),
    "document-mask": (
        ["--data.document_mask", "true"],
        "data.document_mask with parallel.pp = 2 is not built (the stages pass only hidden states); pass "
        "--data.document_mask false, or --parallel.pp 1",
    ),
}


@pytest.fixture(scope="module")
def refusals(project: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    """Every refusal case of the pp project (PREFLIGHT_REFUSALS, and the ZERO_BUBBLE_REFUSALS it can meet) run by
    its own preflight.main() as `python preflight.py --world-size 4 ARGS` runs it, all in one process
    (tests/helpers/preflight_driver.py): the folder of their output dirs, and case -> [exit code, stdout, stderr].
    The selective-checkpointing case launches the real thing. (`torchrun train.py` runs the same preflight() on
    rank 0 and stops every rank with its one line: test_bad_input_runtime.py's
    test_torchrun_without_the_launcher_prints_the_error_once, and test_context_parallel.py's
    test_train_py_refuses_too_on_every_rank_with_one_line for a layout's own refusal.)"""
    root = tmp_path_factory.mktemp("refusals")
    cases = {**PREFLIGHT_REFUSALS, **ZERO_BUBBLE_REFUSALS}
    argv = {case: ["--world-size", "4", *RUN, "--job.output_dir", str(root / case), *args]
            for case, (args, _) in cases.items() if case != "selective-checkpointing"}  # fmt: skip
    return root, preflight_cases(project, argv, root)


def assert_refused(refusals: tuple[Path, dict[str, list]], case: str, line: str) -> None:
    """preflight for 4 ranks exited 2 with exactly `line`, before writing anything."""
    root, results = refusals
    code, _, stderr = results[case]
    assert (code, stderr) == (2, f"preflight.py: error: {line}\n")
    assert not (root / case).exists()  # nothing written


@pytest.mark.parametrize("case", list(PREFLIGHT_REFUSALS))
def test_what_pp_cannot_run_is_refused_in_one_line_before_the_model_is_built(
    case: str, refusals: tuple[Path, dict[str, list]]
) -> None:
    assert_refused(refusals, case, PREFLIGHT_REFUSALS[case][1])


GENERATOR_REFUSALS = {
    "moe": (["--moe"], "pipeline parallelism is not built for mixture-of-experts models (--moe) yet; use --pp 1"),
    "cp": (
        ["--cp", "2"],
        "pipeline parallelism with context parallelism (--cp) is not built yet; use --pp 1 or --cp 1",
    ),
    "full": (
        ["--checkpoint", "full"],
        "pipeline parallelism saves sharded checkpoints only; use --checkpoint dcp or dcp-async with --pp",
    ),
    "compile": (
        ["--compile"],
        "--compile with pipeline parallelism (--pp) is not built yet (open upstream bugs); leave out --compile or use "
        "--pp 1",
    ),
    "fp16": (
        ["--precision", "fp16"],
        "pipeline parallelism with fp16's loss scaler is not built yet; use --bf16 or --fp32 with --pp",
    ),
    "not-dividing": (["--gpus", "4", "--pp", "3"], "3 must divide the 4 GPUs, e.g. --pp 2"),
    "tp-not-dividing": (
        ["--gpus", "2", "--tp", "2"],
        "2 x --tp 2 must divide the 2 GPUs (TP inside each stage), e.g. --pp 1",
    ),
}


@pytest.mark.parametrize("case", list(GENERATOR_REFUSALS))
def test_what_pp_is_not_built_with_is_refused_by_the_generator_in_one_line(case: str, tmp_path: Path) -> None:
    from tests.conftest import fsdp2gen

    args, line = GENERATOR_REFUSALS[case]
    result = fsdp2gen("new", str(tmp_path / "p"), "--yes", "--gpus", "4", "--pp", "2", "--precision", "fp32", *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.rstrip().endswith(line), result.stderr
    assert not (tmp_path / "p").exists()


def test_pp_keys_exist_only_in_pp_projects(project: Path, tmp_path: Path) -> None:
    plain = generate(tmp_path / "plain", "--gpus", "4", "--precision", "fp32")
    assert not (plain / "pipeline.py").exists() and "pp" not in (plain / "config.toml").read_text().split()
    assert "pp = 2" in (project / "config.toml").read_text().splitlines()


ParallelLayout = layout_module().ParallelLayout
LayoutError = layout_module().LayoutError


@settings(max_examples=300, deadline=None)
@given(
    pp=st.integers(1, 8),
    dp_shard=st.integers(1, 4),
    stages_per_rank=st.integers(1, 3),
    schedule=st.sampled_from(["1F1B", "GPipe", "Interleaved1F1B"]),
    n_layers=st.integers(1, 24),
    pp_layers=st.one_of(st.just([]), st.lists(st.integers(-1, 8), min_size=1, max_size=10)),
    micro=st.integers(1, 20),
    tied=st.booleans(),
)
def test_the_pp_layout_splits_the_blocks_and_micro_batches_or_says_why_in_one_line(
    pp: int,
    dp_shard: int,
    stages_per_rank: int,
    schedule: str,
    n_layers: int,
    pp_layers: list[int],
    micro: int,
    tied: bool,
) -> None:
    world_size = pp * dp_shard
    parallel = SimpleNamespace(
        dp_replicate=1, dp_shard=-1, pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank,
        pp_layers=pp_layers, reshard_after_forward=True,
    )  # fmt: skip
    training = SimpleNamespace(global_batch_size=dp_shard * micro, grad_accum_steps=micro, seq_len=64, loss_chunks=1)
    model = SimpleNamespace(n_layers=n_layers, tie_embeddings=tied, n_experts=0)
    layout = ParallelLayout.of(parallel, world_size)
    stages = pp * stages_per_rank
    try:
        layout.check(training, model)
    except LayoutError as error:
        message = str(error)
        assert "\n" not in message and "; " in message
        assert pp > 1 and error.problem.startswith("pp_"), error.problem
        if error.problem == "pp_layers" and "e.g. --parallel.pp_layers" in message:
            suggested = [int(n) for n in message.rsplit(" ", 1)[1].split(",")]  # the suggestion itself is valid
            assert len(suggested) == stages and sum(suggested) == n_layers and min(suggested) >= 1
        if error.problem == "pp_micro_batches":
            fitting = int(message.rsplit(" ", 1)[1])
            assert fitting >= 1 and (schedule != "1F1B" or fitting >= pp)
            assert schedule != "Interleaved1F1B" or fitting % max(1, fitting // pp) == 0
        return
    if pp == 1:
        return
    # Every stage has at least one block, the stages hold every block once, and torch's schedule rules hold.
    split = layout.stage_layers(n_layers)
    assert len(split) == stages and sum(split) == n_layers and min(split) >= 1 and not tied
    assert (schedule == "Interleaved1F1B") == (stages_per_rank > 1)
    assert schedule != "1F1B" or micro >= pp
    assert schedule != "Interleaved1F1B" or micro % max(1, micro // pp) == 0
    # The ranks of one pipeline read the same samples; only the last stage's ranks hold the loss.
    assert [layout.data_rank(rank) for rank in range(world_size)] == [r % dp_shard for r in range(world_size)]
    assert [layout.holds_loss(rank) for rank in range(world_size)] == [
        r >= world_size - dp_shard for r in range(world_size)
    ]


def checkpoint_tensors(output_dir: Path, step: int) -> dict[str, object]:
    """The model's weights and the optimizer's state in the DCP checkpoint of `step`, flattened by name."""
    dcp_to_torch_save(output_dir / "checkpoints" / f"step-{step}", output_dir / f"all-{step}.pt")
    saved = torch.load(output_dir / f"all-{step}.pt")["train"]
    flat: dict[str, object] = {}

    def walk(tree: object, prefix: str) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix] = tree

    walk({"model": saved["model"], "optimizer": saved["optimizer"]}, "")
    return flat


def test_a_rank_killed_mid_step_restarts_and_resumes_bit_for_bit(
    project_runs: Callable[[], tuple[dict[str, Path], str]],
) -> None:
    # PROJECT_RUNS' last run, 1F1B's with rank 3 (the last stage) SIGKILLed in the middle of step 4 (KILL): torchrun
    # (--max-restarts 1) restarts all 4 ranks, which resume from the step-2 checkpoint; each stage loads its own
    # blocks and their optimizer state, the data position is the step's, the RNG states the checkpoint's: step 3
    # (logged again, the first attempt's row kept aside), step 4 and the final weights and Adam moments are those of
    # the uninterrupted run (PROJECT_RUNS' "1F1B") exactly (==, not within a tolerance).
    folders, stdout = project_runs()
    run, uninterrupted = folders["killed"], folders["1F1B"]
    assert_resumed_bit_for_bit(stdout, run, KILL, 2, ("loss", "grad_norm"))
    resumed, expected = numbers(run), numbers(uninterrupted)
    assert sorted(resumed) == [1, 2, 3, 4]
    assert [resumed[step] for step in (1, 2, 3, 4)] == [expected[step] for step in (1, 2, 3, 4)]
    mine, theirs = checkpoint_tensors(run, 4), checkpoint_tensors(uninterrupted, 4)
    assert mine.keys() == theirs.keys() and any(key.startswith("optimizer.") for key in theirs)
    same = {key: torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else mine[key] == value
            for key, value in theirs.items()}  # fmt: skip
    assert [key for key, equal in same.items() if not equal] == []


# Tensor parallelism inside each stage rounds as it does without the pipeline: one element of layers.3's w2 ends
# 1.6e-5 from one process after 2 steps, with pp 2 (and with pp 1: dp_shard 2 x tp 2 on 4 ranks, measured), Adam
# amplifying a near-zero gradient's rounding; the pipeline itself adds 2.9e-7 (pp 2 vs pp 1, both with tp 2).
TP_WEIGHTS_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def tp_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 nodes of 4 GPUs, each stage tensor-parallel over 2 of its node's GPUs (tp groups never leave a node)."""
    return generate(tmp_path_factory.mktemp("pp-tp") / "run", "--nodes", "2", "--gpus", "4", "--pp", "2", "--tp", "2",
                    "--fp32")  # fmt: skip


def test_pp2_x_dp_shard2_x_tp2_on_two_launched_nodes_of_4_equals_one_process(
    tp_project: Path, one_process: Path, tmp_path: Path
) -> None:
    # scripts/launch_multinode.sh as 2 "nodes" of 4 ranks on 127.0.0.1: pp is the outermost dimension, so node 0
    # holds the first stage and node 1 the last (activations and gradients cross the launchers); inside a node,
    # FSDP over 2 ranks x TP over 2. The stages pass each other plain tensors, each tp rank's half of the sequence
    # (sequence parallelism's layout between blocks); the last stage's logits stay split by vocabulary, its loss
    # computed under loss_parallel; the grad norm sums DTensor norms (over dp_shard x tp) over the pp group once.
    dirs = (tmp_path / "two", tmp_path / "two")
    nodes = launch_two_nodes(tp_project, dirs, 4, *RUN, "--parallel.dp_replicate", "1", "--parallel.dp_shard", "2")
    assert [code for code, _ in nodes] == [0, 0], nodes
    info = json.loads((tmp_path / "two" / "checkpoints" / "step-4" / "checkpoint.json").read_text())
    parallel = info["config"]["parallel"]
    assert (info["world_size"], parallel["pp"], parallel["dp_shard"], parallel["tp"]) == (8, 2, 2, 2), info
    diffs = differences(tmp_path / "two", one_process, [1, 2, 3, 4])
    print(diffs)  # the figures README.md quotes (pytest -s)
    assert max(diffs["loss"], diffs["grad_norm"], diffs["val_loss"]) <= TOLERANCE, diffs
    assert diffs["weights"] <= TP_WEIGHTS_TOLERANCE, diffs


def test_a_tp_group_across_nodes_is_refused_in_one_line_by_each_launcher(tp_project: Path, tmp_path: Path) -> None:
    # 4 nodes of 2 ranks with pp 2 x tp 4: each tp group would span 2 nodes. launch_multinode.sh's preflight knows
    # the ranks per node (NPROC) and stops before torchrun starts; nothing is written.
    result = subprocess.run(
        ["scripts/launch_multinode.sh", *RUN, "--model.n_kv_heads", "4", "--parallel.tp", "4",
         "--parallel.dp_replicate", "1", "--job.output_dir", str(tmp_path / "o")],
        cwd=tp_project, capture_output=True, text=True, timeout=120,
        env={**torchrun_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "NODE_RANK": "0", "NNODES": "4",
             "NPROC": "2", "DEVICE": "cpu"},
    )  # fmt: skip
    line = (
        "parallel.tp = 4 puts tensor-parallel groups across nodes of 2 ranks each; use a tp that divides the ranks "
        "per node, e.g. --parallel.tp 2"
    )
    assert (result.returncode, result.stderr) == (2, f"preflight.py: error: {line}\n"), result.stderr
    assert not (tmp_path / "o").exists()


# The zero-bubble schedules torch 2.13 ships: each splits a micro-batch's backward into the input gradient (sent back
# at once) and the weight gradient (run later, in the bubble); FSDP reduce-scatters once after the last of them.
# ZBVZeroBubble and DualPipeV place the 4 stages in a V (layout.rank_stages: rank 0 holds blocks 0 and 3 with the
# embedding and the output layer, rank 1 blocks 1 and 2). DualPipeV runs with full activation checkpointing (in
# options_project, rendered with activation checkpointing, in four_ranks' launch): recomputing a whole block
# works with the split backward (op-level "selective" does not: refused); this run is also the suite's proof that
# full checkpointing's wrapped (renamed) blocks in the stages equal one process (selective's: Interleaved1F1B in
# test_pp2_x_dp_shard2_on_4_ranks_equals_one_process).
# Measured against one process: losses 4.8e-7, grad norms <= 2.4e-7, validation 0, weights 6.6e-6 (1F1B's figures).
ZERO_BUBBLE = {
    "InterleavedZeroBubble": ([], ["--parallel.pp_schedule", "InterleavedZeroBubble"]),
    "ZBVZeroBubble": ([], ["--parallel.pp_schedule", "ZBVZeroBubble"]),
    "DualPipeV": (["--parallel.activation_checkpointing", "full"], ["--parallel.pp_schedule", "DualPipeV"]),
}


@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE))
def test_zero_bubble_schedules_on_pp2_x_dp_shard2_equal_one_process(
    schedule: str,
    project_runs: Callable[[], tuple[dict[str, Path], str]],
    options_runs: Callable[[], tuple[dict[str, Path], str]],
    one_process: Path,
) -> None:
    options, args = ZERO_BUBBLE[schedule]
    if options:  # DualPipeV, in options_project's launch of several runs
        assert OPTIONS_RUNS[schedule] == [*args, "--parallel.pp_stages_per_rank", "2", *options, *NO_OFFLOAD]
        out = options_runs()[0][schedule]
    else:  # the plain project's, in its launch of several runs
        assert PROJECT_RUNS[schedule] == [*args, "--parallel.pp_stages_per_rank", "2"]
        out = project_runs()[0][schedule]
    # Validation too: under a V it runs the schedule's forwards only (pipeline.forward_only_order).
    assert all("val_loss" in numbers(out)[step] for step in (2, 4))
    diffs = differences(out, one_process, [1, 2, 3, 4])
    print(diffs)
    assert max(diffs.values()) <= TOLERANCE, diffs


ZERO_BUBBLE_REFUSALS = {
    "zbv-one-stage": (
        ["--parallel.pp_schedule", "ZBVZeroBubble"],
        "parallel.pp_schedule = ZBVZeroBubble places 2 stages on each rank (a V), but parallel.pp_stages_per_rank is "
        "1; use --parallel.pp_stages_per_rank 2",
    ),
    "dualpipev-micro-batches": (
        [
            "--parallel.pp_schedule",
            "DualPipeV",
            "--parallel.pp_stages_per_rank",
            "2",
            "--training.grad_accum_steps",
            "2",
            "--training.global_batch_size",
            "4",
        ],
        "training.grad_accum_steps (2) is the pipeline's micro-batches per step; parallel.pp_schedule DualPipeV needs "
        "at least its 4 stages; e.g. --training.grad_accum_steps 4",
    ),  # fmt: skip
    "interleaved-zero-bubble-rounds": (
        [
            "--parallel.pp_schedule",
            "InterleavedZeroBubble",
            "--parallel.pp_stages_per_rank",
            "2",
            "--training.grad_accum_steps",
            "5",
            "--training.global_batch_size",
            "10",
        ],
        "training.grad_accum_steps (5) is the pipeline's micro-batches per step; parallel.pp_schedule "
        "InterleavedZeroBubble needs fewer than, or a multiple of, parallel.pp (2); e.g. --training.grad_accum_steps 4",
    ),  # fmt: skip
    "selective-checkpointing": (
        ["--parallel.pp_schedule", "ZBVZeroBubble", "--parallel.pp_stages_per_rank", "2"],
        "parallel.activation_checkpointing = selective cannot run under parallel.pp_schedule = ZBVZeroBubble (zero "
        "bubble splits each backward in two); pass --parallel.activation_checkpointing full, or --parallel.pp_schedule "
        "Interleaved1F1B",
    ),
}


@pytest.mark.parametrize("case", list(ZERO_BUBBLE_REFUSALS))
def test_what_the_zero_bubble_schedules_cannot_run_is_refused_in_one_line(
    case: str, refusals: tuple[Path, dict[str, list]], options_project: Path, tmp_path: Path
) -> None:
    # Measured without the refusals: DualPipeV raises in torch's constructor, InterleavedZeroBubble too, and
    # selective checkpointing "Trying to backward an extra time" in the first step's weight gradients.
    args, line = ZERO_BUBBLE_REFUSALS[case]
    if case != "selective-checkpointing":
        assert_refused(refusals, case, line)
        return
    # The selective project's refusal: `python preflight.py` itself (its __main__, in this process:
    # captured_in_this_process; nothing distributed, and torch is imported here already).
    argv = ["--world-size", "4", *RUN, "--job.output_dir", str(tmp_path / "o"), *args]
    code, _, stderr = captured_in_this_process(options_project, "preflight.py", *argv)
    assert (code, stderr) == (2, f"preflight.py: error: {line}\n")
    assert not (tmp_path / "o").exists()  # nothing written


@settings(max_examples=100, deadline=None)
@given(
    pp=st.integers(2, 8),
    dp_shard=st.integers(1, 3),
    stages_per_rank=st.integers(1, 3),
    schedule=st.sampled_from(["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]),
    micro=st.integers(1, 20),
)
def test_the_zero_bubble_layouts_place_every_stage_once_or_say_why(
    pp: int, dp_shard: int, stages_per_rank: int, schedule: str, micro: int
) -> None:
    parallel = SimpleNamespace(
        dp_replicate=1, dp_shard=-1, pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank, pp_layers=[],
        reshard_after_forward=True,
    )  # fmt: skip
    training = SimpleNamespace(global_batch_size=dp_shard * micro, grad_accum_steps=micro, seq_len=64, loss_chunks=1)
    model = SimpleNamespace(n_layers=24, tie_embeddings=False, n_experts=0)
    layout = ParallelLayout.of(parallel, pp * dp_shard)
    v_shaped = schedule != "InterleavedZeroBubble"
    try:
        layout.check(training, model)
    except LayoutError as error:
        assert "\n" not in str(error) and error.problem in ("pp_schedule", "pp_micro_batches"), error.problem
        if error.problem == "pp_micro_batches":  # the suggestion passes the rule it names
            fitting = int(str(error).rsplit(" ", 1)[1])
            assert schedule != "DualPipeV" or fitting >= 2 * pp
            assert schedule != "InterleavedZeroBubble" or fitting % max(1, fitting // pp) == 0
        assert (stages_per_rank != 2 if v_shaped else stages_per_rank < 2) or error.problem == "pp_micro_batches"
        return
    # torch's own placement (the V of torch.distributed.pipelining._utils), every stage on exactly one rank.
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    stages = pp * stages_per_rank
    style = "v" if v_shaped else "loop"
    assert [layout.rank_stages(r) for r in range(pp)] == [
        generate_rank_to_stage_mapping(pp, stages, style=style)[r] for r in range(pp)
    ]
    # The loss lives on the last stage's ranks: the first pp rank under a V, the last otherwise.
    world = pp * dp_shard
    assert [layout.holds_loss(r) for r in range(world)] == [
        (r < dp_shard) if v_shaped else (r >= world - dp_shard) for r in range(world)
    ]
