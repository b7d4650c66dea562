"""`fsdp2gen plan` within 10% of the simulated step (a generated project's scripts/plan_memory.py: its own model and
train.py under FakeTensorMode with the fake process group, measured by torch's FSDPMemTracker), for a matrix of
real Llama 3 shapes, the llama family's and a Hugging Face model's (Llama 3.1 8B's config.json, no weights: plain,
with LoRA, with QLoRA and with task sft); README.md's table is this matrix (FSDP2GEN_UPDATE_DOCS=1 writes it there).
A row whose peak stays at one place is simulated at two small depths and extrapolated to its whole depth (exact in
bytes: test_the_simulated_step_is_affine_in_the_depth).

To add a configuration, add a Row to ROWS (tests/helpers/plan_simulation.py says what a Row sets), then rerun this
file with FSDP2GEN_UPDATE_DOCS=1 to put it in the README's table.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from fsdp2gen.plan import build_request, estimate
from tests.conftest import REPO, generate, save_tiny_llama
from tests.helpers.plan_simulation import (
    FIGURES,
    LLAMA_70B,
    TABLE_HEAD,
    Row,
    difference,
    extrapolate,
    peak_place,
    plan_bytes,
    simulate_rows,
    table,
)
from tests.helpers.plan_simulation import write_config as write_row_config

pytest.importorskip("torch")

# One project whose config.toml can express every row: generated with TP, op-level AC and CPU offload (each then
# a config key: parallel.tp, parallel.activation_checkpointing, parallel.cpu_offload), bf16, 8 GPUs.
OPTIONS = ("--bf16", "--gpus", "8", "--tp", "2", "--activation-checkpointing", "selective", "--cpu-offload")
# The hf projects: generated on a tiny pretrained model (the generator checks its folder), then each row points
# model.path at a folder holding Llama 3.1 8B's config.json only (scripts/plan_memory.py reads no weights).
HF_OPTIONS = ("--family", "hf", "--bf16", "--gpus", "8", "--activation-checkpointing", "selective")
# (hf-pp is generated with --tp 2 as well, so that its rows can set parallel.tp: 1, or 8 for the 70B row.)
HF_KINDS = {"hf": (), "hf-lora": ("--lora",), "hf-qlora": ("--qlora",), "hf-sft": ("--task", "sft"),
            "hf-tp": ("--tp", "2"), "hf-pp": ("--pp", "2", "--tp", "2"),
            "hf-pp-lora": ("--pp", "2", "--lora"), "hf-tp-lora": ("--tp", "2", "--lora")}  # fmt: skip
HF_8B = {"path": "Llama-3.1-8B"}  # HF_CONFIGS' name: the test points model.path at its folder
# Sequence 2048 and 1 sample per data-parallel rank keep a row at seconds on 2 cores (fake tensors: the sizes cost
# no memory or compute, the number of ops does: a row's time grows with its blocks, 70B's 80 blocks cost 40 s).
# So a row whose peak's place does not move with the depth is simulated at 2 and 3 blocks and extrapolated to its
# whole depth (`extrapolated_from`, exact in bytes: test_the_simulated_step_is_affine_in_the_depth), which plan
# plans: AC none (the peak at the output layer's backward, all blocks' activations held), full AC (at the loss),
# accumulation into unsharded gradients, resharding, the headline run (in the last block's backward), 70B, TP 8,
# offload; LoRA at 9 and 10 (below). Whole depth, simulated: the rows whose peak moves with the depth until close
# to it (selective and layer AC, accumulation every micro-batch, 8B and hf 8B selective: the loss's peak up to 16
# of 8B's 32 blocks, the output layer's backward at 32; layer AC's steps alternate between 2 blocks). A row whose
# mechanism does not depend on the depth (TP's split and HSDP's shard group under selective AC, task sft, NF4,
# experts: the first three's peak moves, the others' cost as much at two small depths) simulates its model's first
# 8 blocks (`blocks`; plan plans the same truncated model, so the comparison stays like for like).
ROWS = [
    Row("1b-none", "1b", ac="none", extrapolated_from=(2, 3)),
    Row("1b-none-whole-logits", "1b", ac="none", loss_chunks=1, extrapolated_from=(2, 3)),
    Row("1b-selective", "1b", ac="selective"),
    Row("1b-layer", "1b", ac="layer"),
    Row("1b-full", "1b", ac="full", extrapolated_from=(2, 3)),
    Row("1b-accum-every", "1b", ac="selective", global_batch_size=16, grad_accum_steps=2),
    Row(
        "1b-accum-last",
        "1b",
        ac="selective",
        global_batch_size=16,
        grad_accum_steps=2,
        grad_sync="last_micro_batch",
        extrapolated_from=(2, 3),
    ),
    # The unsharded gradients accumulated in a 16-bit reduce_dtype (plan counted them in fp32: 31% over).
    Row(
        "1b-accum-last-reduce-bf16",
        "1b",
        ac="selective",
        global_batch_size=16,
        grad_accum_steps=2,
        grad_sync="last_micro_batch",
        extra={"parallel.reduce_dtype": "bfloat16"},
        extrapolated_from=(2, 3),
    ),  # fmt: skip
    # Blocks kept gathered between forward and backward, or sharded over groups of 4 of the 8 ranks (plan counted
    # neither before: 21% under the simulation with false).
    Row("1b-keep-gathered", "1b", ac="none", extra={"parallel.reshard_after_forward": False}, extrapolated_from=(2, 3)),
    Row("1b-reshard-4", "1b", ac="none", extra={"parallel.reshard_after_forward": 4}, extrapolated_from=(2, 3)),
    Row("8b-selective", "8b", ac="selective"),
    Row("8b-tp2-selective", "8b", tp=2, ac="selective", global_batch_size=4, blocks=8),
    Row("8b-tp8-full", "8b", tp=8, ac="full", global_batch_size=1, seq_len=8192, extrapolated_from=(2, 3)),
    Row("8b-offload-full", "8b", ac="full", offload=True, extrapolated_from=(2, 3)),
    # torchtitan's headline run: local batch 2 x 8192 tokens.
    Row("8b-headline", "8b", ac="selective", global_batch_size=16, seq_len=8192, extrapolated_from=(2, 3)),
    # 2 nodes of 8 GPUs as a multi-node project is generated (parallel.dp_replicate = nodes): HSDP, 2 copies of 8
    # shards. plan --config reads dp_replicate (it planned FSDP over 16 ranks, 18% under, before).
    Row(
        "8b-hsdp-2x8-selective",
        "8b",
        gpus=16,
        ac="selective",
        global_batch_size=16,
        blocks=8,
        extra={"parallel.dp_replicate": 2},
    ),  # fmt: skip
    # 8 nodes of 8 GPUs: FSDP over 8 x TP 8, all 80 blocks (plan misses a fixed ~1.6 GiB, 33% of 8 blocks' peak).
    Row("70b-tp8-full", LLAMA_70B, gpus=64, tp=8, ac="full", global_batch_size=8, extrapolated_from=(2, 3)),
    # The llama family's pipeline stages under tp (sequence parallelism: the stages exchange each tp rank's 1/tp of
    # the sequence): 2 stages of 1 block, 1F1B over 2 micro-batches, the whole logits split by vocabulary (at 2
    # blocks a stage, +2.3%: the peak is the loss's, on the last stage, at both depths).
    Row(
        "8b-tp2-pp2-selective",
        "8b",
        project="llama-pp",
        tp=2,
        ac="selective",
        global_batch_size=4,
        grad_accum_steps=2,
        loss_chunks=1,
        blocks=2,
        extra={"parallel.pp": 2},
    ),  # fmt: skip
    # A Hugging Face model from its config.json (transformers' modules, pretrained: its weights not read), with
    # LoRA (rank 16 on the 7 linear layers, the project's defaults: only the adapters train) and with task sft.
    Row("hf-8b-selective", HF_8B, project="hf", ac="selective"),
    # LoRA's peak is the first block's forward up to 8 blocks (the frozen weights hold no gradients or AdamW state),
    # the last block's backward from 9: simulated at 9 and 10.
    Row("hf-8b-lora-selective", HF_8B, project="hf-lora", ac="selective", extrapolated_from=(9, 10)),
    # QLoRA: the same adapters on NF4 frozen weights (nf4.py; the simulation fills no NF4 values, only their shapes).
    Row("hf-8b-qlora-selective", HF_8B, project="hf-qlora", ac="selective", blocks=8),
    Row("hf-8b-sft-selective", HF_8B, project="hf-sft", ac="selective", blocks=8),
    # Tensor parallelism as the model declares it (config.base_model_tp_plan, and the input embedding, which
    # transformers adds as embedding_rowwise, split by its dimension: tensor_parallel.py): no sequence parallelism,
    # so the activations between the layers stay whole on each tp rank. Without AC, where the activations are most
    # of the peak. (Planned with the blocks' activations whole, as before the declared
    # plan was read: +15.2% at 8 of its blocks; with the embedding whole, as the config's plan alone says: +7.6% at
    # 8 blocks, +31% under selective AC, whose peak is the root's.)
    Row("hf-8b-tp2-none", HF_8B, project="hf-tp", tp=2, ac="none", extrapolated_from=(2, 3)),
    # LoRA under tensor parallelism (tensor_parallel.py's lora_styles): the frozen base_layer split as the plan
    # splits the layer, lora_B with a colwise layer's outputs, lora_A with a rowwise layer's inputs, the other whole;
    # only the adapters have gradients and AdamW state. Selective AC keeps the colwise layers' base and lora_B
    # outputs split, the rowwise lora_B's whole. (Planned with the adapted layers whole: +28%; with LoRA's kept
    # outputs all whole: +22%.) The peak is the last block's backward from 3 blocks (at 2: the first block's forward).
    Row("hf-8b-lora-tp2-selective", HF_8B, project="hf-tp-lora", tp=2, ac="selective", extrapolated_from=(3, 4)),
    # Pipeline parallelism, cut by the model's declared pipeline plan: 2 stages of 4 blocks, 1F1B over 2 micro-batches,
    # the whole logits on the last stage (loss_chunks 1 under PP); each pipeline rank simulated, the worst compared.
    Row(
        "hf-8b-pp2-selective",
        HF_8B,
        project="hf-pp",
        ac="selective",
        grad_accum_steps=2,
        loss_chunks=1,
        blocks=8,
        extra={"parallel.pp": 2},
    ),  # fmt: skip
    # The user's machine for a 70B model: 2 nodes of 8 GPUs, tensor parallelism inside a node (tp 8, the model's
    # declared plan), pipeline parallelism across the nodes (pp 2, 1F1B over 4 micro-batches: the first stage holds
    # 2 in flight). Simulated at 4 and 6 blocks (2 and 3 per stage), each pipeline rank extrapolated to the 80 blocks:
    # the first stage is the worst there, the last one at the small depths (its logits).
    Row(
        "hf-70b-tp8-pp2-selective",
        {"path": "Llama-3.1-70B"},
        project="hf-pp",
        gpus=16,
        tp=8,
        ac="selective",
        seq_len=8192,
        global_batch_size=4,
        grad_accum_steps=4,
        loss_chunks=1,
        extra={"parallel.pp": 2},
        extrapolated_from=(4, 6),
    ),  # fmt: skip
    # Under pp: a mixture-of-experts model's stages (its routed blocks' activations and the experts' backward copies),
    # and LoRA's (the adapters alone have gradients and AdamW state; every block of a stage stays gathered).
    Row(
        "hf-qwen3-30b-a3b-pp2-selective",
        {"path": "Qwen3-30B-A3B"},
        project="hf-pp",
        ac="selective",
        grad_accum_steps=2,
        loss_chunks=1,
        blocks=4,
        extra={"parallel.pp": 2},
    ),  # fmt: skip
    Row(
        "hf-8b-lora-pp2-selective",
        HF_8B,
        project="hf-pp-lora",
        ac="selective",
        grad_accum_steps=2,
        loss_chunks=1,
        blocks=4,
        extra={"parallel.pp": 2},
    ),  # fmt: skip
    # Mixture-of-experts models (transformers' fused experts, FSDP-sharded: hf projects have no --ep).
    # Mixtral 8x7B's whole step (32 blocks), by hand: plan -1.8%; Qwen3's (48): -1.0%.
    Row("hf-qwen3-30b-a3b-selective", {"path": "Qwen3-30B-A3B"}, project="hf", ac="selective", blocks=8),
    Row("hf-mixtral-4-blocks-selective", {"path": "Mixtral-8x7B"}, project="hf", ac="selective", blocks=4),
    # Under tp, as Qwen3-MoE declares it (base_model_tp_plan: attention colwise / rowwise, q_norm and k_norm
    # replicated; its mlp.gate_proj ... entries name dense blocks this model does not have): the router and the
    # experts whole on each tp rank, FSDP-sharded over the 4 data-parallel ranks, run on the same whole tokens. The
    # peak is block 1's experts' backward, as without tp; at 2 blocks (the first block's) plan was 16% over.
    Row("hf-qwen3-30b-a3b-tp2-selective", {"path": "Qwen3-30B-A3B"}, project="hf-tp", tp=2, ac="selective", blocks=4),
]
README = REPO / "README.md"
TOLERANCE = 10  # %


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("plan_simulation") / "project", *OPTIONS)


@pytest.fixture(scope="module")
def pp_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OPTIONS with --pp 2: the llama rows of pipeline parallelism (with tp: parallel.tp)."""
    return generate(tmp_path_factory.mktemp("plan_simulation_pp") / "project", *OPTIONS, "--pp", "2")


@pytest.fixture(scope="module")
def hf_projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The hf projects (HF_KINDS), and by an hf row's id a folder with its config.json (Row.hf_config) only."""
    root = tmp_path_factory.mktemp("plan_simulation_hf")
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"  # for task sft
    special = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
    tiny = save_tiny_llama(root / "tiny", "the cat sat on the mat " * 50, special, chat_template=template)
    projects = {kind: generate(root / kind, *HF_OPTIONS, "--hf-model", str(tiny), *extra)
                for kind, extra in HF_KINDS.items()}  # fmt: skip
    for index, row in enumerate(row for row in [*ROWS, *SIMULATED] if not row.llama):
        (root / f"model-{index}").mkdir()
        (root / f"model-{index}" / "config.json").write_text(json.dumps(row.hf_config()))
        projects[row.id] = root / f"model-{index}"
    return projects


@pytest.fixture
def project_of(request: pytest.FixtureRequest):
    """row -> (the project it is a config of, the row with model.path set for hf rows)."""

    def find(row: Row) -> tuple[Path, Row]:
        if row.llama:
            return request.getfixturevalue({"llama": "project", "llama-pp": "pp_project"}[row.project]), row
        projects = request.getfixturevalue("hf_projects")
        return projects[row.project], replace(row, model={"path": str(projects[row.id])})

    return find


# test_offload_leaves_only_the_gathered_parameters_on_the_gpu's reference: 8b-offload-full without the offload.
ON_GPU = Row("8b-full", "8b", ac="full", extrapolated_from=(2, 3))
# test_the_simulated_step_is_affine_in_the_depth's rows, one of each mechanism whose peak the extrapolation puts at
# the whole depth (the output layer's backward with every block's activations, the loss under full AC with TP, the
# unsharded gradients of accumulation, the last block's backward, an hf model's with TP as it declares it),
# simulated at a third depth; and the cheapest one also at its whole depth.
COLLINEAR = ("1b-none", "1b-full", "1b-accum-last", "8b-headline", "70b-tp8-full", "hf-8b-tp2-none")
WHOLE = "1b-none"


def third_depth(row: Row) -> Row:
    """`row`'s model at the depth after its two (as far from the second as the second is from the first)."""
    first, second = row.extrapolated_from
    return row.at_depth(2 * second - first)


def whole_depth(row: Row) -> Row:
    """`row` simulated at its whole depth (no extrapolation)."""
    return replace(row, id=f"{row.id}-whole", extrapolated_from=())


BY_ID = {row.id: row for row in ROWS}
# Every simulation this file runs, grouped by project (SIMULATION_ORDER, below).
SIMULATED = [
    *(simulated for row in [*ROWS, ON_GPU] for simulated in row.simulated()),
    *(third_depth(BY_ID[row_id]) for row_id in COLLINEAR),
    whole_depth(BY_ID[WHOLE]),
]
MEASURED: dict[str, dict] = {}
SIMULATIONS: dict[str, dict] = {}  # simulate_rows' figures by the id of a row in SIMULATED, and its "blocks"
# The projects in the one simulating process, in turn (QLoRA's, whose nf4.py extends torch, last).
SIMULATION_ORDER = (
    "llama",
    "llama-pp",
    "hf",
    "hf-sft",
    "hf-lora",
    "hf-tp",
    "hf-tp-lora",
    "hf-pp",
    "hf-pp-lora",
    "hf-qlora",
)


def simulation_order(row: Row) -> tuple[int, str]:
    """Rows grouped by project, in SIMULATION_ORDER (a project kind it does not name: after them, by name)."""
    known = row.project in SIMULATION_ORDER
    return (SIMULATION_ORDER.index(row.project) if known else len(SIMULATION_ORDER), row.project)


SIMULATED.sort(key=simulation_order)


# test_script_prints_the_breakdown_and_refuses_bad_input's runs of the script's text output (GPUs "text:N"), in
# the same process as the matrix (first: the llama project's): a debug model on 2 GPUs, and --gpus 0.
TINY_TEXT = Row("tiny-text", "debug", gpus=2, seq_len=128, global_batch_size=8)
SCRIPT_RUNS = {"text": (TINY_TEXT, "text:2"), "bad": (TINY_TEXT, "text:0")}


def simulate_all(project_of) -> None:
    """Every simulation of SIMULATED, and the script's SCRIPT_RUNS, in one process (simulate_rows), once."""
    if SIMULATIONS:
        return
    runs = [*SCRIPT_RUNS.values(), *((row, str(row.gpus)) for row in SIMULATED)]
    located = [project_of(row) for row, _ in runs]
    configs = [write_row_config(project, row) for project, row in located]
    results = simulate_rows([project for project, _ in located], configs, [gpus for _, gpus in runs])
    for name, result in zip(SCRIPT_RUNS, results, strict=False):
        SCRIPT_OUTPUT[name] = result
    for row, sim in zip(SIMULATED, results[len(SCRIPT_RUNS) :], strict=True):
        SIMULATIONS[row.id] = {**sim, "blocks": row.blocks or row.full_depth}


SCRIPT_OUTPUT: dict[str, dict] = {}


def measured(project_of, row: Row) -> dict:
    """plan's and the simulation's figures for `row` ("sim": extrapolated to its whole depth where it says so; "at":
    the simulations it is from). The first row asked for simulates every row (SIMULATED) in one process
    (simulate_rows), grouped by project: each row once per test session, one import of torch and transformers, fake
    tensors' dispatch cache shared (a process per project cost 4 more imports of transformers; a process per row, a
    third more time on 1B rows)."""
    simulate_all(project_of)
    if row.id not in MEASURED:
        at = [SIMULATIONS[other.id] for other in row.simulated()]
        sim = extrapolate(row, at) if row.extrapolated_from else at[0]
        project, located = project_of(row)
        MEASURED[row.id] = {"plan": plan_bytes(write_row_config(project, located), located), "sim": sim, "at": at}
    return MEASURED[row.id]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_plan_is_within_10_percent_of_the_simulated_step(project_of, row: Row) -> None:
    figures = measured(project_of, row)
    plan, sim = figures["plan"], figures["sim"]
    # Extrapolated: the peak is at the same place at both depths (a block counted from the last one).
    assert len({peak_place(at) for at in figures["at"]}) == 1, [at["peak_at"] for at in figures["at"]]
    # The breakdown adds up to the simulated peak, and the allocator reserves at least what is allocated.
    parts = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
    assert sum(sim[part] for part in parts) == sim["allocated"], sim
    assert sim["allocated"] <= sim["reserved"] < 1.1 * sim["allocated"], sim
    for kind in ("allocated", "reserved"):
        off = difference(plan[kind], sim[kind])
        assert abs(off) <= TOLERANCE, f"{row.label}: plan {kind} {plan[kind]:,}, simulated {sim[kind]:,} ({off:+.1f}%)"


@pytest.mark.parametrize("row_id", ["hf-8b-lora-selective", "hf-8b-lora-tp2-selective"])
def test_plan_lora_flags_give_the_lora_rows_plan(project_of, row_id: str) -> None:
    """`plan --hf-config CONFIG.json --lora` (no project) plans the LoRA row's step as --config of the --lora project
    does, to the byte, so within 10% of its simulation too."""
    row = BY_ID[row_id]
    figures = measured(project_of, row)
    _, located = project_of(row)
    micro_batch = row.global_batch_size // (row.gpus // row.tp)
    request = build_request(hf_config=Path(located.model["path"]), lora=True, gpus=row.gpus, tp=row.tp,
                            precision="bf16", activation_checkpointing=row.ac, seq=row.seq_len, batch=micro_batch,
                            grad_accum_steps=row.grad_accum_steps, loss_chunks=row.loss_chunks)  # fmt: skip
    plan = estimate(request, with_levers=False)
    assert plan.per_gpu["total"] == figures["plan"]["allocated"]
    assert abs(difference(plan.per_gpu["total"], figures["sim"]["allocated"])) <= TOLERANCE


def test_every_pipeline_rank_is_within_10_percent_at_each_simulated_depth(project_of) -> None:
    """Each pipeline rank of a pp row whose schedule reaches its steady state (more micro-batches than stages: the
    first rank then holds its in-flight micro-batches beside its accumulated gradients, plan's bound) against plan at
    every depth the row is simulated at (the simulations the matrix ran): where a stage's fixed parts weigh most
    (the receive buffers, a block's backward temporaries, and before tensor_parallel.py split an untied embedding by
    its dimension the first stage's whole embedding gradient under tp: the 70B row's first stage was 18.8% under at
    4 blocks without them, 5% at its 80)."""
    rows = [row for row in ROWS if 1 < row.extra.get("parallel.pp", 1) < row.grad_accum_steps]
    assert rows
    simulate_all(project_of)
    for row in rows:
        for simulated in row.simulated():
            project, located = project_of(simulated)
            plan = estimate(build_request(config=write_row_config(project, located), gpus=row.gpus), with_levers=False)
            figures = SIMULATIONS[simulated.id]["pipeline_figures"]
            for rank, figure in zip(plan.pipeline["ranks"], figures, strict=True):
                off = difference(rank["total_bytes"], figure["allocated"])
                assert abs(off) <= TOLERANCE, f"{simulated.id} pipeline rank {rank['rank']}: {off:+.1f}%"


def test_offload_leaves_only_the_gathered_parameters_on_the_gpu(project_of) -> None:
    """CPU offload: the sharded parameters, gradients and AdamW state are not GPU memory in the simulation."""
    on_gpu = measured(project_of, ON_GPU)["sim"]
    offloaded = measured(project_of, next(row for row in ROWS if row.offload))["sim"]
    assert offloaded["optimizer_state"] == 0 and on_gpu["optimizer_state"] > 0
    assert on_gpu["allocated"] - offloaded["allocated"] >= on_gpu["optimizer_state"]


def test_the_simulated_step_is_affine_in_the_depth(project_of) -> None:
    """The extrapolation is exact: at a third depth every figure (the breakdown, allocated, reserved) is on the line
    of the two that the row is extrapolated from, to the byte, the peak at the same place; and a whole depth's
    simulation equals its extrapolation to the byte."""
    for row_id in COLLINEAR:
        row = BY_ID[row_id]
        points = [*measured(project_of, row)["at"], SIMULATIONS[third_depth(row).id]]
        assert len({peak_place(point) for point in points}) == 1, (row_id, [point["peak_at"] for point in points])
        for key in FIGURES:
            values = [point[key] for point in points]
            # equal steps between the depths first, second and 2 * second - first: one line
            assert values[2] - values[1] == values[1] - values[0], (row_id, key, values)
    whole = SIMULATIONS[whole_depth(BY_ID[WHOLE]).id]
    extrapolated = measured(project_of, BY_ID[WHOLE])["sim"]
    assert {key: whole[key] for key in FIGURES} == {key: extrapolated[key] for key in FIGURES}
    assert peak_place(whole) == peak_place(extrapolated)


def test_script_prints_the_breakdown_and_refuses_bad_input(project_of) -> None:
    """scripts/plan_memory.py's text (its main() without --json, in the matrix's process: SCRIPT_RUNS), and its
    refusal of --gpus 0: one line, exit 2, nothing on stdout."""
    simulate_all(project_of)
    result = SCRIPT_OUTPUT["text"]
    assert result["exit"] == 0, result["stderr"][-2000:]
    for line in ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "allocated (peak)",
                 "reserved (estimate)", "simulated: 2 GPU(s), micro-batch 4 x 128 tokens"):  # fmt: skip
        assert line in result["stdout"], (line, result["stdout"])
    bad = SCRIPT_OUTPUT["bad"]
    assert bad["exit"] == 2 and bad["stdout"] == ""
    assert bad["stderr"].strip().splitlines() == [
        "plan_memory.py: error: --gpus must be at least 1, got 0; give --gpus 1 or more"
    ]
    # --json: every row of the matrix is the script's main() with --json (simulate_rows.py), its line parsed.


def test_readme_table_is_the_matrix(project_of) -> None:
    """README.md's table is the matrix as this file measures it (FSDP2GEN_UPDATE_DOCS=1 writes it)."""
    text = README.read_text()
    head, found, rest = text.partition(TABLE_HEAD)
    assert found, "README.md has no plan-vs-simulation table"
    rows, _, tail = rest.partition("\n\n")
    expected = table(ROWS, {row.id: measured(project_of, row) for row in ROWS})
    if os.environ.get("FSDP2GEN_UPDATE_DOCS") == "1":
        README.write_text(head + expected + "\n" + tail)
        return
    assert TABLE_HEAD + rows + "\n" == expected
