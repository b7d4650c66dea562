"""`fsdp2gen plan` against the simulation of the same training step (a project's scripts/plan_memory.py: its own
model and train.py under FakeTensorMode, the fake process group and torch's FSDPMemTracker).

A Row is one configuration: the config.toml keys it sets in a generated project (a llama one, or an hf one:
plain, --lora or --task sft, whose model.path is a folder holding only a config.json), and the options of plan that
say the same. tests/test_plan_simulation.py runs the matrix; README.md shows its table (`table`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_pp import stage_layers
from fsdp2gen.plan_shapes import TEMPLATE_SIZES

GIB = 2**30
# Llama 3 70B (Meta's config.json); the template's model.size names go up to 8b.
LLAMA_70B = {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672, "vocab_size": 128256,
             "max_seq_len": 8192}  # fmt: skip
# Llama 3.1 8B's config.json as Meta publishes it: the hf rows' model (config.json only: the simulation reads no
# weights, and plan reads this file).
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}  # fmt: skip
# Llama 3.1 70B's config.json (meta-llama/Llama-3.1-70B): the pipeline x tensor parallel row's model.
LLAMA_31_70B_CONFIG = {**LLAMA_31_8B_CONFIG, "hidden_size": 8192, "intermediate_size": 28672,
                       "num_attention_heads": 64, "num_hidden_layers": 80}  # fmt: skip
# Qwen3-30B-A3B's and Mixtral-8x7B's config.json as published (Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1):
# mixture-of-experts models, planned from config.json alone.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
# The hf rows' models, by the name a Row's model.path gives (the test writes each config.json, with a Row's
# `blocks`, in a folder of its own).
HF_CONFIGS = {
    "Llama-3.1-8B": LLAMA_31_8B_CONFIG,
    "Llama-3.1-70B": LLAMA_31_70B_CONFIG,
    "Qwen3-30B-A3B": QWEN3_30B_A3B_CONFIG,
    "Mixtral-8x7B": MIXTRAL_8X7B_CONFIG,
}
# The generated projects a row can be a config of: the llama ones (the test's OPTIONS, and the same with --pp 2), and
# hf ones (plain, --lora, --qlora, --task sft, --tp 2, --pp 2 --tp 2 (its rows set parallel.tp, 1 or more), --pp 2
# --lora, --tp 2 --lora).
LLAMA_PROJECTS = ("llama", "llama-pp")
PROJECTS = (*LLAMA_PROJECTS, "hf", "hf-lora", "hf-qlora", "hf-sft", "hf-tp", "hf-pp", "hf-pp-lora", "hf-tp-lora")


@dataclass(frozen=True)
class Row:
    """One configuration of the matrix: `project` (PROJECTS), `model` (model.size, or [model] keys; hf projects:
    model.path, set by the test), the parallel and training keys."""

    id: str
    model: str | dict = "1b"
    project: str = "llama"
    gpus: int = 8
    tp: int = 1
    ac: str = "none"
    offload: bool = False
    seq_len: int = 2048
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    grad_sync: str = "every_micro_batch"
    loss_chunks: int = 8  # the template's default; 1 is the whole logits
    extra: dict = field(default_factory=dict)  # more config keys: {"section.key": value}
    # The model's first `blocks` blocks only (0: all of them): llama's model.n_layers, an hf config.json's
    # num_hidden_layers. plan and the simulation both see the truncated model. The blocks repeat (the same shapes,
    # the same ops), so a few of them show what all of them do, at a fraction of the ops to simulate.
    blocks: int = 0
    # Simulate the model at these two depths (its first d1 and d2 blocks; () : at `blocks`, or whole) and extrapolate
    # every figure linearly to its whole depth, which plan plans. Exact in bytes once the peak's place is the same
    # at both depths (the loss, the output layer's backward, the last block's backward): each block then adds the
    # same bytes to every figure (its shards, AdamW state, saved activations, rounded blocks), and the rest (the
    # root's, the logits') stays. test_the_simulated_step_is_affine_in_the_depth proves it for rows of each kind.
    # Not for a row whose peak moves with the depth (selective AC's peak is the loss's at 8 of 8B's blocks, the
    # output layer's backward at 32): those keep their whole depth.
    extrapolated_from: tuple[int, int] | tuple[()] = ()

    def at_depth(self, blocks: int) -> Row:
        """This row's model cut to its first `blocks` blocks, simulated as it is."""
        return replace(self, id=f"{self.id}-at-{blocks}-blocks", blocks=blocks, extrapolated_from=())

    def simulated(self) -> list[Row]:
        """The rows the simulation runs for this one: itself, or its model at each depth it is extrapolated from."""
        return [self.at_depth(blocks) for blocks in self.extrapolated_from] or [self]

    def keys(self) -> dict[str, object]:
        """The config.toml keys this row sets, as "section.key"."""
        if isinstance(self.model, str):
            model = {"model.size": self.model}
        else:
            model = {f"model.{key}": value for key, value in self.model.items()}
        # The hf projects have no cpu_offload (generated without --cpu-offload), and parallel.tp only when
        # generated with --tp.
        llama = {"parallel.tp": self.tp, "parallel.cpu_offload": self.offload} if self.llama else {}
        llama |= {"parallel.tp": self.tp} if self.project in ("hf-tp", "hf-pp", "hf-tp-lora") else {}
        if self.blocks and self.llama:
            model["model.n_layers"] = self.blocks  # hf: the config.json the test writes for the row (hf_config)
        return (
            model
            | llama
            | {
                "parallel.activation_checkpointing": self.ac,
                "training.seq_len": self.seq_len,
                "training.global_batch_size": self.global_batch_size,
                "training.grad_accum_steps": self.grad_accum_steps,
                "training.grad_sync": self.grad_sync,
                "training.loss_chunks": self.loss_chunks,
            }
            | self.extra
        )

    @property
    def label(self) -> str:
        model = self.model if isinstance(self.model, str) else "70b" if self.model == LLAMA_70B else "custom"
        depth = f" ({self.blocks} of its {self.full_depth} blocks)" if self.blocks else ""
        if self.extrapolated_from:
            depth = " (simulated at {} and {} of its {} blocks, extrapolated)".format(
                *self.extrapolated_from, self.full_depth
            )
        name = f"llama {model}{depth}"
        if not self.llama:
            lora = ", LoRA rank 16 (7 targets)"
            kinds = {"hf": "", "hf-lora": lora, "hf-sft": ", task sft", "hf-tp": "", "hf-pp": "", "hf-pp-lora": lora,
                     "hf-tp-lora": lora,
                     "hf-qlora": ", QLoRA rank 16 (7 targets, NF4 base)"}  # fmt: skip
            kind = kinds[self.project]
            name = f"hf {self.model['path']} config.json{depth}{kind}"  # type: ignore[index]
        pp = self.extra.get("parallel.pp", 1)
        parts = [name, f"{self.gpus} GPUs"] + ([f"TP {self.tp}"] if self.tp > 1 else [])
        parts += [f"PP {pp} (1F1B)"] if pp > 1 else []
        replicas = self.extra.get("parallel.dp_replicate", 1)
        parts += [f"HSDP {replicas} x {self.gpus // replicas}"] if replicas > 1 else []
        micro_batch = self.global_batch_size // (self.gpus // self.tp // pp * self.grad_accum_steps)
        parts += [f"AC {self.ac}", f"micro-batch {micro_batch} x {self.seq_len}"]
        if self.grad_accum_steps > 1:  # under PP the schedule's micro-batches (grad_sync does not apply)
            parts.append(
                f"{self.grad_accum_steps} micro-batches"
                if pp > 1
                else f"accum {self.grad_accum_steps} {self.grad_sync}"
            )
        parts += ["CPU offload"] if self.offload else []
        reshard = self.extra.get("parallel.reshard_after_forward", True)
        parts += [] if reshard is True else [f"reshard_after_forward {str(reshard).lower()}"]
        reduce_dtype = self.extra.get("parallel.reduce_dtype", "float32")
        parts += [] if reduce_dtype == "float32" else [f"reduce_dtype {reduce_dtype}"]
        return ", ".join(parts + (["whole logits (loss_chunks 1)"] if self.loss_chunks == 1 else []))

    @property
    def llama(self) -> bool:
        """Whether the row is a config of a llama project (model.size and the llama keys), not an hf one."""
        return self.project in LLAMA_PROJECTS

    @property
    def full_depth(self) -> int:
        """The number of blocks of the whole model."""
        if not self.llama:
            return HF_CONFIGS[self.model["path"]]["num_hidden_layers"]  # type: ignore[index]
        return TEMPLATE_SIZES[self.model]["n_layers"] if isinstance(self.model, str) else self.model["n_layers"]

    def hf_config(self) -> dict:
        """An hf row's config.json (model.path: HF_CONFIGS' name), with the row's `blocks`."""
        config = HF_CONFIGS[self.model["path"]]  # type: ignore[index]
        return {**config, "num_hidden_layers": self.blocks} if self.blocks else config


def write_config(project: Path, row: Row) -> Path:
    """project/<row id>.toml: the project's config.toml with the row's keys set (its other keys as generated)."""
    text = (project / "config.toml").read_text()
    for dotted, value in row.keys().items():
        section, key = dotted.split(".")
        literal = json.dumps(value)  # a TOML literal for str, int and bool alike
        line = re.compile(rf"^{key} = [^\n#]*?([ \t]*#[^\n]*)?$", re.M)
        body = re.search(rf"^\[{section}\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        assert body is not None, section
        match = line.search(body[1])
        if match:
            replaced = body[1][: match.start()] + f"{key} = {literal}{match[1] or ''}" + body[1][match.end() :]
        else:
            replaced = f"{key} = {literal}\n" + body[1]
        text = text[: body.start(1)] + replaced + text[body.end(1) :]
    path = project / f"{row.id}.toml"
    path.write_text(text)
    return path


def plan_bytes(config: Path, row: Row) -> dict[str, int]:
    """`fsdp2gen plan --config` of the row: per-GPU allocated and reserved bytes. The row's AC and offload are keys of
    its config.toml, which plan reads (as configured); only the GPUs are a flag (the project was generated for 8)."""
    request = build_request(config=config, gpus=row.gpus)
    plan = estimate(request, with_levers=False)
    # The simulation rounds each live tensor as the allocator does, and sees nothing else of plan_reserved.py's rows
    # (no CUDA streams, no history of steps, no NCCL): the rows both have.
    return {
        "allocated": plan.per_gpu["total"],
        "reserved": plan.per_gpu["total"] + plan.reserved_rows["allocator_rounding"],
    }


def simulate(project: Path, config: Path, gpus: int) -> dict:
    """scripts/plan_memory.py --json of the project, run by this Python (the project's own dependencies)."""
    result = subprocess.run(
        [sys.executable, "scripts/plan_memory.py", "--config", str(config), "--gpus", str(gpus), "--json"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def simulate_rows(projects: Path | list[Path], configs: list[Path], gpus: list[int | str]) -> list[dict]:
    """simulate() of each config in one process (simulate_rows.py): the same JSON, torch and transformers imported
    once, and the fake tensors' dispatch cache shared by rows of the same shapes. `projects`: the project of every
    config, or one project per config (keep a project's configs together: its modules are imported once a run).
    `gpus`: the number, or "N more-arguments", or "text:N ...": the text run's {"stdout", "stderr", "exit"}."""
    if isinstance(projects, Path):
        projects = [projects] * len(configs)
    triples = [str(value) for row in zip(projects, configs, gpus, strict=True) for value in row]
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "simulate_rows.py"), *triples],
        capture_output=True,
        text=True,
        timeout=3600,  # every row of the matrix: minutes on 2 cores, many more on a loaded machine
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()[-len(configs) :]
    return [json.loads(line) for line in lines]


# The simulation's figures in bytes (simulate_rows' JSON): the breakdown, and the peak and reserved totals.
FIGURES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "allocated", "reserved")


def peak_place(simulated: dict) -> str:
    """Where the simulation's peak is (its peak_at), a block counted from the last one ("layers.-1": the last block,
    "layers.-2": the one before): the same place at every depth once it is the steady state's. Under pipeline
    parallelism (its "pipeline_rank" given) from the last block of that rank's stage."""
    return re.sub(
        r"layers\.(\d+)", lambda match: f"layers.{int(match[1]) - stage_end(simulated)}", simulated["peak_at"]
    )


def stage_end(simulated: dict) -> int:
    """The index after the last block of the simulated rank's blocks: the model's depth, or under pipeline parallelism
    (one stage per rank) its pipeline rank's stage's end, as the project's pipeline.py splits the blocks evenly."""
    if "pipeline_rank" not in simulated:
        return simulated["blocks"]
    stages = stage_layers(simulated["blocks"], len(simulated["pipeline_ranks"]))
    return stages[simulated["pipeline_rank"]].stop


def extrapolate(row: Row, simulated: list[dict]) -> dict:
    """Every figure of `row` at its whole depth from its simulations at the depths row.extrapolated_from (in order):
    the second one's, plus its difference from the first one per block times the blocks left. Under pipeline
    parallelism every pipeline rank's figures (pipeline_figures), each at the same place at both depths, and the
    worst at the whole depth reported (a rank that holds more micro-batches in flight may pass the last stage)."""
    (first, second), (at_first, at_second) = row.extrapolated_from, simulated
    steps, rest = divmod(row.full_depth - second, second - first)
    assert rest == 0, f"{row.id}: {row.full_depth} blocks are not {second} + a multiple of {second - first}"
    if "pipeline_figures" not in at_second:
        return _extrapolated(row, at_first, at_second, steps)
    ranks = []
    for rank, (one, two) in enumerate(zip(at_first["pipeline_figures"], at_second["pipeline_figures"], strict=True)):
        pipeline = {"pipeline_rank": rank, "pipeline_ranks": at_second["pipeline_ranks"]}
        one, two = {**one, **pipeline, "blocks": first}, {**two, **pipeline, "blocks": second}
        assert peak_place(one) == peak_place(two), (row.id, rank, one["peak_at"], two["peak_at"])
        ranks.append(_extrapolated(row, one, two, steps))
    worst = max(ranks, key=lambda figures: figures["allocated"])
    return {**worst, "pipeline_ranks": [figures["allocated"] for figures in ranks]}


def _extrapolated(row: Row, at_first: dict, at_second: dict, steps: int) -> dict:
    """extrapolate's figures of one simulated rank, its peak's place moved to the same block of the whole depth."""
    figures = {key: at_second[key] + steps * (at_second[key] - at_first[key]) for key in FIGURES}
    whole = {**at_second, **figures, "blocks": row.full_depth}
    shift = stage_end(whole) - stage_end(at_second)
    place = re.sub(r"layers\.(\d+)", lambda match: f"layers.{int(match[1]) + shift}", at_second["peak_at"])
    return {**whole, "peak_at": place}


def difference(plan: int, simulated: int) -> float:
    """plan relative to the simulation, in %."""
    return 100 * (plan - simulated) / simulated


TABLE_HEAD = (
    "| Configuration (bf16, Llama 3 shapes) | plan allocated | simulated allocated | difference | plan reserved | "
    "simulated reserved | simulated peak: params / grads / AdamW / activations / temporaries (GiB) |\n"
    "|---|---|---|---|---|---|---|\n"
)


def table(rows: list[Row], results: dict[str, dict]) -> str:
    """The README's table of the matrix, one line per row, from the measured `results` (row id -> figures)."""
    lines = []
    for row in rows:
        r = results[row.id]
        plan, sim = r["plan"], r["sim"]
        off = difference(plan["allocated"], sim["allocated"])
        parts = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
        breakdown = " / ".join(f"{sim[part] / GIB:.2f}" for part in parts)
        lines.append(
            f"| {row.label} | {plan['allocated'] / GIB:.2f} GiB | {sim['allocated'] / GIB:.2f} GiB | {off:+.1f}% | "
            f"{plan['reserved'] / GIB:.2f} GiB | {sim['reserved'] / GIB:.2f} GiB | {breakdown} |"
        )
    return TABLE_HEAD + "\n".join(lines) + "\n"
