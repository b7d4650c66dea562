"""Family hf, mixture-of-experts checkpoints: tiny Qwen3-MoE- and Mixtral-shaped models made here (random weights,
save_pretrained), whose files hold one tensor per expert as hub checkpoints do, while transformers' models hold the
experts fused (gate_up_proj, down_proj: one tensor per layer). A generated project loads them sharded on 2 gloo
ranks through transformers' own conversion rules, trains, exports back to per-expert files, and LoRA adapts them.

No network: every model is a local folder written by the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, project_modules, torchrun
from tests.helpers.scripts import captured_in_this_process

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "max_position_embeddings": 64, "num_experts_per_tok": 2}  # fmt: skip
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "2",
         "--training.lr", "1e-2", "--job.device", "cpu", "--job.log_every", "1", "--eval.every", "0"]  # fmt: skip
# Each model's first per-expert key in its files (how hub checkpoints store them), and the model's fused tensor.
PER_EXPERT = {"qwen3-moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
              "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight"}  # fmt: skip
EXPERTS = {"qwen3-moe": 4, "mixtral": 12, "qwen3-moe-bf16": 4}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> model folder, 2 layers: Qwen3-MoE with 4 experts, whose config.json sets output_router_logits
    (transformers' load-balancing loss, coefficient 0.01); Mixtral with 12 experts (experts 10 and 11 come after 9
    in the fused tensor, not after 1 as their names sort), no balance loss. Each token takes 2 experts. And the
    Qwen3-MoE model in bf16 over several files (an index), as the hub's are, a layer's experts in several."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("hf-moe-models")
    qwen3 = {"num_experts": 4, "moe_intermediate_size": 16, "head_dim": 8, "output_router_logits": True,
             "router_aux_loss_coef": 0.01}  # fmt: skip
    configs = {
        "qwen3-moe": Qwen3MoeConfig(**SIZES, **qwen3),
        "mixtral": MixtralConfig(**SIZES, num_local_experts=12, intermediate_size=16),
    }
    folders = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        folders[name] = root / name
        model = AutoModelForCausalLM.from_config(config)
        assert model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS[name], 32, 32)
        model.save_pretrained(folders[name])
        with safe_open(folders[name] / "model.safetensors", framework="pt") as files:
            keys = set(files.keys())
        # On disk: one tensor per expert (3 per expert and layer), no fused one.
        assert PER_EXPERT[name] in keys and not any("gate_up_proj" in key for key in keys), sorted(keys)
        assert sum(".experts." in key for key in keys) == 2 * EXPERTS[name] * 3
    folders["qwen3-moe-bf16"] = root / "qwen3-moe-bf16"
    model = AutoModelForCausalLM.from_pretrained(folders["qwen3-moe"], dtype=torch.bfloat16)
    model.save_pretrained(folders["qwen3-moe-bf16"], max_shard_size="3KB")
    files = json.loads((folders["qwen3-moe-bf16"] / "model.safetensors.index.json").read_text())["weight_map"]
    # A fused tensor comes from several files (gate_up_proj: the experts' gate_proj in one, their up_proj in another).
    fused = {file for key, file in files.items() if re.search(r"layers\.0\.mlp\.experts\.\d+\.(gate|up)_proj", key)}
    assert len(fused) > 1, files
    return folders


@pytest.fixture(scope="module")
def project(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("hf-moe") / "run", "--family", "hf", "--hf-model",
                    str(models["qwen3-moe"]), "--gpus", "2", "--fp32")  # fmt: skip


def probe(project: Path, folders: list[Path], *overrides: str) -> tuple[dict[Path, list[dict]], str]:
    """tests/helpers/hf_moe_probe.py on 2 ranks, one launch for every folder (overrides: the probe's options and the
    config's): (folder -> each rank's report, the launch's stdout)."""
    result = torchrun(project, str(HELPERS / "hf_moe_probe.py"), *map(str, folders), "--job.device", "cpu",
                      *overrides)  # fmt: skip
    lines = [line.removeprefix("probe ") for line in result.stdout.splitlines() if line.startswith("probe ")]
    reports = sorted((json.loads(line) for line in lines), key=lambda report: report["rank"])
    found = {folder: [report for report in reports if report["folder"] == str(folder)] for folder in folders}
    assert all(len(found[folder]) == 2 for folder in folders) and len(reports) == 2 * len(folders), result.stdout
    return found, result.stdout


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the training runs (one_process's): root/NAME, a run's output folder."""
    return tmp_path_factory.mktemp("hf-moe-runs")


def train_args(models: dict[str, Path], root: Path, name: str) -> list[str]:
    """train.py's arguments for 5 steps of model `name` into root/NAME."""
    return [*TRAIN, "--model.path", str(models[name]), "--training.steps", "5", "--job.output_dir", str(root / name)]


@pytest.fixture(scope="module")
def probed(project: Path, models: dict[str, Path], runs_root: Path) -> tuple[dict[Path, list[dict]], str]:
    """The probe of the three models, then the load of the bf16 one by rank 0 alone (--blind-load), then (last,
    --then-train) Qwen3-MoE's 5 steps of the one_process fixture, also saved as Hugging Face folders, in one 2-rank
    launch (a launch costs ~12 CPU-s; a model's probe ~1)."""
    run = runs_root / "qwen3-moe.json"
    run.write_text(json.dumps([[*train_args(models, runs_root, "qwen3-moe"), "--checkpoint.save_format", "hf"]]))
    return probe(project, [models[name] for name in EXPERTS], "--blind-load", str(models["qwen3-moe-bf16"]),
                 "--then-train", str(run))  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen3-moe-bf16"])
def test_per_expert_files_load_sharded_equal_to_from_pretrained(
    probed: tuple[dict[Path, list[dict]], str], models: dict[str, Path], name: str
) -> None:
    reports = probed[0][models[name]]
    print(reports)
    # Each rank read from the files only the experts of its shard (fully_shard splits the experts in halves).
    half = EXPERTS[name] // 2
    shards = [list(range(half)), list(range(half, 2 * half))]
    assert [report["experts_read"] for report in reports] == [{"0": shard, "1": shard} for shard in shards]
    # Every weight equals from_pretrained's bit for bit (the probe compares them); so do the logits, fp32.
    assert [report["weights_differ"] for report in reports] == [[], []]
    assert [report["logits_diff"] for report in reports] == [0.0, 0.0]
    if name.startswith("qwen3-moe"):
        # The training loss is transformers' own: cross-entropy + 0.01 x its load-balancing loss, exactly; with
        # reduction "sum" the balance loss counts once per target, like the cross-entropy.
        assert [report["loss_diff"] for report in reports] == [0.0, 0.0]
        assert all(report["sum_diff"] <= 1e-5 * report["loss"] * 29 for report in reports), reports
        # balance_experts' load figures (tokens each expert received, counted by a hook on transformers' experts
        # modules, every rank's) equal the routing read from the reference's router logits.
        for report in reports:
            assert report["load_max_mean"][0] == report["load_max_mean"][1] > 1
            assert report["load_min_mean"][0] == report["load_min_mean"][1] < 1


def test_a_folder_only_rank_0_sees_is_converted_by_rank_0_equal_to_from_pretrained(
    probed: tuple[dict[Path, list[dict]], str], models: dict[str, Path]
) -> None:
    # --blind-load (hf_load_probe.py's --blind): rank 1 is given a folder that does not exist, so rank 0 reads every
    # file whole, converts each fused tensor once it has read all its experts (from several files) and broadcasts
    # it. Every weight bit for bit.
    stdout = probed[1]
    assert stdout.splitlines().count("blind: equal") == 1, stdout
    folder = models["qwen3-moe-bf16"]
    assert f"warning: rank(s) [1] do not see the files of {folder} that rank 0 sees" in stdout, stdout


@pytest.fixture(scope="module")
def one_process(
    project: Path, models: dict[str, Path], runs_root: Path, probed: tuple[dict[Path, list[dict]], str]
) -> dict[str, object]:
    """Qwen3-MoE trained 5 steps on 2 ranks (each holds half the experts, gathered whole by the export), also saved
    as Hugging Face folders (checkpoint.save_format "hf": per-expert files too, each rank writing the parts of the
    gathered experts it was given): the probed fixture's launch, last. Then in this process
    (captured_in_this_process; an hf train.py's imports cost ~6 CPU-s a process, done here by the models
    fixture): its export; Mixtral's 5 steps and export (its names and its 12 experts' order do not depend on the
    ranks: one process); the two runs train.py must refuse (REFUSED, each as a user's first try: one process, no
    torchrun). "qwen3-moe", "mixtral" -> output folder (exported/ in it); "refused" -> name -> (exit code, stdout,
    stderr)."""
    root = runs_root

    def train(name: str) -> list[str]:
        return ["train.py", *train_args(models, root, name)]

    def export(name: str) -> list[str]:
        return ["scripts/export.py", str(root / name / "checkpoints" / "step-5"), "--output", str(root / name /
                "exported")]  # fmt: skip

    refusals = refused_runs(models, root / "refused")
    runs = [export("qwen3-moe"), train("mixtral"), export("mixtral"), *refusals.values()]
    results = [captured_in_this_process(project, *argv) for argv in runs]
    assert [code for code, _, _ in results[:3]] == [0, 0, 0], results[2][2][-3000:]
    return {"qwen3-moe": root / "qwen3-moe", "mixtral": root / "mixtral",
            "refused": dict(zip(refusals, results[3:], strict=True))}  # fmt: skip


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_five_steps_then_export_writes_the_per_expert_files_from_pretrained_loads(
    one_process: dict[str, object], models: dict[str, Path], name: str
) -> None:
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    # The runs of the one_process fixture: Qwen3-MoE on 2 ranks, Mixtral in one process.
    tmp_path = one_process[name]
    exported = tmp_path / "exported"
    records = metrics(tmp_path)
    assert len(records) == 5 and records[-1]["loss"] < records[0]["loss"], records
    # How the tokens spread over the experts: the most and least loaded expert over the mean, worst layer.
    assert all(record["moe_load_max_mean"] >= 1 >= record["moe_load_min_mean"] >= 0 for record in records), records
    if name == "qwen3-moe":
        # The part of the logged loss that is the balance loss (x 0.01): near 0.01 x its balanced value, 2 layers.
        assert all(0.015 < record["moe_aux_loss"] < 0.03 for record in records), records
    else:
        assert all("moe_aux_loss" not in record for record in records)

    # The keys of the original files: per-expert again (transformers' reverse conversion).
    with safe_open(exported / "model.safetensors", framework="pt") as new, \
            safe_open(models[name] / "model.safetensors", framework="pt") as old:  # fmt: skip
        assert set(new.keys()) == set(old.keys())
    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    # What from_pretrained reads back is the trained model, bit for bit, and not the pretrained one.
    dcp_to_torch_save(tmp_path / "checkpoints" / "step-5", tmp_path / "step-5.pt")
    trained = torch.load(tmp_path / "step-5.pt", weights_only=True)["train"]["model"]
    pretrained = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(model.state_dict()[experts], pretrained[experts])
    if name == "qwen3-moe":
        # The folder saved at step 5 holds the export's weights under the same per-expert keys, and its other files.
        saved = tmp_path / "hf" / "step-5"
        keys = set()
        for file in saved.glob("*.safetensors"):
            with safe_open(file, framework="pt") as new:
                keys |= set(new.keys())
        assert keys == set(safe_open(exported / "model.safetensors", framework="pt").keys())
        assert {path.name for path in exported.iterdir() if path.suffix != ".safetensors"} <= set(os.listdir(saved))
        loaded, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
        assert {key: value for key, value in info.items() if value} == {}, info
        assert all(torch.equal(value, loaded.state_dict()[key]) for key, value in model.state_dict().items())


def test_lora_adapts_attention_and_the_fused_experts(models: dict[str, Path], tmp_path: Path) -> None:
    # peft turns gate_proj/up_proj/down_proj (Qwen3-MoE's names) and w1/w2/w3 (Mixtral's) into adapters on the
    # fused experts tensors; sharded, with nonzero adapters, the logits are peft's own model's.
    import torch
    from safetensors import safe_open

    project = generate(tmp_path / "run", "--family", "hf", "--hf-model", str(models["mixtral"]), "--lora", "--gpus",
                       "2", "--fp32")  # fmt: skip
    targets = ["--lora.target_modules", "q_proj,v_proj,w1,w2,w3", "--lora.rank", "4", "--lora.alpha", "8"]
    reports = probe(project, [models["mixtral"]], *targets)[0][models["mixtral"]]
    print(reports)
    assert [report["logits_diff"] for report in reports] == [0.0, 0.0]
    assert all(report["base_diff"] > 1e-3 for report in reports), reports

    # Trained 3 steps and exported merged: the experts' per-expert weights changed, the routers' did not (one
    # process: what the sharded adapters compute is the probe's above). Then the experts module itself, which is no
    # layer peft adapts: one line, exit 2, naming the fix. The three runs in this process (captured_in_this_process:
    # the models fixture imported torch and transformers here).
    checkpoint, exported = tmp_path / "out" / "checkpoints" / "step-3", tmp_path / "exported"
    trained, export, refused = (captured_in_this_process(project, *argv) for argv in (
        ["train.py", *TRAIN, *targets, "--training.steps", "3", "--job.output_dir", str(tmp_path / "out")],
        ["scripts/export.py", str(checkpoint), "--output", str(exported)],
        ["train.py", *TRAIN, "--lora.target_modules", "q_proj,experts", "--job.output_dir", str(tmp_path / "refused")],
    ))  # fmt: skip
    assert trained[0] == 0, trained[2][-3000:]
    # Adapters: (32 + 32) x 4 on q; (32 + 16) x 4 on v; on each layer's experts, peft's shapes for the fused tensors.
    assert re.search(r"model: [\d,]+ parameters, [\d,]+ of them trainable", trained[1]), trained[1]
    assert export[0] == 0, export[2][-3000:]
    with safe_open(exported / "model.safetensors", framework="pt") as new, \
            safe_open(models["mixtral"] / "model.safetensors", framework="pt") as old:  # fmt: skip
        assert set(new.keys()) == set(old.keys())
        changed = {key for key in old.keys() if not torch.equal(new.get_tensor(key), old.get_tensor(key))}
    assert PER_EXPERT["mixtral"] in changed and "model.layers.0.block_sparse_moe.experts.11.w2.weight" in changed
    assert "model.layers.0.block_sparse_moe.gate.weight" not in changed and "model.norm.weight" not in changed

    assert refused[0] == 2 and not (tmp_path / "refused").exists()
    assert re.findall(r"^train\.py: error: .*$", refused[2], flags=re.M) == [
        "train.py: error: lora.target_modules ['q_proj', 'experts']: peft cannot adapt them (they name "
        "['MixtralExperts']); its linear layers are ['k_proj', 'lm_head', 'o_proj', 'q_proj', 'v_proj'], and fused "
        "experts are adapted through the names of their projections in the checkpoint (e.g. gate_proj, up_proj and "
        "down_proj together)"
    ]


def refused_runs(models: dict[str, Path], root: Path) -> dict[str, list[str]]:
    """The two models train.py must refuse, made in `root`: name -> train.py's arguments (output folder root/NAME)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig

    # Qwen3-MoE without one expert's up_proj in layer 1.
    missing = root / "model"
    shutil.copytree(models["qwen3-moe"], missing)
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    # A dense Llama whose config.json asks for router logits: transformers' Llama has no router, nor a balance loss.
    router = root / "llama"
    LlamaConfig(**{key: value for key, value in SIZES.items() if key != "num_experts_per_tok"}, intermediate_size=64,
                output_router_logits=True).save_pretrained(router)  # fmt: skip
    runs = {"missing-expert": (missing, []), "router-logits": (router, ["--model.pretrained", "false"])}
    return {
        name: ["train.py", *TRAIN, "--model.path", str(folder), *options, "--job.output_dir", str(root / name)]
        for name, (folder, options) in runs.items()
    }


@pytest.fixture(scope="module")
def refused(one_process: dict[str, object]) -> dict[str, tuple]:
    """The two refused runs (in one_process's Python process): name -> (model folder, output folder, (exit code,
    stdout, stderr))."""
    root = one_process["mixtral"].parent / "refused"
    folders = {"missing-expert": root / "model", "router-logits": root / "llama"}
    return {name: (folders[name], root / name, result) for name, result in one_process["refused"].items()}


def test_an_expert_missing_from_the_files_stops_with_one_line(refused: dict[str, tuple]) -> None:
    folder, _, (code, _, stderr) = refused["missing-expert"]
    assert code == 2, stderr[-2000:]
    assert re.findall(r"^train\.py: error: .*$", stderr, flags=re.M) == [
        f"train.py: error: {folder} has 3 tensors mlp.experts.*.up_proj.weight for the model's "
        "model.layers.1.mlp.experts.gate_up_proj of 4 experts; its config.json must be the one the weights were "
        "saved with"
    ], stderr[-2000:]


def test_router_logits_on_a_model_without_a_balance_loss_stop_with_one_line(refused: dict[str, tuple]) -> None:
    _, out, (code, _, stderr) = refused["router-logits"]
    assert code == 2, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "train.py: error: LlamaForCausalLM: its config.json sets output_router_logits, but the model has no "
        "load-balancing loss that this project adds (transformers' load_balancing_loss_func, num_experts, "
        "num_experts_per_tok, router_aux_loss_coef); set output_router_logits to false in its config.json"
    )
    assert not out.exists()


def test_mfu_counts_the_active_experts_only(project: Path, models: dict[str, Path]) -> None:
    # Per token: attention (q, o 32 x 32; k, v 16 x 32), the router (4 x 32), 2 of the 4 experts (gate, up,
    # down: 16 x 32 each), per layer; the output layer (128 x 32); x 6, + attention scores 12 x layers x heads x
    # head_dim x seq_len (16).
    per_layer = 2 * 32 * 32 + 2 * 16 * 32 + 4 * 32 + 2 * 3 * 16 * 32
    expected = 6 * (2 * per_layer + 128 * 32) + 12 * 2 * 4 * 8 * 16
    with project_modules(project):  # in this process: the models fixture imported transformers already
        from model_args import ModelArgs

        assert ModelArgs(path=str(models["qwen3-moe"])).flops_per_token(16) == expected
