"""Mixture-of-experts llama models (`fsdp2gen new X --moe`, moe.py), on CPU gloo ranks, fp32: 2 ranks equal one
process with the bias balancing (with the balance loss alone: tests/test_expert_parallel.py), the balance loss and
the bias update follow DeepSeek-V3's formulas (plain reference loops in tests/helpers/moe_probe.py), the grouped GEMM
equals the per-expert loop, initialisation is the same on any number of ranks, resume is exact (routing biases
included), and on real text the experts stay balanced while the validation loss falls. Bad MoE settings stop in one
line."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, generate, metrics, project_modules, torchrun
from tests.helpers import several_runs
from tests.helpers.in_process import script_in_this_process
from tests.helpers.scripts import captured_in_this_process
from tests.helpers.several_runs import launch_several

# A tiny MoE llama: 3 blocks (the first dense, then 2 MoE blocks of 8 experts, top 2, one shared expert).
TINY_MOE = [
    "--model.dim", "64", "--model.n_layers", "3", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.moe_ffn_dim", "32", "--model.max_seq_len", "64",
    "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.warmup_steps", "2",
    "--training.lr", "1e-2", "--training.loss_chunks", "1", "--job.log_every", "1", "--job.device", "cpu",
]  # fmt: skip
# lr 1e-3, not TINY's 1e-2: Adam divides each gradient element by its magnitude, so an element whose terms nearly
# cancel keeps its summation-order roundoff (1e-7 of the terms) at up to lr x 1e-2 in the weights; at 1e-2 the
# weights of 1 and 2 ranks (dense ones too) drift 3e-5 apart in 2 steps, at 1e-3 they stay within 1e-5.
STEPS = ["--training.steps", "4", "--training.grad_accum_steps", "2", "--checkpoint.interval", "2",
         "--training.lr", "1e-3"]  # fmt: skip
# Routing biases at a rate large enough to change choices within 4 steps (the balance loss alone: test_expert_
# parallel.py).
BIAS = ["--model.expert_bias_rate", "1e-2"]
MOE_FIGURES = ("moe_load_max_mean", "moe_load_min_mean", "moe_bias_abs_max")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("moe") / "run", "--gpus", "2", "--fp32", "--moe")


@pytest.fixture(scope="module")
def real_text(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """test_on_real_text_...'s project, data and runs: test_real_data.py's sentences, a BPE tokenizer of 300 tokens
    (the project's --tokenizer), prepared by the project's scripts/prepare_data.py; "runs": expert_bias_rate ->
    (steps, train.py's arguments). Trained in two_ranks' launch."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.test_real_data import sentences

    root = tmp_path_factory.mktemp("real-text")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text("\n".join(sentences(3000, 0)) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(root / "text" / "a.txt")], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    project = generate(root / "run", "--gpus", "2", "--fp32", "--moe", "--tokenizer", str(root / "tokenizer.json"))
    # scripts/prepare_data.py involves nothing distributed: run in this process (script_in_this_process).
    script_in_this_process(project, "scripts/prepare_data.py", str(root / "text"), "--output", str(root / "data"),
                           "--val-fraction", "0.1")  # fmt: skip
    # TINY_MOE's model but for its vocabulary size: the tokenizer's 300.
    pairs = zip(TINY_MOE[:16:2], TINY_MOE[1:16:2], strict=True)
    model = [arg for pair in pairs if pair[0] != "--model.vocab_size" for arg in pair]
    common = [*model, "--data.path", str(root / "data"), "--training.seq_len", "64",
              "--training.global_batch_size", "8", "--training.warmup_steps", "10", "--training.lr", "3e-3",
              "--training.loss_chunks", "1", "--job.log_every", "50", "--eval.every", "25", "--eval.batches", "4",
              "--job.device", "cpu"]  # fmt: skip
    # The control without biases runs 100 steps, by which the routing has collapsed (measured: max/mean 3.76 over
    # its steps 51-100, the balanced run's last 50 steps 1.67).
    steps = {"1e-2": 200, "0": 100}
    runs = {rate: (total, [*common, "--training.steps", str(total), "--model.expert_bias_rate", rate,
                           "--job.output_dir", str(root / f"rate-{rate}")])
            for rate, total in steps.items()}  # fmt: skip
    return {"root": root, "project": project, "runs": runs}


@pytest.fixture(scope="module")
def two_ranks(project: Path, real_text: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bias balancing's 4-step run on 2 ranks (dp_shard 2), 2 micro-batches per step, checkpoints at 2 and 4,
    and (in the same launch: tests/helpers/several_runs.py) its resume from step 2 in `resumed`, from a copy of the
    run's folder without the step-4 checkpoint and with the metrics of steps 1-2; then real_text's two runs, by
    its project's train.py (several_runs.py's "project"). Each run's console output beside its folder
    (bias.stdout, resumed.stdout; the real-text runs': real-text.stdout in real_text's root)."""
    root = tmp_path_factory.mktemp("two-ranks")
    run = [*TINY_MOE, *STEPS, *BIAS]
    interrupted = {"from": str(root / "bias"), "remove": ["checkpoints/step-4"], "metrics_lines": 2}
    other = [{"args": args, "project": str(real_text["project"])} for _, args in real_text["runs"].values()]
    result = launch_several(project, [[*run, "--job.output_dir", str(root / "bias")],
                                      {"args": [*run, "--job.output_dir", str(root / "resumed")],
                                       "interrupted": interrupted}, *other], root / "runs.json", nproc=2)  # fmt: skip
    # Rank 0 prints "run N: ARGS" before the run N > 0.
    bias, resumed, text = re.split(r"^run [12]: ", result.stdout, maxsplit=2, flags=re.M)
    (root / "bias.stdout").write_text(bias)
    (root / "resumed.stdout").write_text(resumed)
    (real_text["root"] / "real-text.stdout").write_text(text)
    return {"bias": root / "bias", "resumed": root / "resumed"}


# Routed as Mixtral routes (test_export_format_hf_is_mixtral_when_the_routing_is_mixtrals).
MIXTRAL = ["--model.score_func", "softmax", "--model.n_shared_experts", "0", "--model.n_dense_layers", "0",
           "--model.expert_bias_rate", "0"]  # fmt: skip
BAD_SETTINGS = [
    ("top-k-above-experts", ["--model.top_k", "9"],
     "model.top_k (9) must be between 1 and model.n_experts (8): each token goes to top_k different experts; e.g. "
     "--model.top_k 8"),
    ("experts-without-their-size", ["--model.size", "debug", "--model.n_experts", "4", "--model.moe_ffn_dim", "0"],
     "model.n_experts = 4 needs model.moe_ffn_dim, each expert's hidden size (size debug has none); e.g. "
     "--model.moe_ffn_dim 172"),
    ("no-moe-block-left", ["--model.n_dense_layers", "3"],
     "model.n_dense_layers (3) leaves none of the 3 blocks a mixture of experts; choose fewer, e.g. "
     "--model.n_dense_layers 0"),
]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(project: Path, two_ranks: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The project's one-process scripts, one after the other in this process (captured_in_this_process: torch
    is imported here already), each as `python SCRIPT ARGS` runs it: tests/helpers/moe_probe.py ("probe"), the bias
    run's one-process reference ("bias"), a Mixtral-routed run of 2 steps ("mixtral"), its export --format hf
    ("exported"), the export of the 2-rank bias run, refused ("refused"), and train.py with each of BAD_SETTINGS (by
    case). Name -> (exit code, stdout, stderr), and "root": the folder of their outputs."""
    root = tmp_path_factory.mktemp("one-process")
    export = ["scripts/export.py", "--format", "hf", "--output"]
    runs = {
        "probe": [str(HELPERS / "moe_probe.py")],
        "bias": ["train.py", *TINY_MOE, *STEPS, *BIAS, "--job.output_dir", str(root / "bias")],
        "mixtral": ["train.py", *TINY_MOE, *MIXTRAL, "--training.steps", "2", "--job.output_dir",
                    str(root / "mixtral")],
        "exported": [*export, str(root / "exported"), str(root / "mixtral" / "checkpoints" / "step-2")],
        "refused": [*export, str(root / "refused"), str(two_ranks["bias"] / "checkpoints" / "step-4")],
        **{case: ["train.py", *TINY_MOE, *args, "--job.output_dir", str(root / case)]
           for case, args, _ in BAD_SETTINGS},
    }  # fmt: skip
    return {"root": root, **{name: captured_in_this_process(project, *argv) for name, argv in runs.items()}}


def weights(checkpoint: Path) -> dict:
    """The model's full tensors (and routing biases) in a DCP checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = checkpoint.parent.parent.parent / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, converted)
    return torch.load(converted, weights_only=False)["train"]["model"]


def test_two_ranks_equal_one_process(two_ranks: dict, one_process: dict) -> None:
    # The bias updates. (The balance loss alone on ranks, its value and the biases left at 0, equals one process in
    # test_expert_parallel.py's test_a_checkpoint_saved_by_one_process_resumes_with_hsdp_2_x_ep2_as_the_
    # uninterrupted_run.) One process: one_process' "bias".
    assert one_process["bias"][0] == 0, one_process["bias"][2][-3000:]
    one = one_process["root"] / "bias"
    ones, twos = metrics(one), metrics(two_ranks["bias"])
    assert len(ones) == len(twos) == 4
    figures = ["loss", "grad_norm", *MOE_FIGURES]
    for a, b in zip(ones, twos, strict=True):
        assert all(abs(a[name] - b[name]) <= 1e-5 for name in figures), (a, b)
    assert "moe_aux_loss" not in twos[0]
    # The routing moved: the runs exercised the balancing they compare.
    assert twos[-1]["moe_bias_abs_max"] > 0.01, twos[-1]
    a, b = weights(one / "checkpoints" / "step-4"), weights(two_ranks["bias"] / "checkpoints" / "step-4")
    assert a.keys() == b.keys() and "layers.1.feed_forward.expert_bias" in a
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name


def test_resume_is_exact_routing_biases_included(two_ranks: dict) -> None:
    # The two_ranks fixture's second run: steps 3 and 4 resumed from the step-2 checkpoint.
    uninterrupted, resumed = two_ranks["bias"], two_ranks["resumed"]
    stdout = resumed.with_name("resumed.stdout").read_text()
    assert f"resumed from {resumed / 'checkpoints' / 'step-2'} at step 2" in stdout, stdout
    keep = ["step", "loss", "grad_norm", *MOE_FIGURES]
    rows = [[{k: r[k] for k in keep} for r in metrics(folder)] for folder in (resumed, uninterrupted)]
    assert rows[0] == rows[1]
    a, b = weights(uninterrupted / "checkpoints" / "step-4"), weights(resumed / "checkpoints" / "step-4")
    assert a.keys() == b.keys()
    assert all(a[name].equal(b[name]) for name in a), [name for name in a if not a[name].equal(b[name])]
    biases = [name for name in a if name.endswith("expert_bias")]
    assert biases == ["layers.1.feed_forward.expert_bias", "layers.2.feed_forward.expert_bias"]
    assert all(a[name].abs().max() > 0 for name in biases)


def test_export_format_hf_is_mixtral_when_the_routing_is_mixtrals(project: Path, one_process: dict) -> None:
    """Routed as Mixtral routes (softmax scores, no shared experts or dense blocks, biases left at 0), 2 steps
    trained in one process: scripts/export.py --format hf writes a MixtralForCausalLM folder that from_pretrained
    loads, with this model's logits. The 2-rank bias run (sigmoid, a shared expert, a dense block, biases moved) is
    refused in one line naming the settings that would make it one, nothing written. (Each in one_process.)"""
    import torch
    from transformers import AutoModelForCausalLM

    root = one_process["root"]
    out, exported, refused_dir = root / "mixtral", root / "exported", root / "refused"
    trained, exported_run, refused = one_process["mixtral"], one_process["exported"], one_process["refused"]
    assert trained[0] == 0 and exported_run[0] == 0, (trained[2][-3000:], exported_run[2][-3000:])
    assert refused[:2] == (2, ""), refused
    assert refused[2] == (
        "export.py: error: --format hf: no transformers class has this model's experts and routing; "
        'MixtralForCausalLM would, with model.score_func "softmax" (this run\'s: "sigmoid"), model.n_shared_experts 0 '
        "(this run's: 1), model.n_dense_layers 0 (this run's: 1), routing biases left at 0, model.expert_bias_rate 0 "
        "(this run's moved them); or export --format native\n"
    )
    assert not refused_dir.exists()

    theirs, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, info
    assert type(theirs).__name__ == "MixtralForCausalLM"
    checkpoint = out / "checkpoints" / "step-2"
    with project_modules(project):
        model_module = importlib.import_module("model")
        config = json.loads((checkpoint / "checkpoint.json").read_text())["config"]
        ours = model_module.Model(model_module.ModelArgs(**config["model"]))
        ours.init_weights(seed=0)
        ours.load_state_dict(weights(checkpoint))
    tokens = torch.randint(128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(tokens) - theirs.eval()(tokens).logits).abs().max().item() <= 1e-5


def test_the_console_shows_the_load_and_the_active_parameters(two_ranks: dict) -> None:
    # The bias-balanced 2-rank run's console (4 steps, 2 micro-batches each).
    stdout = two_ranks["bias"].with_name("bias.stdout").read_text()
    records = metrics(two_ranks["bias"])
    lines = re.findall(r"^step +\d+/4 \| loss .* \| experts max/mean (\d\.\d\d) \| ETA .*$", stdout, re.M)
    assert len(records) == 4 and lines == [f"{r['moe_load_max_mean']:.2f}" for r in records], stdout
    # 3 blocks of attention (4 x 64 x 64 less the 2 of 4 kv heads: 12,288), norms (7 x 64), embeddings and output
    # (2 x 128 x 64), the dense block's 3 x 64 x 172, and per MoE block the router (64 x 8) and 3 of the 9 experts
    # of 3 x 64 x 32 (top 2 and the shared one).
    active = 3 * 12_288 + 7 * 64 + 2 * 128 * 64 + 3 * 64 * 172 + 2 * (64 * 8 + 3 * 3 * 64 * 32)
    assert f"model: {active:,} parameters active per token (2 of 8 routed experts, 1 shared); MFU counts these" in (
        stdout
    )


@pytest.fixture(scope="module")
def probe(one_process: dict) -> dict:
    """What tests/helpers/moe_probe.py printed (in one_process)."""
    code, stdout, stderr = one_process["probe"]
    assert code == 0, stderr[-3000:]
    return json.loads(stdout)


def test_the_balance_loss_is_deepseek_v3s_sequence_wise_loss(probe: dict) -> None:
    ours, reference = probe["aux_loss"]["ours"], probe["aux_loss"]["reference"]
    assert abs(ours - reference) <= 1e-6 * reference  # moe.py's counts are fp32
    # In the model's loss: aux_loss_coef x the mean over sequences, summed over the 2 MoE layers.
    in_loss = probe["aux_in_loss"]
    assert in_loss["layers"] == 2 and abs(in_loss["difference"] - in_loss["expected"]) <= 1e-6, in_loss


def test_the_moe_layer_equals_a_per_token_loop_and_grouped_gemm_the_per_expert_loop(probe: dict) -> None:
    assert probe["moe_vs_per_token_loop"] <= 1e-6
    assert probe["grouped_vs_looped"] <= 1e-5
    # fp32 widths of 8 values are 32 bytes (the kernel's 16-byte rows); 6 values are not.
    assert probe["grouped_on_cpu"] == [True, False, False]


def test_the_bias_update_follows_the_sign_rule_and_the_figures_are_right(probe: dict) -> None:
    balance = probe["balance"]
    # Loads [10, 2, 5, 3] (mean 5), rate 0.1: -0.1, +0.1, 0, +0.1, then centred (their mean, 0.025, subtracted).
    assert balance["bias"][0] == pytest.approx([-0.125, 0.075, -0.025, 0.075], abs=1e-7)
    assert balance["bias"][1] == [0.5, -0.5, 0.0, 0.0]  # an even load leaves the biases alone
    assert balance["figures"] == pytest.approx(
        # the worst layer's max / mean and min / mean; the largest bias; 0.01 x (6 + 2) / (20 tokens / top 2)
        {"moe_load_max_mean": 2.0, "moe_load_min_mean": 0.4, "moe_bias_abs_max": 0.5, "moe_aux_loss": 0.008}
    )
    assert balance["counts_after"] == [[0.0, 0.0, 0.0, 0.0], 0.0]  # the next step counts afresh


def test_tokens_are_counted_once_under_activation_checkpointing(probe: dict) -> None:
    counts = probe["counts"]
    assert counts["checkpointed"] == counts["plain"]
    # 2 micro-batches of 48 tokens, each to 2 experts.
    assert [sum(layer[:-1]) for layer in counts["plain"]] == [2 * counts["tokens"]] * 2


def test_active_parameters_and_mfu_flops_are_those_of_the_built_model(probe: dict) -> None:
    active = probe["active"]
    assert active["model_args"] == active["counted"] and active["flops_per_token"] == active["flops_counted"], active


@pytest.mark.parametrize("nproc", [1, 3])
def test_sharded_init_is_the_same_on_any_number_of_ranks(project: Path, tmp_path: Path, nproc: int) -> None:
    # 3 ranks split the 8 experts of each stacked weight unevenly (3, 3, 2); blocks of 1000 values cut every
    # expert weight into several draws.
    copy = tmp_path / "run"
    shutil.copytree(project, copy)
    source = (copy / "sharded_init.py").read_text()
    assert "INIT_BLOCK_ELEMENTS = 1 << 20\n" in source
    (copy / "sharded_init.py").write_text(source.replace("= 1 << 20\n", "= 1000\n"))
    args = ["tests/check_init.py", *TINY_MOE[:16], "--job.device", "cpu"]
    if nproc == 1:
        # One process, `python tests/check_init.py` (a group of one): run in this process, which imported torch.
        code, stdout, stderr = captured_in_this_process(copy, *args)
        assert code == 0, stderr[-3000:]
    else:
        stdout = torchrun(copy, *args, nproc=nproc).stdout
    # Embeddings, norm, output; the dense block's 9 tensors; each MoE block's 14 (attention 4, norms 2, router,
    # experts 3, shared experts 3, expert_bias).
    assert f"rank 0: {3 + 9 + 2 * 14} tensors equal" in stdout and "MISMATCH" not in stdout


@pytest.mark.parametrize("case,args,message", BAD_SETTINGS)
def test_bad_moe_settings_stop_in_one_line(one_process: dict, case: str, args: list, message: str) -> None:
    # train.py as `python train.py TINY_MOE ARGS` runs it (in one_process).
    assert one_process[case] == (2, "", f"train.py: error: {message}\n"), one_process[case]
    assert not (one_process["root"] / case).exists()


@pytest.mark.parametrize("options,message", [
    (["--family", "hf", "--hf-model", "org/model"],
     "--moe: mixture-of-experts blocks are built in for --family llama only; drop --moe"),
    (["--gpus", "2", "--tp", "2"],
     "--moe: --moe with --tp 2: experts are not split by tensor parallelism here; use --tp 1 (FSDP and --ep shard "
     "them)"),
    (["--gpus", "2", "--cp", "2"],
     "--cp: context parallelism is not built for mixture-of-experts models (--moe) yet; use --cp 1"),
])  # fmt: skip
def test_the_generator_refuses_moe_with_what_it_does_not_compose_with(
    options: list[str], message: str, tmp_path: Path
) -> None:
    result = subprocess.run([sys.executable, "-m", "fsdp2gen", "new", str(tmp_path / "run"), "--yes", "--moe",
                             *options], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and result.stderr == f"fsdp2gen: error: {message}\n"
    assert not (tmp_path / "run").exists()


def test_on_real_text_the_validation_loss_falls_and_the_biases_balance_the_experts(
    real_text: dict, two_ranks: dict
) -> None:
    """200 steps on prepared text (test_real_data.py's sentences, a BPE tokenizer of 300 tokens), the debug-moe
    expert layout (8 experts, top 2, 1 shared, a dense first block, sigmoid scores) at tiny widths, 2 ranks, about
    30 s each (the real_text fixture's runs, in two_ranks' launch). Measured (torch 2.13, CPU): without biases the
    routing collapses within 100 steps onto 2 experts (max/mean 4.0, all of a layer's tokens on the same top 2 of 8);
    with expert_bias_rate 1e-2 the busiest expert holds 1.6-1.7x the mean over the last 50 steps (512 tokens a step:
    a few tens of tokens per expert of noise). 1e-2, not config.toml's 1e-3 (DeepSeek-V3's, for long runs): at 1e-3
    the biases move 0.2 in 200 steps, too little here to undo the collapse (max/mean 3.0 at step 200)."""
    steps = {rate: total for rate, (total, _) in real_text["runs"].items()}
    stdout = (real_text["root"] / "real-text.stdout").read_text()
    runs = {rate: metrics(real_text["root"] / f"rate-{rate}") for rate in steps}
    for rate, total in steps.items():
        printed = re.findall(rf"^step +\d+/{total} \| .* \| experts max/mean (\d\.\d\d) \|", stdout, re.M)
        assert printed == [f"{r['moe_load_max_mean']:.2f}" for r in runs[rate] if r["step"] % 50 == 0]
    balanced, unbalanced = runs["1e-2"], runs["0"]
    validation = [r["val_loss"] for r in balanced if "val_loss" in r]
    assert len(validation) == 8 and validation[-1] < validation[0] - 0.05, validation
    assert all(later <= earlier + 0.01 for earlier, later in zip(validation, validation[1:], strict=False)), validation

    def late_load(records: list[dict]) -> float:
        return sum(r["moe_load_max_mean"] for r in records[-50:]) / 50

    print(f"late max/mean: balanced {late_load(balanced):.2f}, unbalanced {late_load(unbalanced):.2f}")
    assert late_load(balanced) < 2.0 < 3.5 < late_load(unbalanced), (late_load(balanced), late_load(unbalanced))
    assert balanced[-1]["moe_bias_abs_max"] > 0.1 and unbalanced[-1]["moe_bias_abs_max"] == 0


def test_activation_checkpointing_modes_give_the_same_moe_numbers(tmp_path: Path) -> None:
    """Every block a mixture of experts (n_dense_layers 0: preflight's meta run of the first block under the
    selective policy meets the router's data-dependent token counts), the aux loss on: "selective", "layer" (every
    2nd block recomputed, the other not) and "full" give no AC's losses, grad norms and load figures. A recomputed
    block runs its router again in backward: its tokens must not count twice."""
    project = generate(tmp_path / "run", "--gpus", "2", "--fp32", "--moe", "--activation-checkpointing", "selective")
    # The 4 runs one plain process's, in this process (tests/helpers/several_runs.py: train.train() per run, each
    # with its own config, seed and output folder; captured_in_this_process: torch is imported here already).
    modes = ("none", "selective", "layer", "full")
    (tmp_path / "runs.json").write_text(json.dumps([
        [*TINY_MOE, "--model.n_dense_layers", "0", "--model.aux_loss_coef", "0.01", "--training.steps", "3",
         "--parallel.activation_checkpointing", mode, "--job.output_dir", str(tmp_path / mode)] for mode in modes
    ]))  # fmt: skip
    code, _, stderr = captured_in_this_process(project, several_runs.__file__, str(tmp_path / "runs.json"))
    assert code == 0, stderr[-3000:]
    runs = {mode: metrics(tmp_path / mode) for mode in modes}
    figures = ["loss", "grad_norm", "moe_aux_loss", *MOE_FIGURES]
    for mode in ("selective", "layer", "full"):
        for a, b in zip(runs["none"], runs[mode], strict=True):
            assert all(abs(a[name] - b[name]) <= 1e-6 for name in figures), (mode, a, b)
