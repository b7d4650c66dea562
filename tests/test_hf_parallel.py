"""Family hf with tensor parallelism (`--tp`), from the plan each transformers model declares (tensor_parallel.py): tiny
Qwen3 (tied embeddings, per-head q_norm / k_norm), Mistral, Qwen3-MoE and Mixtral (mixtures of experts, untied
embeddings) checkpoints made here with save_pretrained, trained by a generated project on tp 2 x dp 2 (4 gloo ranks,
the four models' runs in one launch: tests/helpers/several_runs.py) and by one process; both must agree in losses,
gradient norms and final weights, and step 1's loss must be plain transformers' on the same batch. (Llama's plan is
Mistral's, word for word.) Qwen3's run has rank 3 killed in the middle of a step and restarted by torchrun: it
resumes bit for bit; its tp 2 x dp 2 checkpoint resumes on one process (tp 1), and the one process's checkpoint with
tp 2, both as the uninterrupted run; scripts/export.py and generate.py read its checkpoints (and the 3-D ones below)
as one process's. GPT-2, which declares no plan, is refused in one line by `fsdp2gen new` and by preflight; the plans
fsdp2gen reads (templates/hf_plans.json, and the README's table made from them) are the installed transformers'.

All three dimensions at once: dp 2 x tp 2 x pp 2 on 8 ranks, two torchrun "nodes" of 4 on 127.0.0.1 with the
pipeline across them (dp x tp inside a node), trains untied Llama, Qwen3, Mistral, Qwen3-MoE and Mixtral as one
process does, in one launch (tests/helpers/several_runs.py); then Llama's run again, with one rank killed in the
middle of a step: both torchruns restart their ranks in place, which resume from the checkpoint and end as the
uninterrupted run, bit for bit.

No network: every model is a local folder written by the test.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELPERS, REPO, fsdp2gen, generate, metrics, save_tiny_models, torchrun_env
from tests.helpers.exports import assert_read_as_one_process
from tests.helpers.scripts import captured_in_this_process
from tests.helpers.several_runs import assert_resumed_bit_for_bit, launch_several
from tests.helpers.slurm_cluster import free_port

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}  # fmt: skip
# 6 steps, checkpoints at steps 3 and 6: step-3 is what the resumes start from.
TRAIN = ["--training.seq_len", "16", "--training.global_batch_size", "4", "--training.warmup_steps", "2",
         "--training.lr", "1e-3", "--training.steps", "6", "--checkpoint.interval", "3", "--eval.every", "0",
         "--job.device", "cpu", "--job.log_every", "1"]  # fmt: skip
STEPS = [1, 2, 3, 4, 5, 6]
TOLERANCE = 1e-5  # fp32: the tp ranks sum partial matmuls in another order than one process
# lr 1e-3 and 2e-5 for the weights, as tests/test_moe.py and test_pipeline_parallel.py's tp runs: Adam divides each
# gradient element by its magnitude, so an element whose terms nearly cancel keeps its summation-order roundoff at
# up to lr x 1e-2 in the weights (measured here after 3 steps: 1.0e-5 at most; at lr 1e-2, 1.0e-4), while the
# losses, gradient norms and Adam moments agree within 1e-5.
WEIGHTS_TOLERANCE = 2e-5
MODELS = ("qwen3-tied", "mistral", "qwen3-moe", "mixtral")
# The model whose tp 2 x dp 2 run is killed mid-step, and whose checkpoints resume across layouts: the riskiest
# plan (a tied, vocabulary-split embedding and output layer; replicated q_norm / k_norm DTensors).
RESUMED = "qwen3-tied"

# dp 2 x tp 2 x pp 2: untied models (a pipeline cannot share one matrix between its first and last stage), 1F1B's
# 2 micro-batches per step (as many as pp ranks). Each model is one more run in the same launch.
PP_MODELS = ("llama", "qwen3", "mistral", "qwen3-moe", "mixtral")
TRAIN_PP = [*TRAIN, "--training.grad_accum_steps", "2"]
LAYOUT_3D = ["--parallel.dp_replicate", "1", "--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "2"]

# The tp 2 x dp 2 run of RESUMED: on torchrun's first attempt rank 3 SIGKILLs itself in the middle of step 6, after
# its forward and backward (its gradients reduce-scattered), before the gradient norm's all-reduce and the optimizer
# step, while the other ranks wait in that all-reduce (several_runs.py's "kill"). The newest complete checkpoint is
# step-3's, so the restart recomputes steps 4 and 5, which the first attempt logged (metrics.rewound.jsonl keeps
# those rows).
KILL = {"rank": 3, "step": 6}
# By model: a run's folder and the output of the launch it ran in.
Runs = dict[str, tuple[Path, subprocess.CompletedProcess]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import (
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    root = tmp_path_factory.mktemp("hf-tp-models")
    configs = {
        "qwen3-tied": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=True),
        "mistral": MistralConfig(**SIZES, head_dim=16),
        "llama": LlamaConfig(**SIZES, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=False),
        # Mixtures of experts: the plans split attention (and Qwen3-MoE's names a dense MLP its MoE layers lack);
        # the experts stay whole on every tp rank, sharded by FSDP. Untied: lm_head's own plan
        # (colwise_gather_output).
        "qwen3-moe": Qwen3MoeConfig(
            **SIZES,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        "mixtral": MixtralConfig(**SIZES, head_dim=16, num_local_experts=4, num_experts_per_tok=2),
        "gpt2": GPT2Config(
            n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
    }
    return save_tiny_models(root, configs)


@pytest.fixture(scope="module")
def project(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One project; each run points model.path at its model.
    return generate(tmp_path_factory.mktemp("hf-tp") / "run", "--family", "hf", "--hf-model",
                    str(models["qwen3-tied"]), "--gpus", "4", "--tp", "2", "--fp32")  # fmt: skip


def model_path(models: dict[str, Path], name: str) -> list[str]:
    return ["--model.path", str(models[name])]


@pytest.fixture(scope="module")
def one_process(
    project: Path, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, float]]:
    """Every model trained by one process, one after the other, in this test's own process (tests/helpers/
    hf_one_process.py: train.py's training, then plain transformers' loss on step 1's batch; nothing distributed,
    so no process of its own): its run folder and that loss, by model; the references of the dp 2 x tp 2 x pp 2
    runs (TRAIN_PP) by "pp-" and the model."""
    root = tmp_path_factory.mktemp("hf-one")
    names = {**{name: TRAIN for name in MODELS}, **{f"pp-{name}": TRAIN_PP for name in PP_MODELS}}
    runs = [[*train, *model_path(models, name.removeprefix("pp-")), "--job.output_dir", str(root / name)]
            for name, train in names.items()]  # fmt: skip
    code, printed, stderr = in_this_process(project, str(HELPERS / "hf_one_process.py"), json.dumps(runs))
    assert code == 0, printed[-3000:] + stderr[-3000:]
    plain = dict(re.findall(r"^(\S+): plain transformers step 1 loss (\S+)$", printed, flags=re.M))
    return {name: (root / name, float(plain[str(root / name)])) for name in names}


def in_this_process(project: Path, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python ARGV` in `project`, run in this process (captured_in_this_process), the
    collector set back after (train.py freezes what the process holds once its imports are loaded)."""
    try:
        return captured_in_this_process(project, *argv)
    finally:
        gc.unfreeze()
        gc.enable()


@pytest.fixture(scope="module")
def tp2(
    project: Path, models: dict[str, Path], one_process: dict[str, tuple[Path, float]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Runs:  # fmt: skip
    """The tp 2 x dp 2 runs of every model in MODELS, in one launch of 4 ranks (tests/helpers/several_runs.py: torch
    and transformers imported once, each run its own train.train(), config and output folder), RESUMED's first and
    killed mid-step (KILL), then restarted by torchrun (restarts=1), which resumes it and goes on with the others;
    last, "on-tp2": one process's RESUMED run continued from its step-3 checkpoint (a copy of its folder as a run
    stopped after step 5 leaves it). By model (and "on-tp2"), its run folder and the launch's output."""
    root = tmp_path_factory.mktemp("hf-tp2")
    args = {name: [*TRAIN, *model_path(models, name), "--job.output_dir", str(root / name)] for name in MODELS}
    interrupted = {"from": str(one_process[RESUMED][0]), "remove": ["checkpoints/step-6"], "metrics_lines": 3}
    on_tp2 = {"args": [*args[RESUMED][:-1], str(root / "on-tp2")], "interrupted": interrupted}
    runs = [{"args": args[RESUMED], "kill": KILL}, *(args[name] for name in MODELS if name != RESUMED), on_tp2]
    result = launch_several(project, runs, root / "runs.json", nproc=4, restarts=1)
    return {name: (root / name, result) for name in (*MODELS, "on-tp2")}


def final_weights(run: Path, step: int = 6, part: str = "model") -> dict:
    """The model's weights (or another part of the training state) in the run's DCP checkpoint of `step`, whole
    tensors whatever the layout."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not (run / f"step-{step}.pt").exists():
        dcp_to_torch_save(run / "checkpoints" / f"step-{step}", run / f"step-{step}.pt")
    return torch.load(run / f"step-{step}.pt", weights_only=True)["train"][part]


def saved_pieces(run: Path, key: str, step: int = 6) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) of the pieces of model weight `key` that the ranks wrote to the run's DCP checkpoint of
    `step` (the checkpoint's metadata): the parts of the whole tensor the ranks held, sorted."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(run / "checkpoints" / f"step-{step}")).read_metadata()
    chunks = metadata.state_dict_metadata[f"train.model.{key}"].chunks
    return sorted((tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in chunks)


def assert_equal_to(run: Path, reference: Path, steps: list[int]) -> None:
    """`run`'s losses and gradient norms at `steps` and its final weights are `reference`'s, within fp32 rounding."""
    import torch

    mine = {row["step"]: row for row in metrics(run)}
    theirs = {row["step"]: row for row in metrics(reference)}
    assert sorted(mine) == sorted(theirs) == STEPS
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert mine[step][key] == pytest.approx(theirs[step][key], rel=TOLERANCE, abs=TOLERANCE), (key, step)
    weights, expected = final_weights(run), final_weights(reference)
    assert sorted(weights) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=WEIGHTS_TOLERANCE, msg=key)


@pytest.mark.parametrize("name", MODELS)
def test_tp2_dp2_trains_equal_to_one_process_and_to_plain_transformers(
    tp2: Runs, one_process: dict[str, tuple[Path, float]], models: dict[str, Path], name: str
) -> None:
    import torch
    from safetensors.torch import load_file

    (parallel, _), (single, plain) = tp2[name], one_process[name]
    # Losses, gradient norms and final weights (the checkpoints hold whole tensors whatever the layout).
    assert_equal_to(parallel, single, STEPS)
    assert metrics(parallel)[0]["loss"] == pytest.approx(plain, rel=TOLERANCE, abs=TOLERANCE)
    # Training moved them away from the pretrained ones (6 steps at lr 1e-3): the comparison is of trained weights.
    # (A mixture-of-experts file may hold each expert apart: the keys the model shares with it are compared.)
    trained = final_weights(single)
    pretrained = {key: value for key, value in load_file(models[name] / "model.safetensors").items()
                  if key in trained}  # fmt: skip
    assert pretrained and all(not torch.equal(trained[key], value) for key, value in pretrained.items())
    # The input embedding as tensor_parallel.py splits it over the tp ranks, FSDP its rows over the dp ranks: an
    # untied one by its dimension (DTensor's backward of a lookup split by vocabulary would give every tp rank the
    # whole gradient), a tied one by vocabulary as lm_head. Each rank's piece as it wrote it to the checkpoint.
    vocab, dim = SIZES["vocab_size"], SIZES["hidden_size"]
    if name == "qwen3-tied":
        expected = [((row, 0), (vocab // 4, dim)) for row in range(0, vocab, vocab // 4)]
    else:
        expected = [((row, column), (vocab // 2, dim // 2)) for row in (0, vocab // 2) for column in (0, dim // 2)]
    assert saved_pieces(parallel, "model.embed_tokens.weight") == expected


# The second Llama run of the 3-D launch: on the first attempt rank 5 (node 1's second rank, in the last stage)
# SIGKILLs itself in the middle of step 6, after its forward and backward, while the other 7 ranks wait in the
# gradient norm's all-reduce (several_runs.py's "kill"). Its torchrun restarts node 1's ranks, and node 0's torchrun,
# seeing node 1 join a new rendezvous round, restarts its own: all 8 resume from the step-3 checkpoint.
KILL_3D = {"rank": 5, "step": 6}
# The launch's output: the two torchruns' outputs, one after the other.
ThreeD = tuple[dict[str, Path], str]


@pytest.fixture(scope="module")
def three_d(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> ThreeD:
    """The dp 2 x tp 2 x pp 2 runs of PP_MODELS on 8 ranks, in one launch: two torchrun "nodes" of 4 ranks on
    127.0.0.1 (c10d rendezvous at node 0, as scripts/launch_multinode.sh starts them), each rank running the runs in
    turn (tests/helpers/several_runs.py), then Llama's again with a rank killed mid-step (KILL_3D) and both nodes
    restarted in place by their torchrun (--max-restarts 1). Their run folders, and the launch's output."""
    root = tmp_path_factory.mktemp("hf-3d")
    project = generate(root / "project", "--family", "hf", "--hf-model", str(models["llama"]), "--nodes", "2",
                       "--gpus", "4", "--tp", "2", "--pp", "2", "--fp32")  # fmt: skip
    runs = {name: root / name for name in (*PP_MODELS, "llama-killed")}
    args = {name: [*TRAIN_PP, *LAYOUT_3D, *model_path(models, name.removesuffix("-killed")), "--job.output_dir",
                   str(out)] for name, out in runs.items()}  # fmt: skip
    killed = {"args": args.pop("llama-killed"), "kill": KILL_3D}
    (root / "runs.json").write_text(json.dumps([*args.values(), killed]))
    port = free_port()
    torchrun_node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "4",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"3d-{port}",
                     "--max-restarts", "1", "--node-rank"]  # fmt: skip
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store for the ranks at each rendezvous round, as the generated
    # README tells anyone restarting ranks with torchrun across nodes. By default torch 2.13 keeps one store for
    # all rounds, where the restarted ranks read the addresses the killed attempt's ranks left and fail to connect
    # (gloo: "Connection refused"; measured); train.py's per-attempt store prefix (TORCHELASTIC_RESTART_COUNT) cannot
    # help across nodes: only the killed rank's torchrun counts the restart, node 0's still says 0.
    env = {**torchrun_env(), "PYTHONPATH": str(project), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = [
        subprocess.Popen(
            [*torchrun_node, str(node), str(HELPERS / "several_runs.py"), str(root / "runs.json")],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=900)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:  # past the timeout: the ranks die with their torchrun (ownership.py)
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return runs, "".join(outputs)


@pytest.mark.parametrize("name", PP_MODELS)
def test_dp2_x_tp2_x_pp2_on_two_launched_nodes_of_4_trains_equal_to_one_process_and_to_plain_transformers(
    three_d: ThreeD, one_process: dict[str, tuple[Path, float]], name: str
) -> None:
    # pp is the outermost dimension: node 0 holds the first stage (the embedding, layer 0), node 1 the last (layer 1,
    # the norm, lm_head); activations and gradients cross the launchers. Inside a node, each stage's layers are split
    # by the model's tp plan over 2 ranks, then sharded by FSDP over 2: the plan reaches only the modules the stage
    # holds (not the other stage's stand-ins), lm_head's logits stay split by vocabulary and the pipeline's loss
    # runs under loss_parallel.
    (run, (single, plain)) = three_d[0][name], one_process[f"pp-{name}"]
    info = json.loads((run / "checkpoints" / "step-6" / "checkpoint.json").read_text())
    parallel = info["config"]["parallel"]
    assert (info["world_size"], parallel["pp"], parallel["tp"], parallel["dp_shard"]) == (8, 2, 2, 2), info
    assert_equal_to(run, single, STEPS)
    assert metrics(run)[0]["loss"] == pytest.approx(plain, rel=TOLERANCE, abs=TOLERANCE)
    # The checkpoint holds the names of pp 1 and tp 1 (whole tensors, the whole model's parameter names), Adam's
    # moments too (the pipeline's optimizer state is saved flattened, one process's nested: the same names).
    assert optimizer_state_names(run) == optimizer_state_names(single)


def test_a_rank_killed_mid_step_on_two_nodes_of_dp2_x_tp2_x_pp2_restarts_both_and_ends_as_the_uninterrupted_run(
    three_d: ThreeD,
) -> None:
    # Each of the 8 restarted ranks loads its stage's tp and FSDP shards of the weights and of Adam's moments, the
    # data position and the RNG states from the step-3 checkpoint: steps 4 and 5, computed again, are the first
    # attempt's exactly (==), and the whole run, its final weights too, is the uninterrupted Llama run's, bit for bit.
    (runs, output), killed = three_d, KILL_3D
    run, uninterrupted = runs["llama-killed"], runs["llama"]
    assert_resumed_bit_for_bit(output, run, killed, 3, ("loss", "grad_norm"))
    # Rank 0 (on either node) began the killed run twice: the restart ran only it (the runs before it were done).
    assert len(re.findall(rf"^run \d+: .* {re.escape(str(run))}$", output, flags=re.M)) == 2, output[-3000:]
    rows = [(row["step"], row["loss"], row["grad_norm"]) for row in metrics(run)]
    assert rows == [(row["step"], row["loss"], row["grad_norm"]) for row in metrics(uninterrupted)]
    weights, expected = final_weights(run), final_weights(uninterrupted)
    assert weights.keys() == expected.keys() and all(weights[key].equal(value) for key, value in expected.items())


def test_export_and_generate_read_tp2_and_dp2_x_tp2_x_pp2_checkpoints_as_one_process_s(
    project: Path, tp2: Runs, three_d: ThreeD, one_process: dict[str, tuple[Path, float]]
) -> None:
    # scripts/export.py and generate.py read any layout's checkpoint as one process's: Qwen3's at tp 2 x dp 2 (its
    # tied embedding split by vocabulary), and Mixtral's at dp 2 x tp 2 x pp 2 (each stage's tp and FSDP shards,
    # the experts written back per expert).
    step = Path("checkpoints") / "step-6"
    assert_read_as_one_process(project, tp2[RESUMED][0] / step, one_process[RESUMED][0] / step, WEIGHTS_TOLERANCE)
    assert_read_as_one_process(project, three_d[0]["mixtral"] / step, one_process["pp-mixtral"][0] / step,
                               WEIGHTS_TOLERANCE)  # fmt: skip


def optimizer_state_names(run: Path) -> list[str]:
    """ "state.PARAMETER.FIELD" of every tensor of the optimizer state in the run's final checkpoint."""
    names = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        elif prefix.startswith("state."):
            names.append(prefix)

    walk("", final_weights(run, part="optimizer"))
    return sorted(names)


def test_a_rank_killed_mid_step_under_tp2_dp2_restarts_and_resumes_bit_for_bit(
    tp2: Runs,
) -> None:
    # torchrun --max-restarts 1 restarts all 4 ranks from the step-3 checkpoint: each loads its tp and FSDP shards
    # of the weights (the tied embedding, the vocabulary-split output layer) and of Adam's moments, the data
    # position and the RNG states. Steps 4 and 5, computed again, are the first attempt's exactly (==): step 5's
    # loss and gradient norm are made from step 4's update, Adam's restored moments included. (The whole run
    # equals one process: the test above, with this run.)
    run, result = tp2[RESUMED]
    assert "rank 3: SIGKILL in step 6, before its optimizer step" in result.stdout, result.stdout[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-3'} at step 3" in result.stdout, result.stdout[-3000:]
    first_attempt = metrics(run, "metrics.rewound.jsonl")
    assert [row["step"] for row in first_attempt] == [4, 5]
    resumed = {row["step"]: row for row in metrics(run)}
    assert sorted(resumed) == STEPS
    for row in first_attempt:
        step = row["step"]
        assert (resumed[step]["loss"], resumed[step]["grad_norm"]) == (row["loss"], row["grad_norm"]), step


def test_checkpoints_resume_across_layouts_tp2_dp2_to_one_process_and_one_process_to_tp2(
    tp2: Runs, one_process: dict[str, tuple[Path, float]], project: Path,
    models: dict[str, Path], tmp_path: Path,
) -> None:  # fmt: skip
    (parallel, _), (single, _), (back, launch) = tp2[RESUMED], one_process[RESUMED], tp2["on-tp2"]
    # tp 2 x dp 2's checkpoint (DTensor shards on a 2 x 2 mesh) continued by one process without tp, in this
    # test's process (nothing distributed), from the run folder as it was at step 3: its step-3 checkpoint the
    # newest.
    shutil.copytree(parallel, tmp_path / "on-one", ignore=shutil.ignore_patterns("step-6*"))
    one = [*TRAIN, *model_path(models, RESUMED), "--parallel.tp", "1", "--job.output_dir", str(tmp_path / "on-one")]
    code, printed, stderr = in_this_process(project, "train.py", *one)
    assert code == 0, printed[-3000:] + stderr[-3000:]
    # And back: one process's checkpoint (whole tensors) continued with tp 2 x dp 2 on 4 ranks (the tp2 launch).
    for output, run in ((printed, tmp_path / "on-one"), (launch.stdout, back)):
        assert f"resumed from {run / 'checkpoints' / 'step-3'} at step 3" in output, output[-3000:]
        # Steps 4-6 and the final weights: the uninterrupted run's (one process's, and so tp 2 x dp 2's).
        assert_equal_to(run, single, [4, 5, 6])


# Run in the tp project: preflight.py with --world-size 4 (its output captured), then which plan words
# tensor_parallel.torch_style translates, of every word transformers registers and those README.md.jinja lists.
PREFLIGHT_AND_WORDS = """
import contextlib, io, json, sys
import preflight, tensor_parallel
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

argv, listed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["preflight.py", *argv]
stderr, code = io.StringIO(), 0
with contextlib.redirect_stderr(stderr):
    try:
        preflight.main()
    except SystemExit as exit:
        code = exit.code
words = sorted(set(ALL_PARALLEL_STYLES.keys()) | set(listed))
translated = [word for word in words if word == "replicate" or tensor_parallel.torch_style(word, False) is not None]
print(json.dumps({"code": code, "stderr": stderr.getvalue(), "translated": translated}))
"""


def test_a_model_without_a_tp_plan_is_refused_at_new_and_at_run_time_and_the_plans_are_transformers(
    project: Path, models: dict[str, Path], tmp_path: Path
) -> None:
    # fsdp2gen new: one line, exit 2, nothing written (templates/hf_plans.json says gpt2 declares no plan).
    new = fsdp2gen("new", str(tmp_path / "gpt2-tp"), "--yes", "--family", "hf", "--hf-model", str(models["gpt2"]),
                   "--gpus", "4", "--tp", "2")  # fmt: skip
    config = models["gpt2"] / "config.json"
    version = json.loads((REPO / "templates" / "hf_plans.json").read_text())["transformers"]
    assert (new.returncode, new.stderr) == (2, (
        f"fsdp2gen: error: --tp: GPT2LMHeadModel ({config}: model_type gpt2) declares no tensor-parallel plan in "
        f"transformers {version} (its config class's base_model_tp_plan is empty); use --tp 1 (FSDP shards it over "
        "every GPU)\n"
    ))  # fmt: skip
    assert not (tmp_path / "gpt2-tp").exists()
    # Run time: the tp project pointed at GPT-2 stops in preflight, before anything is built.
    readme_words = re.search(r"set hf_tp_words = (\[.*?\])", (REPO / "templates" / "project" / "README.md.jinja")
                             .read_text()).group(1)  # fmt: skip
    argv = ["--world-size", "4", *TRAIN, "--model.path", str(models["gpt2"]), "--job.output_dir",
            str(tmp_path / "out")]  # fmt: skip
    # In this test's process (a probe script of its own): preflight imports transformers, already imported here.
    (tmp_path / "probe.py").write_text(PREFLIGHT_AND_WORDS)
    code, printed, stderr = in_this_process(project, str(tmp_path / "probe.py"), json.dumps(argv), readme_words)
    assert code == 0, stderr[-3000:]
    found = json.loads(printed.splitlines()[-1])
    assert (found["code"], found["stderr"]) == (2, (
        "preflight.py: error: parallel.tp = 2: GPT2LMHeadModel declares no tensor-parallel plan (transformers' "
        "GPT2Config.base_model_tp_plan is empty); use --parallel.tp 1 (FSDP shards it over every rank)\n"
    ))  # fmt: skip
    assert not (tmp_path / "out").exists()
    # The README's table calls translated exactly the words tensor_parallel.py translates.
    assert found["translated"] == sorted(json.loads(readme_words))
    # templates/hf_plans.json is what the installed transformers declares (else: python scripts/hf_plans.py).
    code, _, stderr = in_this_process(REPO, "scripts/hf_plans.py", "--check")
    assert code == 0, stderr[-2000:]
