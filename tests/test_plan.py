"""`fsdp2gen plan`: estimates checked against real FSDP2 runs of a generated project (torchrun, gloo on CPU),
against the template's model, against published Llama 3 parameter counts, and the CLI around them."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import math
import re
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_activations import head_activation_bytes
from fsdp2gen.plan_layout import (
    AC_MODES,
    GPUS,
    GRAD_SYNC_MODES,
    TEMPLATE_GRAD_SYNC,
    TEMPLATE_LOSS_CHUNKS,
    TEMPLATE_TRAINING,
    PlanRequest,
)
from fsdp2gen.plan_shapes import LLAMA_SIZES, TEMPLATE_MODEL, TEMPLATE_SIZES, parameter_count, parameter_shapes
from fsdp2gen.questions import questions
from fsdp2gen.sizes import LlamaShape, field_default
from tests.conftest import HELPERS, REPO, generate, invoke, torchrun_env
from tests.helpers.plan_simulation import simulate_rows
from tests.helpers.scripts import captured_in_this_process

TEMPLATE = REPO / "templates" / "project"
# The llama model as a --moe project renders it (the templates are Jinja; a dense project's has no experts).
MOE_GOLDEN = REPO / "generated_examples" / "llama-4gpu-bf16-moe-ep2"
LLAMA_MODEL = MOE_GOLDEN / "model.py"
LLAMA_ARGS = MOE_GOLDEN / "model_args.py"
# A tiny model, quick on 2 CPU cores. vocab_size 130 is not divisible by 4: FSDP2 pads the 4-rank shards.
TINY_CONFIG = """
[model]
dim = 64
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 130
ffn_dim = 172
max_seq_len = 64

[training]
seq_len = 32
global_batch_size = 8
"""


def dataclass_defaults(path: Path, class_name: str) -> dict[str, object]:
    """Field defaults of a dataclass in a source file, read with ast (the template imports torch)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        n.target.id: ast.literal_eval(field_default(n.value))
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None
    }


def test_template_defaults_are_the_ones_plan_assumes() -> None:
    assert dataclass_defaults(LLAMA_ARGS, "ModelArgs") == TEMPLATE_MODEL
    # config.py is a jinja template; its TrainingConfig is the same in every rendering (a golden's, here).
    training = dataclass_defaults(REPO / "generated_examples" / "llama-1gpu-fp32" / "config.py", "TrainingConfig")
    assert {key: training[key] for key in TEMPLATE_TRAINING} == TEMPLATE_TRAINING
    # training.grad_sync: its choices and default, from the template itself (the goldens may lag behind it).
    modes = ", ".join(f'"{mode}"' for mode in GRAD_SYNC_MODES)
    declared = f'grad_sync: Literal[{modes}] = setting("{TEMPLATE_GRAD_SYNC}", '
    assert declared in (TEMPLATE / "config.py.jinja").read_text()
    # (pp projects default to 1 chunk: the pipeline's loss is not chunked; plan does not model pp's loss chunks.)
    chunks = f"{{{{ 1 if pp > 1 else {TEMPLATE_LOSS_CHUNKS} }}}}"
    assert f"loss_chunks: int = setting({chunks}, " in (TEMPLATE / "config.py.jinja").read_text()
    assert f"\nloss_chunks = {chunks}\n" in (TEMPLATE / "config.toml.jinja").read_text()
    sizes = next(n for n in ast.parse(LLAMA_ARGS.read_text()).body if isinstance(n, ast.Assign)
                 and n.targets[0].id == "SIZES")  # fmt: skip
    assert ast.literal_eval(sizes.value) == TEMPLATE_SIZES


def load_template_module(name: str, path: Path) -> types.ModuleType:
    """The template file `path` imported as module `name` (its file name does not end in .py)."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_parameter_shapes_are_the_template_models_own() -> None:
    """Names, order and shapes equal Transformer.named_parameters() of the template's model.py (on meta)."""
    torch = pytest.importorskip("torch")
    # The template's model.py under a name of its own, so that no other `model` module is shadowed.
    # It imports sharded_init and schema, its siblings in the template, which are loaded the same way for the while.
    siblings = ["sharded_init", "schema", "data", "chunked_loss", "document_attention", "model_args", "moe"]
    for name in siblings:
        sys.modules[name] = load_template_module(name, MOE_GOLDEN / f"{name}.py")
    try:
        template_model = load_template_module("fsdp2gen_template_model", LLAMA_MODEL)
    finally:
        for name in siblings:
            del sys.modules[name]
    ModelArgs, Transformer = template_model.ModelArgs, template_model.Transformer
    dense = LlamaShape(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=200, vocab_size=300, max_seq_len=40)
    # And mixture-of-experts blocks after a dense one (router, stacked experts, shared experts: moe.py).
    moe = replace(dense, n_experts=4, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_dense_layers=1)
    for shape in (replace(dense, tie_embeddings=True), dense, moe):
        with torch.device("meta"):
            model = Transformer(ModelArgs(**{k: getattr(shape, k) for k in LlamaShape.__dataclass_fields__}))
        # A tied output weight is the embedding's parameter: named_parameters() lists it once.
        assert [(name, tuple(p.shape)) for name, p in model.named_parameters()] == parameter_shapes(shape)
    rope = sum(b.numel() * b.element_size() for b in model.buffers())
    request = PlanRequest(model=shape, label="t", gpus=1, seq_len=40, micro_batch=1, precision="fp32")
    assert estimate(request).per_gpu["model_buffers"] == rope


@pytest.mark.parametrize(
    "size,published,tied",
    [
        # Meta's model cards; 1b and 3b tie the output layer to the embedding, model.py does not.
        ("1b", 1_235_814_400, True),
        ("3b", 3_212_749_824, True),
        ("8b", 8_030_261_248, False),
        ("70b", 70_553_706_496, False),
        ("405b", 405_853_388_800, False),
    ],
)
def test_llama_presets_match_published_parameter_counts(size: str, published: int, tied: bool) -> None:
    shape = LLAMA_SIZES[size]
    untied_extra = shape.vocab_size * shape.dim if tied else 0
    assert parameter_count(shape) == published + untied_extra


def measure(groups: list[tuple[Path, list[Path]]], ranks: int, out: Path) -> list[dict]:
    """Run tests/helpers/plan_measure.py under torchrun with `ranks` gloo processes: each config's per-rank
    measurements, in order, every (project, configs) group in one launch."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += [str(HELPERS / "plan_measure.py"), str(out)]
    for index, (project, configs) in enumerate(groups):
        command += ["--"] * (index > 0) + [str(project), *map(str, configs)]
    result = subprocess.run(command, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


# Blocks outweigh the root (small vocabulary), and parameters outweigh activations: the gradients that
# accumulation keeps are a large part of the peak. Micro-batches of 1 sample of 16 tokens.
ACCUMULATION_CONFIG = """
[model]
dim = 128
n_layers = 8
n_heads = 4
n_kv_heads = 2
vocab_size = 256
ffn_dim = 344
max_seq_len = 64

[training]
seq_len = 16
global_batch_size = {batch}
grad_accum_steps = {accum}
grad_sync = "{sync}"
"""
RANKS = 4
# test_plan_matches_the_measured_peak_with_and_without_accumulation's cases: name -> (grad_accum_steps, grad_sync).
ACCUMULATION = {
    "no-accumulation": (1, "every_micro_batch"),
    "every-micro-batch": (2, "every_micro_batch"),
    "last-micro-batch": (2, "last_micro_batch"),
}


@pytest.fixture(scope="module")
def tp_projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """--tp 2 projects on 4 ranks (dp 2 x tp 2), fp32 and bf16."""
    root = tmp_path_factory.mktemp("tp-projects")
    return {precision: generate(root / precision, "--gpus", "4", f"--{precision}", "--tp", "2")
            for precision in ("fp32", "bf16")}  # fmt: skip


def tp_config(tied: bool) -> str:
    """The tiny model with tp = 2 (test_plan_matches_a_measured_tensor_parallel_run's), tied embeddings or not."""
    return (TINY_CONFIG.replace("[training]", f"tie_embeddings = {str(tied).lower()}\n\n[training]")
            + "\n[parallel]\ntp = 2\n")  # fmt: skip


# test_plan_matches_a_measured_tensor_parallel_run's cases: (precision, tied embeddings).
TP_CASES = [("fp32", False), ("bf16", True)]


@pytest.fixture(scope="module")
def runs(
    projects: dict[str, Path], tp_projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict]]:
    """name -> (config, measured) of every config this file measures, on RANKS ranks, in ONE launch (each launch of
    4 ranks costs ~10 CPU-seconds of imports): the tiny model in fp32 and bf16 ("tiny-fp32", "tiny-bf16":
    test_plan_matches_a_real_sharded_run's), the fp32 accumulation configs (ACCUMULATION) and the tiny model with
    TP 2 ("tp-fp32-untied", "tp-bf16-tied": test_plan_matches_a_measured_tensor_parallel_run's)."""
    root = tmp_path_factory.mktemp("plan-measured")
    texts = {
        "fp32": {"tiny-fp32": TINY_CONFIG} | {
            name: ACCUMULATION_CONFIG.format(batch=RANKS * accum, accum=accum, sync=sync)
            for name, (accum, sync) in ACCUMULATION.items()
        },
        "bf16": {"tiny-bf16": TINY_CONFIG},
        **{f"tp-{precision}": {f"tp-{precision}-{'tied' if tied else 'untied'}": tp_config(tied)}
           for precision, tied in TP_CASES},
    }  # fmt: skip
    project_of = projects | {f"tp-{precision}": project for precision, project in tp_projects.items()}
    configs: dict[str, Path] = {}
    for group in texts.values():
        for name, text in group.items():
            configs[name] = root / f"{name}.toml"
            configs[name].write_text(text)
    groups = [(project_of[key], [configs[name] for name in group]) for key, group in texts.items()]
    measured = measure(groups, RANKS, root / "measured.json")
    return {name: (config, run) for (name, config), run in zip(configs.items(), measured, strict=True)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_matches_a_real_sharded_run(runs: dict[str, tuple[Path, dict]], precision: str) -> None:
    """The tiny model on 4 ranks (vocab_size 130: FSDP2 pads the last shards), fp32 and bf16 (mixed precision)."""
    ranks = RANKS
    config, measured = runs[f"tiny-{precision}"]  # measured in the one launch of this file's configs
    result = invoke("plan", "--config", str(config), "--gpus", str(ranks), "--precision", precision, "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    per_gpu = plan["per_gpu_bytes"]
    assert measured["world_size"] == ranks == plan["setup"]["fsdp_ranks"]
    assert plan["setup"]["micro_batch"] == measured["ranks"][0]["micro_batch"] == 8 // ranks
    assert plan["model"]["parameters"] == measured["ranks"][0]["parameter_count"]
    # The plan is per GPU for the largest shard (rank 0's; later ranks hold FSDP2's padding): within 1%.
    for part in ("parameters", "gradients", "optimizer_state"):
        largest = max(rank[part] for rank in measured["ranks"])
        assert abs(per_gpu[part] - largest) <= 0.01 * largest, (part, per_gpu[part], largest)
    # The peak of autograd's saved tensors, the same on every rank (same micro-batch): within 25%.
    saved = {rank["activations"] for rank in measured["ranks"]}
    assert len(saved) == 1
    (saved_bytes,) = saved
    assert abs(per_gpu["activations"] - saved_bytes) <= 0.25 * saved_bytes, (per_gpu["activations"], saved_bytes)
    print(f"\n{ranks} ranks {precision}: plan {per_gpu} vs measured {measured['ranks']}")


@pytest.mark.parametrize("precision,tied", TP_CASES)
def test_plan_matches_a_measured_tensor_parallel_run(
    runs: dict[str, tuple[Path, dict]], precision: str, tied: bool
) -> None:
    """plan --tp 2 against the generated TP layout run on 4 ranks: each parameter's shard, the state bytes, the
    saved activations. Would fail if plan and train.py's apply_tensor_parallel split different modules (e.g.
    a replicated embedding/output or norms, full-vocabulary logits, or activations all divided by tp)."""
    config, measured = runs[f"tp-{precision}-{'tied' if tied else 'untied'}"]
    # No --tp: plan reads the project's parallel.tp from its config.toml.
    plan = plan_json("--config", str(config), "--gpus", "4", "--precision", precision)
    per_gpu, ranks = plan["per_gpu_bytes"], measured["ranks"]
    assert plan["setup"]["tp"] == 2 and plan["setup"]["fsdp_ranks"] == 2 and all(rank["tp"] == 2 for rank in ranks)
    assert plan["setup"]["micro_batch"] == ranks[0]["micro_batch"] == 4  # 8 samples over 2 data-parallel ranks
    assert plan["model"]["parameters"] == ranks[0]["parameter_count"]
    # Rank 0's shard of every parameter: plan's tensor-parallel shape, then FSDP's dim-0 chunk of it.
    shape = LlamaShape(**{k: plan["model"][k] for k in LlamaShape.__dataclass_fields__})
    expected = {name: [-(-dims[0] // 2), *dims[1:]] for name, dims in parameter_shapes(shape, tp=2)}
    assert ranks[0]["local_shapes"] == expected
    # The largest shard (rank 0's; FSDP2 pads the others to it): within 1%.
    for part in ("parameters", "gradients", "optimizer_state"):
        largest = max(rank[part] for rank in ranks)
        assert abs(per_gpu[part] - largest) <= 0.01 * largest, (part, per_gpu[part], largest)
    # Saved activations, the same on every rank (one micro-batch per tp group, each rank its 1/tp): within 2%.
    (saved_bytes,) = {rank["activations"] for rank in ranks}
    assert abs(per_gpu["activations"] - saved_bytes) <= 0.02 * saved_bytes, (per_gpu["activations"], saved_bytes)
    ranks = [{key: value for key, value in rank.items() if key != "local_shapes"} for rank in ranks]
    print(f"\ntp 2 x dp 2 {precision} tied={tied}: plan {per_gpu} vs measured {ranks}")


@pytest.mark.parametrize("case", list(ACCUMULATION))
def test_plan_matches_the_measured_peak_with_and_without_accumulation(
    runs: dict[str, tuple[Path, dict]], case: str
) -> None:
    """The generated train_step over grad_accum_steps micro-batches, measured tensor by tensor (plan_measure.py)."""
    ranks, (accum, sync) = RANKS, ACCUMULATION[case]
    config, run = runs[case]
    measured = run["ranks"]
    assert {(rank["grad_accum_steps"], rank["grad_sync"]) for rank in measured} == {(accum, sync)}
    plan = plan_json("--config", str(config), "--gpus", str(ranks), "--precision", "fp32")
    per_gpu = plan["per_gpu_bytes"]
    assert (plan["setup"]["grad_accum_steps"], plan["setup"]["grad_sync"]) == (accum, sync)
    # The state before the step (parameter and AdamW shards, rotary tables) plus the peak of forward/backward.
    peak = max(r["parameters"] + r["optimizer_state"] + r["buffers"] + r["peak_forward_backward"] for r in measured)
    assert abs(per_gpu["total"] - peak) <= 0.15 * peak, (per_gpu, peak)
    print(f"\n{ranks} ranks, accumulation {accum}, {sync}: plan {per_gpu['total']} vs measured {peak} "
          f"({per_gpu['total'] / peak - 1:+.1%})")  # fmt: skip
    if accum == 1:
        return
    # What the earlier micro-batches leave behind: the gradients, sharded (every_micro_batch) or the whole
    # model unsharded (last_micro_batch, ranks x the shard), plus the previous micro-batch's logits.
    held = max(rank["held_between_micro_batches"] for rank in measured)
    shard = max(rank["gradients"] for rank in measured)
    assert held / shard == pytest.approx(ranks if sync == "last_micro_batch" else 1, rel=0.05)
    planned = per_gpu["gradients"] + per_gpu["deferred_gradients"]
    assert abs(planned - held) <= 0.15 * held, (planned, held)
    # Modelled as the other mode, the plan would be more than 15% off: the measurement tells the modes apart.
    other = "every_micro_batch" if sync == "last_micro_batch" else "last_micro_batch"
    wrong = plan_json("--config", str(config), "--gpus", str(ranks), "--precision", "fp32", "--grad-sync", other)
    assert abs(wrong["per_gpu_bytes"]["total"] - peak) > 0.15 * peak, (wrong["per_gpu_bytes"], peak)


def test_last_micro_batch_adds_the_whole_models_unsharded_gradients() -> None:
    args = ["--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full", "--batch", "1"]
    every = plan_json(*args)
    last = plan_json(*args, "--grad-sync", "last_micro_batch")
    params = 8_030_261_248
    assert every["setup"]["grad_sync"] == "every_micro_batch" and every["per_gpu_bytes"]["deferred_gradients"] == 0
    assert last["setup"]["grad_sync"] == "last_micro_batch"
    # fp32 (reduce_dtype) gradients of the whole model on every GPU, instead of its 1/8 shard.
    assert last["per_gpu_bytes"]["deferred_gradients"] == 4 * params - 4 * params // 8
    assert last["per_gpu_bytes"]["total"] - every["per_gpu_bytes"]["total"] == 4 * params - 4 * params // 8
    text = invoke("plan", *args, "--grad-sync", "last_micro_batch").stdout
    assert "gradient sync: last_micro_batch (if accumulating)" in text
    assert "unsharded gradients (whole model fp32 - shards)" in text
    assert "unsharded gradients" not in invoke("plan", *args).stdout
    # With offload the shards live on the CPU, the unsharded gradients on the GPU.
    offloaded = plan_json(*args, "--grad-sync", "last_micro_batch", "--cpu-offload")["per_gpu_bytes"]
    assert offloaded["gradients"] == 0 and offloaded["deferred_gradients"] == 4 * params


def test_accumulation_is_a_memory_lever_only_with_every_micro_batch(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[model]\nsize = "8b"\n[training]\nseq_len = 8192\nglobal_batch_size = 64\ngrad_accum_steps = 4\n'
        'grad_sync = "last_micro_batch"\n'
    )
    ac = ["--activation-checkpointing", "layer"]
    last = plan_json("--config", str(config), "--gpus", "8", "--precision", "bf16", *ac)
    assert last["setup"]["grad_sync"] == "last_micro_batch" and not last["fits"]
    options = [lever["option"] for lever in last["levers"]]
    assert "--grad-sync every_micro_batch" in options
    # Halving the micro-batch doubles the accumulation: offered only together with every_micro_batch.
    batch = [option for option in options if option.startswith("--batch")]
    assert batch == ["--batch 1 (twice the grad_accum_steps) --grad-sync every_micro_batch"]
    every = plan_json("--config", str(config), "--gpus", "8", "--precision", "bf16", *ac,
                      "--grad-sync", "every_micro_batch")  # fmt: skip
    assert "--batch 1 (twice the grad_accum_steps)" in [lever["option"] for lever in every["levers"]]
    assert last["per_gpu_bytes"]["total"] > every["per_gpu_bytes"]["total"]


def plan_json(*args: str) -> dict:
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_chunked_loss_counts_one_chunk_of_the_logits(tmp_path: Path) -> None:
    # training.loss_chunks: the loss's fp32 log-softmax is that of one sequence chunk (chunked_loss.py), so the
    # activations fall by (1 - 1/chunks) of the whole logits, and nothing else changes.
    model = LLAMA_SIZES["8b"]
    logits = 4 * 2 * 8192 * model.vocab_size  # the reference's headline run: 8.4 GB per GPU
    assert head_activation_bytes(model, 2, 8192, 2) - head_activation_bytes(model, 2, 8192, 2, loss_chunks=8) == (
        logits - logits // 8
    )
    # tp 2: each rank's half of the vocabulary, chunked alike.
    assert head_activation_bytes(model, 2, 8192, 2, tp=2) - head_activation_bytes(
        model, 2, 8192, 2, tp=2, loss_chunks=4
    ) == 4 * 2 * (8192 - 2048) * (model.vocab_size // 2)
    plans = {}
    for chunks in (1, 8):
        config = tmp_path / f"chunks-{chunks}.toml"
        config.write_text(TINY_CONFIG + f"loss_chunks = {chunks}\n")
        plans[chunks] = plan_json("--config", str(config), "--gpus", "2")
        assert plans[chunks]["setup"]["loss_chunks"] == chunks
    whole, chunked = plans[1]["activations_bytes"], plans[8]["activations_bytes"]
    tokens = 4 * 32  # micro-batch 8 / 2 ranks, seq_len 32
    assert {mode: whole[mode] - chunked[mode] for mode in whole} == {mode: 4 * (tokens - tokens // 8) * 130
                                                                     for mode in whole}  # fmt: skip


def test_llama_8b_on_8_h100_needs_activation_checkpointing() -> None:
    plan = plan_json("--size", "8b", "--gpus", "8", "--precision", "bf16", "--seq", "8192", "--batch", "1")
    per_gpu = plan["per_gpu_bytes"]
    params = 8_030_261_248
    # Every matrix of the 8b model has a row count divisible by 8: shards are exactly 1/8, fp32.
    assert per_gpu["parameters"] == per_gpu["gradients"] == 4 * params // 8
    assert per_gpu["optimizer_state"] == 2 * 4 * params // 8 + 4 * (2 + 9 * 32 + 1)
    # The peak is the blocks' backward (every row but loss_backward) or the loss's, which adds at most loss_backward.
    in_blocks = sum(v for k, v in per_gpu.items() if k not in ("total", "loss_backward"))
    assert in_blocks <= per_gpu["total"] <= in_blocks + per_gpu["loss_backward"]
    activations = plan["activations_bytes"]
    assert activations["full"] < activations["selective"] < activations["layer"] < per_gpu["activations"]
    assert not plan["fits"]
    assert plan["levers"][0]["option"] == "--activation-checkpointing full" and plan["levers"][0]["fits"]
    savings = [lever["saves_bytes"] for lever in plan["levers"]]
    assert savings == sorted(savings, reverse=True)
    with_ac = plan_json("--size", "8b", "--gpus", "8", "--activation-checkpointing", "full")
    assert with_ac["fits"] and with_ac["levers"] == []
    assert with_ac["per_gpu_bytes"]["total"] == plan["levers"][0]["total_bytes"]


def test_reference_8b_headline_run_fits_an_h100_with_op_level_ac_and_the_chunked_loss() -> None:
    # torchtitan's headline run: 8 GPUs, local batch 2, seq 8192, bf16, op-level selective AC. Layer-level AC
    # (every 2nd block whole, what "selective" meant before issue 26) does not fit an 80 GB H100, and neither does
    # op-level AC with the whole logits (training.loss_chunks = 1): the loss's backward then holds 2 fp32
    # logits-sized tensors (15.7 GiB, measured by the simulated step: tests/test_plan_simulation.py). With the
    # template's 8 chunks it is one chunk's and the output layer's gradient.
    args = ("--size", "8b", "--gpus", "8", "--precision", "bf16", "--seq", "8192", "--batch", "2")
    op = plan_json(*args, "--activation-checkpointing", "selective", "--gpu-type", "h100-80gb")
    layer = plan_json(*args, "--activation-checkpointing", "layer", "--gpu-type", "h100-80gb")
    assert op["setup"]["loss_chunks"] == 8 and op["fits"] and not layer["fits"]
    request = build_request(
        size="8b", gpus=8, precision="bf16", seq=8192, batch=2, activation_checkpointing="selective"
    )
    whole = estimate(replace(request, loss_chunks=1), with_levers=False)
    assert whole.per_gpu["total"] > op["gpu"]["usable_bytes"]
    assert (
        round(op["per_gpu_bytes"]["total"] / 2**30, 1) == 56.3
        and round(op["per_gpu_bytes"]["loss_backward"] / 2**30, 2) == 2.94
        and round(whole.per_gpu["total"] / 2**30, 1) == 75.8
        and round(whole.per_gpu["loss_backward"] / 2**30, 1) == 15.7
        and round(layer["per_gpu_bytes"]["total"] / 2**30, 1) == 84.3
    )


def test_text_table_names_every_part_and_the_verdict() -> None:
    result = invoke("plan", "--size", "8b", "--gpus", "8", "--gpu-type", "h100-80gb")
    assert result.exit_code == 0 and result.stderr == ""
    text = result.stdout
    for row in (
        "parameters (fp32 shards = master weights)",
        "gradients (fp32 shards)",
        "optimizer state (AdamW: 2 fp32 states)",
        "all-gather buffers",
        "reduce-scatter buffers",
        "activations, no AC (used)",
        "activations, full AC",
        "total",
    ):
        assert row in text, row
    assert "h100-80gb: " in text and "does NOT fit" in text
    assert "largest lever: --activation-checkpointing full saves " in text and "fits)" in text


def test_offload_moves_the_state_off_the_gpu() -> None:
    on_gpu = plan_json("--size", "70b", "--gpus", "8", "--activation-checkpointing", "full")
    offloaded = plan_json("--size", "70b", "--gpus", "8", "--activation-checkpointing", "full", "--cpu-offload")
    state = ("parameters", "gradients", "optimizer_state")
    assert all(offloaded["per_gpu_bytes"][part] == 0 for part in state)
    assert offloaded["host_bytes_per_gpu"] == sum(on_gpu["per_gpu_bytes"][part] for part in state)
    difference = on_gpu["per_gpu_bytes"]["total"] - offloaded["per_gpu_bytes"]["total"]
    assert difference == offloaded["host_bytes_per_gpu"]


def test_more_gpus_shard_the_state_further_and_tp_splits_the_matrices() -> None:
    eight = plan_json("--size", "70b", "--gpus", "8")["per_gpu_bytes"]
    sixteen = plan_json("--size", "70b", "--gpus", "8", "--nodes", "2")["per_gpu_bytes"]
    assert sixteen["parameters"] * 2 == eight["parameters"]
    assert sixteen["activations"] == eight["activations"]
    tp = plan_json("--size", "70b", "--gpus", "8", "--nodes", "2", "--tp", "8")
    assert tp["setup"]["fsdp_ranks"] == 2
    # The layout train.py generates (test_plan_matches_a_measured_tensor_parallel_run measures it): everything
    # but the 2 x 80 + 1 norm vectors (replicated under TP) is split 8 ways, then sharded 2 ways.
    norms = (2 * 80 + 1) * 8192
    assert tp["per_gpu_bytes"]["parameters"] == 4 * ((70_553_706_496 - norms) // 16 + norms // 2)
    # Activations (bf16, 1 x 8192 tokens): every rank keeps 1/8 of what one rank keeps without TP, except the
    # full-sequence inputs of wq/wk/wv and w1/w3 (all-gathered; 80 blocks), of the output layer, the block
    # inputs' bf16 rotary tables, and the token ids and targets.
    tokens, bf16 = 8192, 2
    whole = 80 * (2 * bf16 * tokens * 8192 + 2 * tokens * 128 * bf16) + bf16 * tokens * 8192 + 2 * 8 * tokens + 4
    expected = (sixteen["activations"] - whole) / 8 + whole
    assert abs(tp["per_gpu_bytes"]["activations"] - expected) <= 81, (tp["per_gpu_bytes"]["activations"], expected)


def test_config_of_a_generated_project_reads_model_batch_and_answers() -> None:
    plan = plan_json(
        "--config", str(REPO / "generated_examples" / "llama-2node-bf16-slurm-reshard8-fullac-compile" / "config.toml")
    )
    assert plan["setup"] == {
        "gpus": 8,
        "nodes": 2,
        "world_size": 16,
        "fsdp_ranks": 8,  # parallel.dp_replicate = 2 (HSDP: 2 copies of 8 shards), as the project is configured
        "dp_replicate": 2,
        "tp": 1,
        "cp": 1,
        "ep": 1,
        "precision": "bf16",
        "offload": False,
        "ac": "full",  # parallel.activation_checkpointing
        "micro_batch": 2,  # global_batch_size 32 over 16 data ranks
        "seq_len": 256,
        "grad_accum_steps": 1,
        "grad_sync": "every_micro_batch",
        "loss_chunks": TEMPLATE_LOSS_CHUNKS,  # the file has none: the template's default
        # Groups of 8 of the 8 ranks a parameter is sharded over: resharded fully (train.py), no row kept gathered.
        "reshard_after_forward": 8,
        "reduce_dtype": "float32",
    }
    assert "kept_gathered" in plan["per_gpu_bytes"] and plan["per_gpu_bytes"]["kept_gathered"] == 0
    assert plan["model"]["dim"] == 256 and plan["model"]["n_layers"] == 4 and plan["model"]["vocab_size"] == 512
    # The keys that change memory in ways plan does not model are named, not silently planned as their defaults.
    assert [note.split(":")[0] for note in plan["unmodelled"]] == ["parallel.compile = true"]
    fp32 = plan_json("--config", str(REPO / "generated_examples" / "llama-1gpu-fp32" / "config.toml"))
    assert (fp32["setup"]["gpus"], fp32["setup"]["precision"], fp32["setup"]["micro_batch"]) == (1, "fp32", 32)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--size", "9b"], "--size 9b: unknown size; choose one of debug, 125m, 1b, 3b, 8b, 70b, 405b, debug-moe, "
         "qwen3-30b-a3b, deepseek-v3"),
        ([], "no model to plan; give --size (debug, 125m, 1b, 3b, 8b, 70b, 405b, debug-moe, qwen3-30b-a3b, "
             "deepseek-v3), --config PATH/config.toml or --hf-config PATH/config.json"),
        (["--size", "8b", "--tp", "3"], "--tp 3 does not divide 8 GPUs; choose a divisor"),
        (["--size", "8b", "--tp", "8", "--seq", "8196"],
         "--tp 8 must divide the sequence length (8196); change --seq or --tp"),
        (["--size", "8b", "--gpu-type", "tpu-v5"], "--gpu-type tpu-v5: unknown GPU; choose one of " + ", ".join(GPUS)),
        (["--size", "8b", "--batch", "0"], "--batch must be at least 1, got 0; give --batch 1 or more"),
        # The choices are the question's (copier.yml), checked by the option itself, as in `new`.
        (["--size", "8b", "--activation-checkpointing", "some"],
         "Invalid value for '--activation-checkpointing': 'some' is not one of 'none', 'selective', 'layer', 'full'."),
        (["--size", "8b", "--gpus", "1", "--tp", "2"], "--tp 2 does not divide 1 GPUs; choose a divisor"),
        (
            ["--size", "8b", "--grad-sync", "never"],
            "--grad-sync never: choose one of every_micro_batch, last_micro_batch",
        ),
        (["--size", "8b", "--config", "c.toml"], "--size and --config both given; the model comes from one of them"),
        (["--config", "no/c.toml"], "config file no/c.toml not found; pass a generated project's config.toml"),
        (
            ["--config", str(REPO / "generated_examples" / "llama-8gpu-bf16" / "config.toml"), "--gpus", "3"],
            "training.global_batch_size (32) is not divisible by 3 data-parallel ranks x grad_accum_steps (1); "
            "change the config or pass --batch",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_on_stderr_and_exit_2(args: list[str], message: str) -> None:
    result = invoke("plan", *args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}\n")


@pytest.mark.parametrize("option", ["--ac", "--offload", "--gpu", "--family"])
def test_plan_options_are_named_as_new_names_them(option: str) -> None:
    # --activation-checkpointing, --cpu-offload, --gpus as in `new` (--gpu-type: the GPU model); no --family: only
    # llama is planned, so plan offered an option it always refused.
    result = invoke("plan", "--size", "8b", option, "x")
    assert result.exit_code == 2 and result.stderr.startswith(f"fsdp2gen: error: No such option: {option}")
    help_text = invoke("plan", "--help").stdout
    for name in ("--activation-checkpointing", "--cpu-offload", "--gpus", "--nodes", "--precision", "--tp"):
        assert name in help_text
    assert "none|selective|layer|full" in help_text  # activation_checkpointing's choices, from copier.yml
    assert set(AC_MODES) == set(questions()["activation_checkpointing"].choice_values)


def test_bad_input_under_json_is_a_json_error() -> None:
    result = invoke("plan", "--size", "9b", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout) == {
        "error": "--size 9b: unknown size; choose one of debug, 125m, 1b, 3b, 8b, 70b, 405b, debug-moe, "
        "qwen3-30b-a3b, deepseek-v3",
        "code": 2,
    }


def test_bad_toml_is_bad_input(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[model]\ndim = 64\nheads = 4\n")
    result = invoke("plan", "--config", str(config))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"fsdp2gen: error: {config}: unknown key model.heads; known: size, dim, n_layers")
    config.write_text("[model\n")
    result = invoke("plan", "--config", str(config))
    assert result.exit_code == 2 and "invalid TOML" in result.stderr and result.stderr.count("\n") == 1


def test_help_lists_the_presets_and_gpus_that_exist() -> None:
    top = invoke("--help")
    assert top.exit_code == 0 and "check" in top.stdout and "plan" in top.stdout
    result = invoke("plan", "--help")
    assert result.exit_code == 0
    assert (
        "1b, 3b, 8b, 70b, 405b" in result.stdout
        and "qwen3-30b-a3b or deepseek-v3" in result.stdout
        and list(LLAMA_SIZES)
        == [
            "1b",
            "3b",
            "8b",
            "70b",
            "405b",
        ]
    )
    for gpu in ("h100-80gb", "a100-40gb", "h200-141gb"):
        assert gpu in GPUS and gpu in result.stdout


def test_config_size_preset_and_tied_embeddings(tmp_path: Path) -> None:
    # A project's config.toml names a size; the keys it sets override the size's; tying drops the output matrix.
    config = tmp_path / "config.toml"
    config.write_text('[model]\nsize = "1b"\ntie_embeddings = true\n\n[training]\nseq_len = 2048\n')
    model = plan_json("--config", str(config))["model"]
    assert (model["dim"], model["n_layers"], model["vocab_size"], model["tie_embeddings"]) == (2048, 16, 128256, True)
    assert model["parameters"] == 1_235_814_400  # Llama 3.2 1B, as published
    config.write_text('[model]\nsize = "1b"\nn_layers = 2\n')
    model = plan_json("--config", str(config))["model"]
    assert (model["n_layers"], model["dim"]) == (2, 2048)
    config.write_text('[model]\nsize = "2b"\n')
    result = invoke("plan", "--config", str(config))
    assert result.exit_code == 2
    assert (
        "model.size must be one of debug, 125m, 1b, 8b, debug-moe, qwen3-30b-a3b, deepseek-v3, got '2b'"
        in result.stderr
    )


def test_plan_states_rank_0_memory_for_a_full_checkpoint_as_written(tmp_path: Path) -> None:
    # checkpoint = "full": rank 0 gathers the weights and AdamW's moments in its CPU memory and writes them all.
    # What it writes (model.safetensors + train_state.pt of a real run) is what plan says it must hold.
    project = generate(tmp_path / "full", "--gpus", "1", "--fp32", "--checkpoint", "full")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG)
    # `python train.py` (one process, a group of one), run in this process (captured_in_this_process): a process of
    # its own would import torch again.
    run = ["--config", str(config), "--training.steps", "1", "--job.device", "cpu", "--job.output_dir"]
    code, _, stderr = captured_in_this_process(project, "train.py", *run, str(tmp_path / "out"))
    assert code == 0, stderr[-3000:]
    written = sum(p.stat().st_size for p in (tmp_path / "out" / "checkpoints" / "step-1").glob("*.*"))
    plan = plan_json("--config", str(config), "--gpus", "1")
    host = plan["full_checkpoint_rank0_host_bytes"]
    assert host == 3 * 4 * plan["model"]["parameters"] + 4 * 21  # 21 tensors: 2 blocks x 9, embedding, norm, output
    # The files add headers, the scheduler and RNG states (a few KiB): within 5% of the tiny model's 1.3 MB.
    assert abs(written - host) <= 0.05 * host, (written, host)
    text = invoke("plan", "--size", "8b", "--gpus", "8").stdout
    assert re.search(r"^rank 0 CPU memory to write a full checkpoint +89\.\d\d GiB$", text, flags=re.M), text


def test_reserved_adds_a_row_per_source_beyond_the_allocated_peak() -> None:
    """fsdp2gen/plan_reserved.py's rows, by hand for Llama 8B on 8 GPUs (one NCCL communicator, FSDP's)."""
    plan = plan_json("--size", "8b", "--activation-checkpointing", "selective")
    total, rows = plan["per_gpu_bytes"]["total"], plan["reserved_bytes_by_source"]
    mib = 2**20
    block = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096  # wq, wo, wk, wv, w1-3, 2 norms
    assert rows == {
        "allocator_rounding": math.ceil(total * 1.01) - total,
        # The peak is in the blocks' backward, which holds every all-gather and reduce-scatter buffer itself.
        "allocator_stream_pools": 0,
        # The largest short-lived request: a block's fp32 reduce-scatter input, in a segment rounded to 2 MiB.
        "allocator_fragmentation": math.ceil(4 * block / (2 * mib)) * 2 * mib,
        # 32 channels x 2 ring peers x (Simple 4 MiB + LL 512 KiB), for FSDP's one communicator.
        "nccl_buffers": 32 * 2 * (4 * mib + mib // 2),
    }
    assert plan["reserved_bytes_per_gpu"] == total + sum(rows.values())
    hsdp_tp = plan_json("--size", "8b", "--nodes", "2", "--dp-replicate", "2", "--tp", "2")
    assert hsdp_tp["reserved_bytes_by_source"]["nccl_buffers"] == 3 * rows["nccl_buffers"]  # dp_shard, dp_replicate, tp
    assert plan_json("--size", "debug", "--gpus", "1")["reserved_bytes_by_source"]["nccl_buffers"] == 0
    # Under pp the peak of the worst rank is its last backward: the reduce-scatter buffer is cached on its stream.
    pp = plan_json("--size", "8b", "--pp", "2", "--activation-checkpointing", "selective")
    assert pp["reserved_bytes_by_source"]["allocator_stream_pools"] == pp["per_gpu_bytes"]["reduce_scatter_buffers"]
    text = invoke("plan", "--size", "8b", "--activation-checkpointing", "selective").stdout
    for label in ("+ allocator rounding (512 B / 2 MiB blocks)", "+ allocator fragmentation (largest request)",
                  "+ NCCL buffers (outside the allocator)", "reserved (nvidia-smi less the CUDA context)"):  # fmt: skip
        assert label in text, label
    assert "FSDP streams' cached buffers" not in text  # 0: not printed


def test_the_simulation_of_a_pp_project_is_every_pipeline_ranks_and_refuses_several_stages_per_rank(
    tmp_path: Path,
) -> None:
    # scripts/plan_memory.py of a pp project runs torch's own schedule on each pipeline rank in turn (its stages told
    # the shapes they would exchange, which the fake process group cannot carry) and reports the worst, as plan does;
    # both ranks within 10% of plan's (tests/test_plan_simulation.py's hf pp row at real sizes). Several stages per
    # rank are several FSDP roots, which FSDPMemTracker cannot follow: one line naming the way out, exit 2.
    project = generate(tmp_path / "run", "--gpus", "4", "--pp", "2", "--fp32")
    # Both runs of scripts/plan_memory.py --gpus 4 in one process (simulate_rows: torch imported once): the refused
    # one's text output ("text:"), then the simulation's --json line.
    interleaved = "--parallel.pp_stages_per_rank 2 --parallel.pp_schedule Interleaved1F1B --training.grad_accum_steps 4"
    refused, result = simulate_rows(project, [project / "config.toml"] * 2, [f"text:4 {interleaved}", 4])
    assert (refused["exit"], refused["stdout"], refused["stderr"]) == (2, "", (
        "plan_memory.py: error: parallel.pp = 2 with pp_stages_per_rank 2 is not simulated (one stage per rank is); "
        "simulate with --parallel.pp_stages_per_rank 1 --parallel.pp_schedule 1F1B (`fsdp2gen plan` plans it)\n"
    ))  # fmt: skip
    plan = estimate(build_request(config=project / "config.toml", gpus=4), with_levers=False)
    planned = [rank["total_bytes"] for rank in plan.pipeline["ranks"]]
    assert len(result["pipeline_ranks"]) == 2 and result["allocated"] == max(result["pipeline_ranks"])
    assert result["pipeline_rank"] == plan.pipeline["worst_rank"]
    for rank, (sim, estimated) in enumerate(zip(result["pipeline_ranks"], planned, strict=True)):
        assert abs(estimated - sim) <= 0.1 * sim, (rank, estimated, sim)
