"""Op-level selective activation checkpointing (`--activation-checkpointing selective`, torchtitan's policy in the
generated activation_checkpoint.py), proven on CPU:

- a generated project trains to the same losses and gradient norms (fp32, 2 gloo ranks, 1e-6) with
  parallel.activation_checkpointing selective, layer (every 2nd block whole), full and none;
- the policy keeps the 1st, 3rd, 5th and 7th matmul outputs and attention's (CPU's flash kernel), recomputes the
  rest, and decides the same in the recompute as in forward;
- what one block holds for backward, measured (tests/helpers/op_sac_probe.py), is exactly `fsdp2gen plan`'s
  op-level figure (block input aside), and less than without AC.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from fsdp2gen.plan_activations import block_activation_bytes, op_level_kept_bytes
from fsdp2gen.plan_shapes import FP32
from fsdp2gen.sizes import LlamaShape
from tests.conftest import HELPERS, TINY, generate, metrics, project_modules
from tests.helpers.scripts import run_in_this_process
from tests.helpers.several_runs import launch_several

MODES = ("selective", "layer", "full")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("sac") / "run-sac", "--gpus", "2", "--fp32", "--activation-checkpointing",
                    "selective")  # fmt: skip


def test_every_ac_mode_trains_to_the_numbers_of_no_ac(project: Path, tmp_path: Path) -> None:
    assert 'activation_checkpointing = "selective"' in (project / "config.toml").read_text()
    # The 4 runs in one launch of 2 ranks (tests/helpers/several_runs.py: train.train() per run, each with its own
    # config, seed and output folder).
    modes = ("none", *MODES)
    launch_several(project, [[*TINY, "--model.n_layers", "3", "--training.steps", "3", "--job.device", "cpu",
                              "--parallel.activation_checkpointing", mode, "--job.output_dir", str(tmp_path / mode)]
                             for mode in modes], tmp_path / "runs.json", nproc=2)  # fmt: skip
    runs = {mode: [(record["loss"], record["grad_norm"]) for record in metrics(tmp_path / mode)] for mode in modes}
    assert len(runs["none"]) == 3
    for mode in MODES:
        for (loss, norm), (plain_loss, plain_norm) in zip(runs[mode], runs["none"], strict=True):
            assert abs(loss - plain_loss) <= 1e-6 and abs(norm - plain_norm) <= 1e-6 * plain_norm, (mode, runs)


def probe(project: Path, dim: int, heads: int, kv_heads: int, ffn: int, batch: int, seq: int) -> dict:
    """tests/helpers/op_sac_probe.py's report: one process, nothing distributed, so run in this one
    (run_in_this_process), its printed JSON captured."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_in_this_process(
            project, str(HELPERS / "op_sac_probe.py"), *map(str, (dim, heads, kv_heads, ffn, batch, seq))
        )
    return json.loads(printed.getvalue())


@pytest.mark.parametrize("shape", [(64, 4, 2, 172, 2, 32), (96, 6, 6, 256, 1, 48)], ids=["gqa", "mha"])
def test_policy_keeps_half_the_matmuls_and_attention_as_plan_counts(project: Path, shape: tuple) -> None:
    dim, heads, kv_heads, ffn, batch, seq = shape
    report = probe(project, *shape)
    assert set(report["max_grad_diff"].values()) == {0.0}  # every mode's gradients equal no AC's, bit for bit
    decisions = report["selective"]["decisions"]
    forward = [(op, choice) for phase, op, choice in decisions if phase == "forward"]
    recompute = [(op, choice) for phase, op, choice in decisions if phase == "recompute"]
    assert recompute == []  # the probe stops before backward: forward's decisions only
    mm = [choice for op, choice in forward if op == "aten.mm.default"]
    assert mm == ["MUST_SAVE", "PREFER_RECOMPUTE"] * 3 + ["MUST_SAVE"]  # wq wk wv wo w1 w3 w2
    kept = sorted({op for op, choice in forward if choice == "MUST_SAVE"})
    assert kept == ["aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.mm.default"]
    model = LlamaShape(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, vocab_size=8, ffn_dim=ffn)
    assert report["selective"]["held_bytes"] == op_level_kept_bytes(model, batch, seq, FP32)
    assert report["full"]["held_bytes"] == report["layer"]["held_bytes"] == 0  # the block's input only
    assert report["selective"]["held_bytes"] < 0.4 * report["none"]["held_bytes"]
    print(f"\n{shape}: held {report['selective']['held_bytes']} (op-level) vs {report['none']['held_bytes']} (none);"
          f" plan's block {block_activation_bytes(model, batch, seq, FP32)}")  # fmt: skip


# Records the policy's forward decisions for one block of the custom family (linear layers with a bias: aten.addmm,
# not aten.mm), and checks its gradients against the same block without AC.
CUSTOM_BLOCK = """
import torch
import activation_checkpoint
from config import load_config
from model import Block

decisions, policy_of = [], activation_checkpoint.op_policy


def recording(counts):
    policy = policy_of(counts)

    def decide(ctx, op, *args, **kwargs):
        choice = policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decisions.append((str(op), choice.name))
        return choice

    return decide


activation_checkpoint.op_policy = recording
config = load_config("config.toml")
torch.manual_seed(0)
block = Block(config.model)
x = torch.randn(2, 16, config.model.dim, requires_grad=True)
block(x).sum().backward()
plain = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
x.grad = None
block.zero_grad()
wrapped = activation_checkpoint.checkpoint_block(block, 0, config.parallel)
wrapped(x).sum().backward()
checkpointed = [x.grad, *(p.grad for p in block.parameters())]
print([(op, choice) for op, choice in decisions if choice == "MUST_SAVE" or "mm" in op])
print(all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True)))
"""


def test_selective_keeps_every_other_matmul_of_blocks_whose_linears_have_a_bias(tmp_path: Path) -> None:
    project = generate(tmp_path / "custom", "--family", "custom", "--gpus", "1", "--fp32",
                       "--activation-checkpointing", "selective")  # fmt: skip
    # In this process (nothing distributed): the project's modules imported here and forgotten after, the RNG set
    # back, what it prints captured.
    import torch

    printed = io.StringIO()
    with project_modules(project), contextlib.chdir(project), torch.random.fork_rng():
        with contextlib.redirect_stdout(printed):
            exec(compile(CUSTOM_BLOCK, "custom_block", "exec"), {"__name__": "__main__"})
    decisions, equal = printed.getvalue().strip().splitlines()
    # qkv, attention_out, mlp_in, mlp_out: the first and third kept; the attention kept.
    assert decisions == str([
        ("aten.addmm.default", "MUST_SAVE"),
        ("aten._scaled_dot_product_flash_attention_for_cpu.default", "MUST_SAVE"),
        ("aten.addmm.default", "PREFER_RECOMPUTE"),
        ("aten.addmm.default", "MUST_SAVE"),
        ("aten.addmm.default", "PREFER_RECOMPUTE"),
    ])  # fmt: skip
    assert equal == "True"
