"""`fsdp2gen plan` for the hf family: the parameters plan derives from a config.json (no torch, no transformers)
are exactly those transformers builds, on the meta device, name by name; LoRA's trainable subset is exactly what
peft and a generated --lora project build; plans of rendered hf, LoRA and SFT projects; bad config.json input is one
line and exit code 2, for listed cases and for documents nobody listed (hypothesis).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp2gen import plan_pp
from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_activations import activations_by_mode
from fsdp2gen.plan_families import ATTENTION, MLP, HfConfigError, LoraSpec, read_hf_config
from fsdp2gen.plan_layout import PlanRequest
from fsdp2gen.plan_shapes import parameter_shapes
from tests.conftest import generate, invoke, project_modules, save_tiny_llama
from tests.helpers.plan_simulation import MIXTRAL_8X7B_CONFIG, QWEN3_30B_A3B_CONFIG
from tests.test_generator_properties import assert_contract

PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
# config.json keys plan takes transformers' defaults for when they are left out.
OPTIONAL = ("num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias",
            "max_position_embeddings")  # fmt: skip


def config_class(model_type: str):
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
            "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[model_type]  # fmt: skip


def transformers_parameters(config_json: Path, lora: LoraSpec | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """named_parameters() of AutoModelForCausalLM.from_config(config.json) on the meta device (with peft's adapters)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_json.parent))
        if lora is not None:
            from peft import LoraConfig, inject_adapter_in_model

            inject_adapter_in_model(LoraConfig(r=lora.rank, target_modules=list(lora.targets)), model)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()], [
        name for name, p in model.named_parameters() if p.requires_grad
    ]


def save_config(folder: Path, model_type: str, drop: tuple[str, ...] = (), **keys) -> Path:
    """config.json as save_pretrained writes it for `keys`, then without the keys in `drop` (as older or
    hand-written files leave them out)."""
    folder.mkdir(parents=True, exist_ok=True)
    config_class(model_type)(**keys).save_pretrained(folder)
    path = folder / "config.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({key: value for key, value in written.items() if key not in drop}))
    return path


CASES = {
    "llama-untied-gqa": ("llama", {"num_key_value_heads": 2, "intermediate_size": 128}),
    "llama-tied-biases": (
        "llama",
        {"intermediate_size": 96, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    ),  # fmt: skip
    "qwen2-tied": ("qwen2", {"intermediate_size": 128, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3-head-dim-32": ("qwen3", {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 32}),
    "mistral-head-dim-8": ("mistral", {"intermediate_size": 160, "num_key_value_heads": 1, "head_dim": 8}),
    # Mixture of experts: 8 experts of hidden 24, each token to 2 (top-k weights renormalised or not); Qwen3-MoE's
    # block 1 a dense MLP (mlp_only_layers), or every second block routed (decoder_sparse_step 2: block 0 dense).
    "qwen3-moe-mlp-only": ("qwen3_moe", {"intermediate_size": 96, "num_key_value_heads": 2, "head_dim": 16,
                                         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                         "mlp_only_layers": [1]}),
    "qwen3-moe-step-2-normalised": ("qwen3_moe", {"intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 3,
                                                  "moe_intermediate_size": 40, "decoder_sparse_step": 2,
                                                  "norm_topk_prob": True, "attention_bias": True}),
    "mixtral": ("mixtral", {"intermediate_size": 24, "num_key_value_heads": 2, "num_local_experts": 8}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_hf_parameter_shapes_are_what_transformers_builds(case: str, tmp_path: Path) -> None:
    model_type, keys = CASES[case]
    path = save_config(tmp_path, model_type, **SMALL, **keys)
    expected, _ = transformers_parameters(path)
    shapes = parameter_shapes(read_hf_config(path))
    assert shapes == expected
    assert sum(math.prod(s) for _, s in shapes) == sum(math.prod(s) for _, s in expected)


@PROPERTY
@given(
    model_type=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
    heads=st.sampled_from([2, 4, 8]),
    kv_divisor=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([None, 8, 24]),
    layers=st.integers(1, 3),
    vocab=st.integers(7, 300),
    ffn=st.integers(1, 200),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    drop=st.sets(st.sampled_from(OPTIONAL)),
)
def test_left_out_keys_take_transformers_defaults(model_type, heads, kv_divisor, head_dim, layers, vocab, ffn,
                                                  flags, drop) -> None:  # fmt: skip
    # Any shape, any of the optional keys left out of config.json: plan's parameters are still transformers' own.
    tied, attention_bias, mlp_bias = flags
    keys = {"hidden_size": 16 * heads, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads // kv_divisor, "vocab_size": vocab, "intermediate_size": ffn,
            "tie_word_embeddings": tied, "attention_bias": attention_bias, "mlp_bias": mlp_bias}  # fmt: skip
    if head_dim:
        keys["head_dim"] = head_dim
    with tempfile.TemporaryDirectory() as tmp:
        path = save_config(Path(tmp), model_type, tuple(drop), **keys)
        from transformers import AutoConfig

        kv_heads = AutoConfig.from_pretrained(tmp).num_key_value_heads
        if heads % kv_heads:  # e.g. Qwen2's default of 32 with 2 heads: transformers builds a model that cannot run
            with pytest.raises(HfConfigError, match=rf"must be a multiple of num_key_value_heads \({kv_heads}\)"):
                read_hf_config(path)
            return
        expected, _ = transformers_parameters(path)
        assert parameter_shapes(read_hf_config(path)) == expected


TARGETS = st.lists(st.sampled_from([*ATTENTION, *MLP, "self_attn.v_proj", "mlp.down_proj"]), min_size=1, unique=True)


@PROPERTY
@given(model_type=st.sampled_from(["llama", "qwen2", "mistral"]), rank=st.integers(1, 20), targets=TARGETS)
def test_lora_adapters_and_trainable_subset_are_what_peft_builds(model_type: str, rank: int, targets: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = save_config(Path(tmp), model_type, **SMALL, intermediate_size=96, num_key_value_heads=2)
        lora = LoraSpec(rank=rank, targets=tuple(targets))
        expected, trainable = transformers_parameters(path, lora)
        model = replace(read_hf_config(path), lora=lora)
        shapes = parameter_shapes(model)
        assert shapes == expected
        plan = estimate(PlanRequest(model=model, label="lora", gpus=2, seq_len=32, micro_batch=1))
        assert plan.trainable == sum(math.prod(dict(expected)[name]) for name in trainable)
        assert sorted(trainable) == sorted(name for name, _ in shapes if ".lora_" in name)


def saved_block_bytes(config_json: Path, lora: LoraSpec | None, dtype: str, tokens: tuple[int, int]) -> int:
    """Bytes autograd keeps for backward in one transformers decoder block's forward (train mode, `dtype`: the
    dtype mixed precision computes in), told apart by storage: every saved tensor of the graph, the block's input
    included, less the parameters and rotary's cos and sin (computed once per forward, shared by every block)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_json.parent))
    if lora is not None:
        from peft import LoraConfig, inject_adapter_in_model

        settings = LoraConfig(r=lora.rank, target_modules=list(lora.targets), lora_dropout=lora.dropout)
        inject_adapter_in_model(settings, model)
    model.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])).train()
    x = torch.randn(*tokens, model.config.hidden_size, dtype=model.dtype, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(tokens[1])[None].expand(*tokens))
    out = model.model.layers[0](x, position_embeddings=cos_sin, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    skip = {t.untyped_storage().data_ptr() for t in (*cos_sin, *model.parameters())}
    found, stack, seen = {}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attribute in dir(node):
            if not attribute.startswith("_saved_"):
                continue
            value = getattr(node, attribute)
            for tensor in value if isinstance(value, tuple) else (value,):
                # (0-dim tensors are scalars, e.g. peft's alpha / rank as a float64 tensor.)
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.dim()
                    and tensor.untyped_storage().data_ptr() not in skip
                ):
                    found[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        stack += [parent for parent, _ in node.next_functions]
    return sum(found.values())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_a_transformers_blocks_saved_activations_are_plans(case: str, dtype: str, tmp_path: Path) -> None:
    from fsdp2gen.plan_families import hf_block_activation_bytes

    model_type, keys = CASES[case]
    path = save_config(tmp_path, model_type, **{**SMALL, **keys, "num_hidden_layers": 1})
    compute = {"fp32": 4, "bf16": 2}[dtype]
    measured = saved_block_bytes(path, None, dtype, (2, 8))
    assert measured == hf_block_activation_bytes(read_hf_config(path), 2, 8, compute)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    model_type=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
    rank=st.integers(1, 12),
    targets=TARGETS,
    dropout=st.sampled_from([0.0, 0.1]),
    dtype=st.sampled_from(["fp32", "bf16"]),
)
def test_lora_changes_a_blocks_saved_activations_as_plan_counts(model_type, rank, targets, dropout, dtype) -> None:
    # Frozen weights keep no inputs, adapters keep theirs and lora_A's output: measured on the real block.
    from fsdp2gen.plan_families import lora_activation_delta

    with tempfile.TemporaryDirectory() as tmp:
        path = save_config(Path(tmp), model_type, **{**SMALL, "num_hidden_layers": 1}, intermediate_size=96,
                           num_key_value_heads=2, attention_dropout=0.0)  # fmt: skip
        lora = LoraSpec(rank=rank, targets=tuple(targets), dropout=dropout)
        full = saved_block_bytes(path, None, dtype, (2, 8))
        adapted = saved_block_bytes(path, lora, dtype, (2, 8))
        model = replace(read_hf_config(path), lora=lora)
        compute = {"fp32": 4, "bf16": 2}[dtype]
        # Dropout on a GPU (fused native_dropout) keeps a bool mask, plan's figure; on CPU it keeps the random
        # mask in the compute dtype: (compute - 1) more bytes per element of each adapted layer's input.
        widths = {"down_proj": 96}
        cpu_mask = sum((compute - 1) * 16 * widths.get(layer.rsplit(".")[-1], 64) for layer in set(
            name.rsplit(".", 3)[0] for name, _ in parameter_shapes(model) if ".lora_A." in name
        )) if dropout else 0  # fmt: skip
        assert adapted - full == lora_activation_delta(model, 2, 8, compute) + cpu_mask


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated hf projects on a tiny pretrained Llama (2 layers, hidden 64, vocabulary 320): plain, --lora,
    --task sft."""
    root = tmp_path_factory.mktemp("plan-families")
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    special = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
    model = save_tiny_llama(root / "model", "the cat sat on the mat " * 50, special, chat_template=template)
    common = ["--family", "hf", "--hf-model", str(model), "--gpus", "2", "--fp32"]
    return {
        "hf": generate(root / "hf", *common),
        "lora": generate(root / "lora", *common, "--lora"),
        "sft": generate(root / "sft", *common, "--task", "sft"),
        "model": model,
    }


def probe(project: Path) -> dict:
    """The project's own model (its model.build_model, from its config.toml, on meta, as train.py builds it),
    imported in this process (project_modules; transformers and peft are imported here already): parameters
    (name, shape, requires_grad) and buffers."""
    import torch

    with project_modules(project):
        from config import load_config
        from model import build_model

        config = load_config(str(project / "config.toml"))
        with torch.device("meta"):
            model = build_model(config)
    parameters = [[name, list(p.shape), p.requires_grad] for name, p in model.named_parameters()]
    return {"parameters": parameters, "buffers": {name: list(b.shape) for name, b in model.named_buffers()}}


def plan_json(*args: str) -> dict:
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("kind", ["hf", "lora", "sft"])
def test_plan_of_a_generated_hf_project_counts_the_projects_own_model(projects: dict, kind: str) -> None:
    config = projects[kind] / "config.toml"
    built = probe(projects[kind])
    model = read_hf_config(projects["model"])
    plan = plan_json("--config", str(config), "--seq", "64")  # the tiny model's max_position_embeddings
    # Every parameter the project builds (adapters included), and the trainable ones, as plan counts them.
    assert plan["model"]["parameters"] == sum(math.prod(shape) for _, shape, _ in built["parameters"])
    assert plan["model"]["trainable_parameters"] == sum(math.prod(s) for _, s, grad in built["parameters"] if grad)
    assert plan["model"]["source"] == str(projects["model"] / "config.json")
    assert plan["model"]["task"] == ("sft" if kind == "sft" else "pretrain")
    # transformers' rotary keeps only inv_freq and its copy (head_dim / 2 fp32 each) as buffers.
    assert plan["per_gpu_bytes"]["model_buffers"] == 4 * sum(math.prod(s) for s in built["buffers"].values())
    assert (plan["setup"]["gpus"], plan["setup"]["precision"], plan["setup"]["micro_batch"]) == (2, "fp32", 16)
    text = invoke("plan", "--config", str(config), "--seq", "64").stdout
    assert f"model source: {projects['model'] / 'config.json'} (Hugging Face llama)" in text
    assert ("LoRA rank 16 on q_proj" in text) == (kind == "lora")
    assert ("task sft: the memory of pretraining" in text) == (kind == "sft")
    if kind == "hf":
        assert plan["model"]["parameters"] == plan["model"]["trainable_parameters"] == model_count(model)


def model_count(model) -> int:
    return sum(math.prod(shape) for _, shape in parameter_shapes(model))


def test_lora_state_is_the_adapters_only_and_sft_is_pretraining(projects: dict) -> None:
    hf, lora, sft = (
        plan_json("--config", str(projects[k] / "config.toml"), "--seq", "64") for k in ("hf", "lora", "sft")
    )
    adapters = lora["model"]["trainable_parameters"]
    assert adapters == 2 * 16 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 64 + 128 + 64 + 128 + 128 + 64)
    # 2 ranks: gradients and AdamW's two moments of the adapters' shards (rows padded to even), one step per tensor.
    assert lora["per_gpu_bytes"]["gradients"] == 4 * adapters // 2
    assert lora["per_gpu_bytes"]["optimizer_state"] == 8 * adapters // 2 + 4 * 28
    assert lora["per_gpu_bytes"]["parameters"] == hf["per_gpu_bytes"]["parameters"] + 4 * adapters // 2
    # A full checkpoint would hold every weight but AdamW's moments of the adapters only.
    assert lora["full_checkpoint_rank0_host_bytes"] == 4 * lora["model"]["parameters"] + 8 * adapters + 4 * 28
    # Without LoRA every parameter has a gradient shard.
    assert hf["per_gpu_bytes"]["gradients"] == hf["per_gpu_bytes"]["parameters"] > lora["per_gpu_bytes"]["gradients"]
    assert sft["per_gpu_bytes"] == hf["per_gpu_bytes"] and sft["activations_bytes"] == hf["activations_bytes"]


def test_hf_config_plans_a_model_without_a_project(projects: dict) -> None:
    plan = plan_json("--hf-config", str(projects["model"] / "config.json"), "--seq", "64", "--batch", "2")
    assert plan["model"]["parameters"] == model_count(read_hf_config(projects["model"]))
    assert (plan["model"]["model_type"], plan["setup"]["seq_len"], plan["setup"]["micro_batch"]) == ("llama", 64, 2)
    # The folder itself works too.
    assert plan_json("--hf-config", str(projects["model"]), "--seq", "8")["model"] == plan["model"]
    # The model's own limit, as the project's preflight checks it.
    result = invoke("plan", "--config", str(projects["hf"] / "config.toml"))
    assert (result.exit_code, result.stderr) == (
        2,
        (
            "fsdp2gen: error: seq_len 256 exceeds the model's max_position_embeddings 64 "
            f"({projects['model']}/config.json); lower --seq or training.seq_len\n"
        ),
    )


# --- pipeline parallelism of an hf model (plan_pp.py on the model's own shapes) --------------------------------------


def test_an_hf_models_pipeline_stages_are_planned_from_its_shapes(projects: dict, tmp_path: Path) -> None:
    """pp 2 of the tiny Llama (2 blocks) on 4 GPUs, FSDP over 2 per stage: the first stage holds the embedding and
    block 0, the last block 1, the final norm and lm_head (their fp32 shards, AdamW's state, the gathered stage and
    its unsharded fp32 gradients); one stage holding every block saves what the plan without PP counts, the logits
    once more (the schedule keeps them as the stage's output) and no token ids. (tests/test_plan_simulation.py's hf pp
    row checks the whole against the simulated step.)"""
    model = read_hf_config(projects["model"])
    args = ("--hf-config", str(projects["model"]), "--gpus", "4", "--seq", "32", "--precision", "fp32")
    plan = plan_json(*args, "--pp", "2", "--activation-checkpointing", "none")
    assert [r["blocks"] for r in plan["pipeline"]["ranks"]] == [[[0, 1]], [[1, 2]]]
    assert plan["pipeline"]["micro_batches"] == 2  # pp x V, the fewest 1F1B takes
    request = build_request(hf_config=projects["model"], gpus=4, seq=32, precision="fp32", pp=2)
    first, last = plan_pp.rank_stages(request)
    shapes = parameter_shapes(model)
    held = [[name for name, _ in plan_pp.rank_parameters(shapes, rank.stages, [range(0, 1), range(1, 2)], 1)]
            for rank in (first, last)]  # fmt: skip
    assert held[0][0] == "model.embed_tokens.weight" and held[1][-2:] == ["model.norm.weight", "lm_head.weight"]
    assert sorted(held[0] + held[1]) == sorted(name for name, _ in shapes)
    for rank, names in zip((first, last), held, strict=True):
        own = [shape for name, shape in shapes if name in names]
        shard = sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) for shape in own)
        assert rank.per_gpu["parameters"] == 4 * shard and rank.per_gpu["optimizer_state"] == 8 * shard + 4 * len(own)
        whole = sum(math.prod(shape) for shape in own)
        assert rank.per_gpu["all_gather_buffers"] == rank.per_gpu["deferred_gradients"] == 4 * whole
    assert last.per_gpu["loss_backward"] == 2 * 4 * 32 * 320 and first.per_gpu["loss_backward"] == 0
    # Under tp 2 (one rank per stage and tp rank) the first stage's unsharded gradients are its tp halves, the input
    # embedding's too: the project splits an untied one by its dimension (tensor_parallel.py), whose gradient DTensor
    # keeps split (by vocabulary it would be whole on each tp rank); a tied one by vocabulary, with lm_head.
    split = plan_pp.rank_stages(replace(request, tp=2))[0]
    halves = [(name, shape) for name, shape in parameter_shapes(model, 2) if name in held[0]]
    assert ("model.embed_tokens.weight", (model.vocab_size, model.dim // 2)) in halves
    assert split.per_gpu["deferred_gradients"] == 4 * sum(math.prod(shape) for _, shape in halves)
    tied = dict(parameter_shapes(replace(model, tie_embeddings=True), 2))["model.embed_tokens.weight"]
    assert tied == (model.vocab_size // 2, model.dim)
    whole_model = replace(request, pp=1, loss_chunks=1)
    tokens = 32
    for ac, figure in activations_by_mode(whole_model, 4).items():
        stage = plan_pp.stage_activation_bytes(whole_model, 4, ac, range(2), 1, True)
        assert stage == figure + 4 * tokens * 320 - 8 * tokens - 4, ac
    # A project's parallel.pp is read from its config.toml as --pp is.
    config = tmp_path / "pp" / "config.toml"
    config.parent.mkdir()
    (config.parent / ".copier-answers.yml").write_bytes((projects["hf"] / ".copier-answers.yml").read_bytes())
    text = (projects["hf"] / "config.toml").read_text().replace("[parallel]\n", "[parallel]\npp = 2\n")
    text = re.sub(r"(?m)^grad_accum_steps = \d+", "grad_accum_steps = 2", text)
    config.write_text(re.sub(r"(?m)^loss_chunks = \d+", "loss_chunks = 1", text))  # as a pp project's config.py wants
    from_config = plan_json("--config", str(config), "--gpus", "4", "--seq", "32", "--batch", "1")
    assert from_config["pipeline"]["ranks"] == plan["pipeline"]["ranks"]


def test_hf_pipeline_refusals_are_one_line(projects: dict, tmp_path: Path) -> None:
    def error(*args: str) -> str:
        result = invoke("plan", *args, "--seq", "32")
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
        return result.stderr.removeprefix("fsdp2gen: error: ").rstrip("\n")

    tied = save_config(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert error("--hf-config", str(tied), "--pp", "2") == (
        f"--pp 2: {tied} ties lm_head to the input embedding (tie_word_embeddings), one matrix the first and the last "
        "stage cannot share; plan an untied copy, or --pp 1"
    )
    # Planned under pp (tests/test_plan_simulation.py's rows): tp inside each stage, LoRA's adapters, a mixture of
    # experts. What the projects do not build with pp, or plan does not model, stays one line.
    split, whole = (plan_json("--hf-config", str(projects["model"]), "--pp", "2", "--tp", str(tp), "--gpus", "8",
                              "--seq", "32") for tp in (2, 1))  # fmt: skip
    # Each tp rank gathers its half of the stage's split layers (and of lm_head's logits).
    gathered = [plan["per_gpu_bytes"]["all_gather_buffers"] for plan in (split, whole)]
    assert gathered[0] < 0.6 * gathered[1], gathered
    # LoRA under tp (test_lora_adapters_under_tp_split_as_the_projects_lora_styles), inside each stage too.
    config = str(projects["lora"] / "config.toml")
    lora = [plan_json("--config", config, "--pp", "2", "--tp", str(tp), "--gpus", "8", "--seq", "32",
                      "--grad-accum-steps", "2") for tp in (2, 1)]  # fmt: skip
    gathered = [plan["per_gpu_bytes"]["all_gather_buffers"] for plan in lora]
    assert gathered[0] < 0.6 * gathered[1], gathered
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps({**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": 2}))
    assert error("--hf-config", str(moe), "--pp", "2", "--ep", "2") == (
        "--pp 2 with --ep 2: plan does not model expert parallelism inside pipeline stages yet (an hf project builds "
        "it); plan it with --ep 1 (FSDP shards the experts) or --pp 1"
    )
    # tp inside a mixture-of-experts model's stages: its declared plan splits the attention, the experts stay whole on
    # each tp rank, FSDP-sharded over the 2 data-parallel ranks of a stage instead of 4 (tests/test_plan_simulation.py's
    # hf-qwen3-30b-a3b-tp2-selective row: without pp).
    split, whole = (plan_json("--hf-config", str(moe), "--pp", "2", "--tp", str(tp), "--gpus", "8", "--seq", "32",
                              "--grad-accum-steps", "2") for tp in (2, 1))  # fmt: skip
    experts = 3 * 2048 * 768 * 128 + 128 * 2048  # a block's fused experts and router (a stage holds one block)
    growth = split["per_gpu_bytes"]["parameters"] - whole["per_gpu_bytes"]["parameters"]
    # fp32 shards: 4 x experts / 2 ranks at tp 2, 4 x experts / 4 at tp 1 (the rest: split by tp, sharded over half)
    assert experts <= growth < 1.01 * experts, (growth, experts)
    qlora = tmp_path / "qlora"  # the lora project's config, as a --qlora project records its answers
    qlora.mkdir()
    answers = (projects["lora"] / ".copier-answers.yml").read_text()
    (qlora / ".copier-answers.yml").write_text(answers.replace("qlora: false", "qlora: true"))
    (qlora / "config.toml").write_bytes((projects["lora"] / "config.toml").read_bytes())
    assert error("--config", str(qlora / "config.toml"), "--pp", "2") == (
        "--pp 2 with QLoRA is not built (a project's NF4 base is quantized whole); use --pp 1, or plan LoRA on an "
        "unquantized base"
    )
    assert error("--config", str(qlora / "config.toml"), "--tp", "2", "--gpus", "2") == (
        "--tp 2 with QLoRA is not built (a project's NF4 weights are sharded by fully_shard only); use --tp 1, or "
        "plan LoRA on an unquantized base"
    )


# --- mixture-of-experts config.json files (qwen3_moe, mixtral) ---------------------------------------------------

PUBLISHED = {
    "Qwen3-30B-A3B": (QWEN3_30B_A3B_CONFIG, 30.5e9, 3.3e9),
    "Mixtral-8x7B": (MIXTRAL_8X7B_CONFIG, 46.7e9, 12.9e9),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_moe_configs_are_counted_as_transformers_builds_them(name: str, tmp_path: Path) -> None:
    config, total, active = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected, _ = transformers_parameters(tmp_path / "config.json")
    model = read_hf_config(tmp_path)
    assert parameter_shapes(model) == expected  # every name and shape, the router and the fused experts included
    plan = plan_json("--hf-config", str(tmp_path), "--seq", "2048", "--batch", "1")
    assert plan["model"]["parameters"] == sum(math.prod(shape) for _, shape in expected)
    # A token goes through top_k of the experts of every block: the others' gate, up and down weights are idle.
    idle = (model.n_experts - model.top_k) * 3 * model.dim * model.moe_ffn_dim * model.n_layers
    assert plan["model"]["active_parameters"] == plan["model"]["parameters"] - idle
    # The model cards' figures, to their rounding (Qwen3's "3.3B" active is 3.35B, Mixtral's "12.9B" 12.88B).
    assert abs(plan["model"]["parameters"] - total) < 0.05e9
    assert abs(plan["model"]["active_parameters"] - active) < 0.06e9


def test_moe_plan_text_names_the_experts_router_and_routed_activations(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    result = invoke("plan", "--hf-config", str(tmp_path), "--seq", "4096", "--batch", "1")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert (
        lines[0] == f"qwen3_moe {tmp_path}/config.json: 30.53B parameters (3.35B active per token), 48 blocks, dim 2048"
    )
    assert lines[4:8] == [
        "experts: 128 per MoE block x 48 blocks, top 8; FSDP-sharded over 8 ranks like every weight (--ep N shares "
        "them out: without it each GPU gathers all 128 experts of a block to compute it)",
        "router: 128 x 2048 (mlp.gate, 262,144 parameters) per MoE block, trained; experts: 603.98M per block "
        "(gate_up_proj, down_proj), 8 of 128 active per token",
        # 128 x 3 x 2048 x 768 fp32 values / 8 ranks, x 48 blocks; a block's in bf16, gathered.
        "expert weights per GPU: 13.50 GiB fp32 shards (of the parameters row), 1.12 GiB gathered per MoE block",
        # 4096 tokens x top 8 = 32768 routed copies of 2048 values (bf16: 128 MiB), 4 x 768 per copy in the experts.
        "MoE block activations held for backward (4096 tokens x top_k 8 routed copies, balanced routing or not): "
        "router 2.20 MiB, indices 1.00 MiB, routed copies 128.00 MiB, expert hidden 192.00 MiB, expert outputs "
        "128.00 MiB",
    ]
    assert any(line.startswith("grouped GEMM backward copies (1 layer)") for line in lines)
    # Mixtral's 8 experts on 16 GPUs: each rank's dim-0 shard is padded to one whole expert (ranks 8-15 hold padding).
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    text = invoke("plan", "--hf-config", str(tmp_path), "--nodes", "2", "--batch", "1").stdout.splitlines()
    assert text[6] == (
        "expert weights per GPU: 21.00 GiB fp32 shards (of the parameters row), 2.62 GiB gathered per MoE block "
        "(fully_shard splits dim 0, the 8 experts, over 16 ranks: padded to 1 per rank)"
    )  # 32 blocks x 3 x 4096 x 14336 fp32 values: 1 of the 8 experts per GPU
    # --ep 2 (the project applies the model's declared ep plan): 4 of the 8 experts per GPU, over 8 ranks each; the
    # gathered block is this GPU's 4 experts (bf16), the dispatch's buffers 2 x 256 tokens x top 2 x 4096 (bf16).
    text = invoke("plan", "--hf-config", str(tmp_path), "--nodes", "2", "--batch", "1", "--ep", "2").stdout.splitlines()
    assert (
        text[4]
        == "experts: 8 per MoE block x 32 blocks, top 2; ep 2: 4 experts per GPU, sharded over dp_shard / ep = 8 ranks"
    )
    assert (
        text[6]
        == "expert weights per GPU: 10.50 GiB fp32 shards (of the parameters row), 1.31 GiB gathered per MoE block"
    )
    assert any(line.startswith("all-to-all (ep 2): ") and "8.00 MiB send + receive buffers" in line for line in text)
    for options, message in (
        (["--ep", "16"], "--ep 16 must divide model.n_experts (8): each GPU holds n_experts / ep whole experts; "
         "e.g. --ep 8"),
        (["--ep", "2", "--tp", "2"], "--ep 2 with --tp 2 for an hf model is not built (its experts would need both "
         "meshes); use --ep 1 (tp leaves the experts whole) or --tp 1"),
    ):  # fmt: skip
        result = invoke("plan", "--hf-config", str(tmp_path), "--nodes", "2", *options)
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}\n")


def test_moe_with_cp_and_ep_shards_the_experts_over_dp_shard_over_ep_x_cp(tmp_path: Path) -> None:
    # As a project's layout.py lays them out: ep borrows from dp_shard only (4 of the 8 GPUs with cp 2), each GPU's
    # 64 experts sharded over the dp_shard / ep x cp = 4 ranks that hold them, as over dp_shard / ep = 4 at cp 1: the
    # state per GPU stays; each rank routes its seq / cp tokens, so the all-to-all's buffers halve.
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG))
    plans = {cp: plan_json("--hf-config", str(tmp_path), "--seq", "4096", "--batch", "1", "--ep", "2", "--cp", str(cp))
             for cp in (1, 2)}  # fmt: skip
    per_gpu = {cp: plan["per_gpu_bytes"] for cp, plan in plans.items()}
    for key in ("parameters", "gradients", "optimizer_state"):
        assert per_gpu[2][key] == per_gpu[1][key] > 0, key
    assert 2 * per_gpu[2]["all_to_all_buffers"] == per_gpu[1]["all_to_all_buffers"] > 0
    assert per_gpu[2]["ring_attention"] > 0 == per_gpu[1]["ring_attention"]
    text = invoke("plan", "--hf-config", str(tmp_path), "--seq", "4096", "--batch", "1", "--ep", "2", "--cp", "2")
    assert text.exit_code == 0, text.output
    assert text.stdout.splitlines()[4] == (
        "experts: 128 per MoE block x 48 blocks, top 8; ep 2: 64 experts per GPU, sharded over dp_shard / ep x cp = "
        "4 ranks"
    )
    # ep 8 fits the 8 GPUs but not the 4 dp_shard ranks cp 2 leaves (a project's preflight refuses it too).
    result = invoke("plan", "--hf-config", str(tmp_path), "--ep", "8", "--cp", "2")
    assert (result.exit_code, result.stdout, result.stderr) == (
        2, "", "fsdp2gen: error: --ep 8 must divide the 4 dp_shard ranks it borrows from (8 GPUs / cp 2); e.g. --ep 4\n"
    )  # fmt: skip


MOE_SMALL = {
    "qwen3_moe": {**SMALL, "num_hidden_layers": 1, "intermediate_size": 96, "num_key_value_heads": 2, "head_dim": 16,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "attention_dropout": 0.0},
    "mixtral": {**SMALL, "num_hidden_layers": 1, "intermediate_size": 24, "num_key_value_heads": 2,
                "num_local_experts": 8, "num_experts_per_tok": 3},
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model_type", MOE_SMALL)
def test_lora_on_a_moe_models_attention_is_what_peft_builds_and_saves(model_type: str, dtype: str, tmp_path: Path):
    # The router and the experts frozen: they keep none of their inputs (the routed copies, the products).
    from fsdp2gen.plan_families import lora_activation_delta

    path = save_config(tmp_path, model_type, **MOE_SMALL[model_type])
    lora = LoraSpec(rank=4, targets=("q_proj", "self_attn.v_proj"), dropout=0.1)
    expected, trainable = transformers_parameters(path, lora)
    model = replace(read_hf_config(path), lora=lora)
    assert parameter_shapes(model) == expected
    assert sorted(trainable) == sorted(name for name, _ in expected if ".lora_" in name)
    compute = {"fp32": 4, "bf16": 2}[dtype]
    full, adapted = (saved_block_bytes(path, spec, dtype, (2, 8)) for spec in (None, lora))
    cpu_mask = (compute - 1) * 16 * 64 * 2  # dropout's mask on CPU (test_lora_changes_a_blocks_saved_activations...)
    assert adapted - full == lora_activation_delta(model, 2, 8, compute) + cpu_mask


def test_lora_on_fused_experts_and_qlora_on_a_moe_model_are_one_line(projects: dict, tmp_path: Path) -> None:
    # The --lora project's config.toml with model.path at a Qwen3-MoE config.json (its answers beside it).
    folder = save_config(tmp_path / "moe", "qwen3_moe", **MOE_SMALL["qwen3_moe"]).parent
    answers = (projects["lora"] / ".copier-answers.yml").read_text()
    (tmp_path / ".copier-answers.yml").write_text(answers)
    edited = tmp_path / "config.toml"
    text = (projects["lora"] / "config.toml").read_text().replace(str(projects["model"]), str(folder))
    edited.write_text(text)  # the project's default targets: the 7 linear layers' names

    def error() -> str:
        result = invoke("plan", "--config", str(edited))
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
        return result.stderr.removeprefix("fsdp2gen: error: ").rstrip("\n")

    assert error() == (
        f"{edited}: lora.target_modules ['gate_proj', 'up_proj', 'down_proj']: plan models LoRA on the attention "
        "layers of a mixture-of-experts model only (not peft's adapters on transformers' fused experts, nor its "
        "dense MLPs); plan with target_modules among ['q_proj', 'k_proj', 'v_proj', 'o_proj']"
    )
    edited.write_text(re.sub(r"(?m)^target_modules = .*$", 'target_modules = ["q_proj", "v_proj"]', text))
    plan = plan_json("--config", str(edited), "--seq", "64")
    assert plan["model"]["trainable_parameters"] == 16 * (64 + 64) + 16 * (64 + 32)  # q: 64 -> 64, v: 64 -> 32
    (tmp_path / ".copier-answers.yml").write_text(answers.replace("qlora: false", "qlora: true"))
    assert error() == (
        f"{edited}: QLoRA on a mixture-of-experts model (qwen3_moe, {folder}/config.json) is not modelled by plan yet "
        "(which weights nf4.py quantizes around transformers' fused experts); plan the model with fsdp2gen plan "
        "--hf-config"
    )


BAD = {
    "unknown architecture": (
        {"model_type": "gpt2", "n_embd": 64},
        "model_type 'gpt2': plan derives the parameter shapes of llama, qwen2, qwen3, mistral, qwen3_moe, mixtral "
        "models only; plan a similar model with --size or --hf-config",
    ),
    # A mixture-of-experts model whose blocks plan does not model (a shared expert and its gate beside the routed).
    "unmodelled experts": (
        {"model_type": "qwen2_moe", **SMALL, "intermediate_size": 128},
        "model_type 'qwen2_moe': plan derives the parameter shapes of llama, qwen2, qwen3, mistral, qwen3_moe, "
        "mixtral models only; plan a similar model with --size or --hf-config",
    ),
    "top_k over the experts": (
        {
            "model_type": "mixtral",
            **SMALL,
            "intermediate_size": 128,
            "num_key_value_heads": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 6,
        },
        "num_experts_per_tok (6) must be at most num_local_experts (4); fix config.json",
    ),
    "dense blocks not a list": (
        {"model_type": "qwen3_moe", **SMALL, "intermediate_size": 128, "mlp_only_layers": "0"},
        "mlp_only_layers must be a list of block indices, got '0'; fix config.json",
    ),
    "missing field": (
        {"model_type": "llama", **SMALL},
        "intermediate_size missing; plan needs it to derive the parameter shapes, add it",
    ),
    "wrong type": (
        {"model_type": "qwen2", **SMALL, "intermediate_size": 128, "num_key_value_heads": 2.0},
        "num_key_value_heads must be an int from 1 to 4096, got 2.0; fix config.json",
    ),
    "heads": (
        {"model_type": "mistral", **SMALL, "intermediate_size": 128, "num_key_value_heads": 3},
        "num_attention_heads (4) must be a multiple of num_key_value_heads (3); fix config.json",
    ),
    "not an object": (
        [1, 2],
        "not a JSON object; pass a model folder with config.json (save_pretrained writes one) or its config.json",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", BAD)
def test_bad_config_json_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    document, message = BAD[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    result = invoke("plan", "--hf-config", str(path))
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {path}: {message}\n")


def test_lora_flags_plan_what_the_lora_projects_config_plans(projects: dict, tmp_path: Path) -> None:
    """plan --hf-config --lora (--qlora, --lora-rank) is plan --config of the project `new --lora` (--qlora) makes on
    that model, figure for figure, under tp 2 (the adapters split as lora_styles) and without; the options a project
    or a --size cannot take are one line."""
    model, config = projects["model"], projects["lora"] / "config.toml"
    same = ("--seq", "32", "--batch", "2", "--grad-accum-steps", "1")
    flags = ("--hf-config", str(model), "--gpus", "2", "--precision", "fp32", *same)
    qlora = tmp_path / "config.toml"  # the lora project's config, as a --qlora project records its answers
    (tmp_path / ".copier-answers.yml").write_text(
        (projects["lora"] / ".copier-answers.yml").read_text().replace("qlora: false", "qlora: true")
    )
    rank_8 = re.sub(r"(?m)^rank = 16$", "rank = 8", config.read_text())
    qlora.write_text(rank_8)
    for project, options in (([str(config), "--tp", "2"], ["--lora", "--tp", "2"]), ([str(config)], ["--lora"]),
                             ([str(qlora)], ["--qlora", "--lora-rank", "8"])):  # fmt: skip
        planned, flagged = (plan_json(*args) for args in (("--config", *project, *same), (*flags, *options)))
        unlabelled = [{**plan, "model": {**plan["model"], "label": ""}} for plan in (planned, flagged)]
        assert unlabelled[0] == unlabelled[1], options
    assert plan_json(*flags, "--qlora", "--lora-rank", "8")["model"]["label"].endswith(" + QLoRA rank 8")
    assert (
        plan_json(*flags)["model"]["trainable_parameters"]
        > plan_json(*flags, "--lora")["model"]["trainable_parameters"]
    )

    def error(*args: str) -> str:
        result = invoke("plan", *args)
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
        return result.stderr.removeprefix("fsdp2gen: error: ").rstrip("\n")

    assert error(*flags, "--lora-rank", "8") == "--lora-rank 8 is the rank of LoRA's adapters; add --lora (or --qlora)"
    assert error("--config", str(config), "--lora") == (
        "--lora plans adapters on an --hf-config model; a project's are its config.toml's [lora] table (--config), "
        "and a --size model takes none"
    )
    assert (
        error(*flags, "--lora", "--lora-rank", "0")
        == "--lora-rank must be at least 1, got 0; give --lora-rank 1 or more"
    )
    moe = save_config(tmp_path / "moe", "qwen3_moe", **MOE_SMALL["qwen3_moe"])
    assert error("--hf-config", str(moe), "--qlora") == (
        f"--qlora: QLoRA on a mixture-of-experts model (qwen3_moe, {moe}) is not modelled by plan yet (which weights "
        "nf4.py quantizes around transformers' fused experts); plan it with --lora (an unquantized base)"
    )
    # A mixture-of-experts model's adapters: on its attention layers (the targets plan models there).
    planned = plan_json("--hf-config", str(moe), "--lora", "--seq", "32")["model"]
    assert planned["lora"]["targets"] == list(ATTENTION)


def test_lora_adapters_under_tp_split_as_the_projects_lora_styles(projects: dict) -> None:
    """plan --config of a LoRA project at --tp 2 on 2 GPUs (FSDP over 1: a rank holds its tp share whole): AdamW's
    state (2 fp32 values per element, an fp32 step per tensor) is that of the adapters as tensor_parallel.py's
    lora_styles splits them: a colwise layer's (q/k/v, gate/up) lora_B by output features and its lora_A whole, a
    rowwise layer's (o_proj, down_proj) lora_A by input features and its lora_B whole."""
    model = read_hf_config(projects["model"])
    rank, q, kv = 16, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    colwise = [(model.dim, out) for out in (q, kv, kv, model.ffn_dim, model.ffn_dim)]  # (in, out)
    rowwise = [(q, model.dim), (model.ffn_dim, model.dim)]
    elements = sum(rank * d_in + out // 2 * rank for d_in, out in colwise)
    elements += sum(rank * d_in // 2 + out * rank for d_in, out in rowwise)
    plan = plan_json("--config", str(projects["lora"] / "config.toml"), "--tp", "2", "--gpus", "2", "--seq", "32")
    tensors = 2 * len(colwise + rowwise) * model.n_layers
    assert plan["per_gpu_bytes"]["optimizer_state"] == 8 * elements * model.n_layers + 4 * tensors


def test_bad_hf_project_input_is_one_line_and_exit_2(projects: dict, tmp_path: Path) -> None:
    def error(*args: str) -> str:
        result = invoke("plan", *args)
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
        return result.stderr.removeprefix("fsdp2gen: error: ").rstrip("\n")

    config = projects["lora"] / "config.toml"
    edited = tmp_path / "config.toml"
    (tmp_path / ".copier-answers.yml").write_bytes((projects["lora"] / ".copier-answers.yml").read_bytes())
    text = config.read_text()
    edited.write_text(re.sub(r"(?m)^target_modules = .*$", 'target_modules = ["lm_head"]', text))
    assert error("--config", str(edited)) == (
        f"{edited}: lora.target_modules ['lm_head'] match no layer plan can adapt; its linear layers are "
        "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
    )
    edited.write_text(text.replace(f'path = "{projects["model"]}"', 'path = "meta-llama/Llama-3.2-1B"'))
    assert error("--config", str(edited)) == (
        f"{edited}: model.path meta-llama/Llama-3.2-1B: no config.json there (plan reads a local folder, relative to "
        "the project, and downloads no hub id); download it (huggingface-cli download) and plan with --hf-config FOLDER"
    )
    assert error("--hf-config", str(tmp_path / "none.json")) == (
        f"{tmp_path / 'none.json'} not found; pass a model folder with config.json (save_pretrained writes one) or "
        "its config.json"
    )
    assert error("--size", "8b", "--hf-config", "c.json") == (
        "--size and --hf-config both given; the model comes from one of them"
    )
    # Tensor parallelism of an hf model is planned from its declared plan (tests/test_plan_simulation.py's hf tp row):
    # from --hf-config --tp, and from a tp project's config, whose heads it must divide.
    tp_config = tmp_path / "tp" / "config.toml"
    tp_config.parent.mkdir()
    (tp_config.parent / ".copier-answers.yml").write_bytes((projects["hf"] / ".copier-answers.yml").read_bytes())
    tp_config.write_text((projects["hf"] / "config.toml").read_text().replace("[parallel]\n", "[parallel]\ntp = 2\n"))
    for args in (["--hf-config", str(projects["model"]), "--tp", "2"], ["--config", str(tp_config)]):
        planned = invoke("plan", *args, "--seq", "32", "--json")
        assert planned.exit_code == 0 and json.loads(planned.stdout)["setup"]["tp"] == 2, planned.stderr
    assert error("--config", str(tp_config), "--tp", "8", "--seq", "32") == (
        f"--tp 8 must divide num_attention_heads (4, {projects['model'] / 'config.json'}), which it splits; e.g. --tp 4"
    )
    planned = invoke("plan", "--config", str(tp_config), "--tp", "1", "--seq", "32")
    assert planned.exit_code == 0, planned.stderr


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from(["model_type", *SMALL, "intermediate_size", *OPTIONAL])
MOE_KEYS = ["num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
            "mlp_only_layers", "norm_topk_prob"]  # fmt: skip
DOCUMENTS = st.one_of(
    JSON_VALUES.map(json.dumps),
    st.fixed_dictionaries(
        {"model_type": st.sampled_from(["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt2"])},
        optional={
            key: st.one_of(st.integers(-3, 2**40), JSON_VALUES)
            for key in [
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                *OPTIONAL,
                *MOE_KEYS,
            ]
        },
    ).map(json.dumps),  # fmt: skip
    st.text(max_size=40),
)


@PROPERTY
@given(document=DOCUMENTS)
def test_any_config_json_plans_or_is_one_line(document: str) -> None:
    # Exit 0, or exit 2 with one line and nothing written; never a traceback.
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(document)
        assert_contract(["plan", "--hf-config", "config.json"], folder, {"config.json"})
