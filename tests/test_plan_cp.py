"""`fsdp2gen plan` with context parallelism (--cp, parallel.cp): each rank of a cp group holds seq_len / cp tokens
of every sample, parameters are sharded over dp_shard x cp, and ring attention gathers the layer's whole K/V.
The figures are checked against references computed here from the shapes, and by properties over drawn setups."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp2gen.plan import SWEEP_SEQ_LENS, build_request, estimate
from fsdp2gen.plan_activations import ring_attention_bytes
from fsdp2gen.plan_layout import AC_MODES, PlanRequest
from fsdp2gen.plan_shapes import SIZES
from fsdp2gen.sizes import LlamaShape
from tests.conftest import HELPERS, generate, invoke, torchrun_env
from tests.helpers.plan_simulation import simulate_rows

PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
BF16, FP32 = 2, 4
GIB = 2**30
STATE = ("parameters", "gradients", "optimizer_state", "model_buffers", "all_gather_buffers", "reduce_scatter_buffers")


def plan_json(*args: str) -> dict:
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_8b_at_128k_with_cp_4_from_first_principles() -> None:
    # Llama 3 8B, 8 GPUs, bf16, full AC, one sample of 131072 tokens split over cp 4: dp_shard 2 x cp 4.
    seq, cp, gpus = 131072, 4, 8
    plan = plan_json(*("--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full"),
                     *("--seq", str(seq), "--cp", str(cp)))  # fmt: skip
    one = plan_json("--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full",
                    "--seq", str(seq // cp))  # fmt: skip
    per_gpu, model = plan["per_gpu_bytes"], plan["model"]
    assert plan["setup"]["fsdp_ranks"] == gpus and plan["setup"]["cp"] == cp
    # FSDP shards over dp_shard x cp = all 8 GPUs: every matrix of the 8b model splits 8 ways exactly, fp32.
    params = 8_030_261_248
    assert per_gpu["parameters"] == per_gpu["gradients"] == FP32 * params // gpus
    # A rank holds seq / cp tokens: its saved activations and the loss's are those of a seq / cp sample.
    assert plan["activations_bytes"] == one["activations_bytes"]
    assert per_gpu["loss_backward"] == one["per_gpu_bytes"]["loss_backward"]
    # Full AC keeps each block's bf16 input: 32 x (seq / cp) x dim x 2 bytes = 8 GiB of the 18.6.
    assert 32 * (seq // cp) * model["dim"] * BF16 == 8 * GIB < plan["activations_bytes"]["full"]
    # Ring attention's backward under torch's default all-gather rotation: the whole sequence's K and V (8 kv heads
    # x 128, bf16), and per local element of q, K/V and logsumexp what test_ring_attention_bytes_are_torchs measures.
    local_kv = 2 * (seq // cp) * model["n_kv_heads"] * (model["dim"] // model["n_heads"])
    local_q, local_lse = (seq // cp) * model["dim"], (seq // cp) * model["n_heads"]
    gathered = BF16 * 2 * seq * 8 * 128
    expected = gathered + (2 * FP32 + BF16 // 2) * local_q + (4 * BF16 + 2 * FP32) * local_kv + FP32 // 2 * local_lse
    assert per_gpu["ring_attention"] == expected and one["per_gpu_bytes"]["ring_attention"] == 0
    assert round(expected / GIB, 2) == 2.63  # of the 41.2 GiB total
    # The peak is the blocks' backward (every row but the loss's) or the loss's backward.
    in_blocks = sum(v for k, v in per_gpu.items() if k not in ("total", "loss_backward"))
    assert in_blocks <= per_gpu["total"] <= in_blocks + per_gpu["loss_backward"] and plan["fits"]


def test_torch_rotates_kv_with_all_gather_by_default() -> None:
    # ring_attention_bytes models the all-gather rotation: if torch's default changes, so must plan.
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options, _RotateMethod

    assert _cp_options.rotate_method == _RotateMethod.ALL_GATHER


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_bytes_are_torchs(cp: int, tmp_path: Path) -> None:
    # torch's own ring attention forward and backward on cp gloo ranks (the attention kernel stubbed to its
    # outputs), measured by MemTracker: plan's row is the backward's peak for grouped-query attention (every Llama 3
    # size: n_heads >= 2 x n_kv_heads), bf16 and fp32. Most runs measure exactly plan's figure; when an async
    # collective's buffer outlives that moment (timing) the measurement is up to one q-sized tensor more.
    shapes = [[512, 8, 2, 16, "bfloat16"], [256, 32, 8, 32, "bfloat16"], [256, 4, 2, 64, "float32"]]
    out = tmp_path / "ring.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp),
               str(HELPERS / "ring_attention_memory.py"), str(out), json.dumps(shapes)]  # fmt: skip
    result = subprocess.run(command, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    for (seq, heads, kv_heads, head_dim, dtype), measured in zip(shapes, json.loads(out.read_text()), strict=True):
        model = LlamaShape(dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, vocab_size=2,
                           ffn_dim=1, max_seq_len=seq)  # fmt: skip
        compute = {"bfloat16": BF16, "float32": FP32}[dtype]
        plan = ring_attention_bytes(model, 1, seq, compute, tp=1, cp=cp)
        q_bytes = compute * (seq // cp) * heads * head_dim
        assert measured["forward"] < measured["backward"]
        assert 0 <= measured["backward"] - plan <= q_bytes, (seq, heads, kv_heads, plan, measured)


@st.composite
def setups(draw: st.DrawFn) -> tuple[PlanRequest, int]:
    """A llama shape (a preset or a small drawn one), a layout on 8 or 16 GPUs, and a sequence long enough for
    every cp up to 8 to split it evenly (a multiple of 2 x 8 x tp x loss_chunks)."""
    tp = draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        model = SIZES[draw(st.sampled_from(["125m", "1b", "8b"]))]
    else:
        kv = draw(st.sampled_from([2, 4]))
        heads = kv * draw(st.integers(1, 4))
        model = LlamaShape(
            dim=heads * draw(st.sampled_from([8, 16, 64])),
            n_layers=draw(st.integers(1, 6)),
            n_heads=heads,
            n_kv_heads=kv,
            vocab_size=draw(st.integers(2, 5000)),
            ffn_dim=tp * draw(st.integers(1, 600)),
            max_seq_len=8,
        )
    chunks = draw(st.sampled_from([1, 8]))
    seq = 2 * 8 * tp * chunks * draw(st.integers(1, 64))
    request = PlanRequest(
        model=replace(model, max_seq_len=seq),
        label="drawn",
        gpus=8,
        nodes=draw(st.sampled_from([1, 2])),
        precision=draw(st.sampled_from(["fp32", "bf16"])),
        tp=tp,
        seq_len=seq,
        micro_batch=draw(st.integers(1, 3)),
        grad_accum_steps=draw(st.sampled_from([1, None])),
        loss_chunks=chunks,
    )
    return request, tp


@PROPERTY
@given(setups())
def test_cp_splits_the_sequence_and_leaves_the_state(setup: tuple[PlanRequest, int]) -> None:
    request, tp = setup
    plans = {cp: estimate(replace(request, cp=cp), with_levers=False) for cp in (1, 2, 4, 8) if 8 % (cp * tp) == 0}
    base = plans[1]
    for cp, plan in plans.items():
        # Parameters, gradients, optimizer state and FSDP's buffers: sharded over dp_shard x cp = world / tp.
        assert {key: plan.per_gpu[key] for key in STATE} == {key: base.per_gpu[key] for key in STATE}
        for mode in AC_MODES:
            # Every saved activation is linear in the rank's tokens (seq / cp), but cross_entropy's 4-byte weight.
            assert plan.activations[mode] - FP32 == (base.activations[mode] - FP32) // cp
            assert (base.activations[mode] - FP32) % cp == 0
        assert plan.per_gpu["loss_backward"] <= base.per_gpu["loss_backward"]
    ordered = list(plans.values())
    for smaller, larger in zip(ordered, ordered[1:], strict=False):
        assert all(larger.activations[mode] <= smaller.activations[mode] for mode in AC_MODES)
        # Beyond cp 2 the ring attention's memory shrinks too (its gathered K/V stays the whole sequence's).
        if smaller.request.cp > 1:
            assert larger.per_gpu["ring_attention"] <= smaller.per_gpu["ring_attention"]
            assert larger.per_gpu["total"] <= smaller.per_gpu["total"]


@PROPERTY
@given(seq=st.integers(1, 2**20), cp=st.sampled_from([1, 2, 4, 8]), tp=st.sampled_from([1, 2, 4]))
def test_a_sequence_the_project_refuses_is_refused(seq: int, cp: int, tp: int) -> None:
    # The project's layout.py refuses a sequence that does not cut into 2 x cp x tp equal pieces (load balancing),
    # or whose seq / cp tokens per rank the chunked loss (training.loss_chunks, 8 for --size) does not divide.
    args = ["--size", "8b", "--gpus", "8", "--seq", str(seq), "--cp", str(cp), "--tp", str(tp)]
    result = invoke("plan", *args)
    step = 2 * cp * tp
    whole = math.lcm(step, 8 * cp)  # the suggested length passes both checks
    suggested = max(whole, seq // whole * whole)
    if cp * tp > 8:
        assert result.exit_code == 2
        assert result.stderr == f"fsdp2gen: error: --cp {cp} x --tp {tp} does not divide 8 GPUs; choose degrees " \
            "whose product divides it\n"  # fmt: skip
        return
    if seq % tp:
        assert result.exit_code == 2 and result.stderr.startswith(f"fsdp2gen: error: --tp {tp} must divide")
        return
    if cp > 1 and seq % step:
        message = f"--cp {cp}: the sequence length ({seq}) must be divisible by 2 x cp x tp ({step}); e.g. --seq "
    elif cp > 1 and seq // cp % 8:
        message = f"--cp {cp}: training.loss_chunks (8) must divide the {seq // cp} tokens each context-parallel " \
            "rank holds (seq / cp); e.g. --seq "  # fmt: skip
    else:
        assert result.exit_code == 0, result.stderr
        return
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}{suggested}\n")
    # The suggested length is accepted.
    assert invoke("plan", *args[:5], str(suggested), *args[6:]).exit_code == 0


def test_cp_refusals_name_the_fix(tmp_path: Path) -> None:
    cases = {
        ("--size", "8b", "--cp", "3"): "--cp 3 does not divide 8 GPUs; choose a divisor",
        ("--size", "8b", "--gpus", "1", "--cp", "2"): "--cp 2 does not divide 1 GPUs; choose a divisor",
        ("--size", "8b", "--cp", "0"): "--cp must be at least 1, got 0; give --cp 1 or more",
        ("--size", "8b", "--cp-sweep", "--seq", "8192"): "--cp-sweep plans seq 32768 to 262144 with cp 1 to 8 "
        "itself; drop --seq",
        ("--size", "8b", "--cp-sweep", "--cp", "2"): "--cp-sweep plans seq 32768 to 262144 with cp 1 to 8 itself; "
        "drop --cp",
    }
    for args, message in cases.items():
        result = invoke("plan", *args)
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}\n"), args
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))  # fmt: skip
    # An hf model's cp is planned as llama's (the same torch context_parallel over SDPA): ring attention's buffers.
    result = invoke("plan", "--hf-config", str(hf), "--cp", "2", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["per_gpu_bytes"]["ring_attention"] > 0, result.stderr
    result = invoke("plan", "--hf-config", str(hf), "--cp-sweep")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == "fsdp2gen: error: --cp-sweep: plan models context parallelism for family llama only; " \
        "plan a llama with --size\n"  # fmt: skip


def test_config_parallel_cp_is_read_and_a_flag_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        "[model]\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nvocab_size = 130\nffn_dim = 172\n"
        "max_seq_len = 64\n\n[training]\nseq_len = 64\nglobal_batch_size = 8\n\n[parallel]\ncp = 4\n"
    )
    plan = plan_json("--config", str(config), "--gpus", "8")
    # 8 GPUs: dp_shard 2 x cp 4; the global batch of 8 samples is read by the 2 data ranks, 4 samples each.
    assert (plan["setup"]["cp"], plan["setup"]["fsdp_ranks"], plan["setup"]["micro_batch"]) == (4, 8, 4)
    assert plan_json("--config", str(config), "--gpus", "8", "--cp", "1")["setup"]["micro_batch"] == 1
    # The project's preflight refuses ring attention with document masking: so does plan.
    masked = tmp_path / "masked" / "config.toml"
    masked.parent.mkdir()
    masked.write_text(config.read_text() + "\n[data]\ndocument_mask = true\n")
    result = invoke("plan", "--config", str(masked), "--gpus", "8")
    assert (result.exit_code, result.stdout) == (2, "") and result.stderr == (
        f"fsdp2gen: error: {masked}: cp 4 cannot mask documents (ring attention is causal over the whole sequence); "
        "set data.document_mask = false there, or plan with --cp 1\n"
    )
    assert plan_json("--config", str(masked), "--gpus", "8", "--cp", "1")["setup"]["cp"] == 1
    masked.write_text(masked.read_text().replace("document_mask = true", "document_mask = false"))
    assert plan_json("--config", str(masked), "--gpus", "8")["setup"]["cp"] == 4
    config.write_text(config.read_text().replace("cp = 4", "cp = 0"))
    result = invoke("plan", "--config", str(config))
    assert result.exit_code == 2 and result.stderr == (
        f"fsdp2gen: error: {config}: parallel.cp must be a positive int, got 0; fix that value in the file\n"
    )


def test_a_long_sequence_that_does_not_fit_is_offered_the_smallest_cp_that_fits() -> None:
    # 8B at 128k with full AC: 108 GiB per GPU without CP; cp 2 halves the activations and fits an 80 GB H100.
    plan = plan_json("--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full",
                     "--seq", "131072")  # fmt: skip
    assert not plan["fits"]
    lever = plan["levers"][0]
    assert lever["option"] == "--cp 2" and lever["fits"]
    with_cp = plan_json("--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full",
                        "--seq", "131072", "--cp", "2")  # fmt: skip
    assert with_cp["per_gpu_bytes"]["total"] == lever["total_bytes"] and with_cp["levers"] == []
    # Op-level AC at 256k fits no cp up to 8: the largest one is offered, still not fitting.
    op = plan_json("--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "selective",
                   "--seq", "262144")  # fmt: skip
    cps = [lever for lever in op["levers"] if lever["option"].startswith("--cp ")]
    assert [(lever["option"], lever["fits"]) for lever in cps] == [("--cp 8", False)]


def test_the_cp_lever_of_a_project_keeps_its_global_batch(tmp_path: Path) -> None:
    # A project's 8 samples per step on 8 GPUs: with cp 2 only 4 ranks read different samples, so the lever doubles
    # grad_accum_steps to keep one sample per forward (and the global batch).
    config = tmp_path / "config.toml"
    config.write_text('[model]\nsize = "8b"\nmax_seq_len = 131072\n\n[training]\nseq_len = 131072\n'
                      "global_batch_size = 8\n")  # fmt: skip
    args = ("--config", str(config), "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full")
    plan = plan_json(*args)
    assert plan["setup"]["micro_batch"] == 1 and not plan["fits"]
    lever = plan["levers"][0]
    assert lever["option"] == "--cp 2 (2x the grad_accum_steps)" and lever["fits"]
    config.write_text(config.read_text() + "grad_accum_steps = 2\n")
    with_cp = plan_json(*args, "--cp", "2")
    assert with_cp["setup"]["micro_batch"] == 1 and with_cp["per_gpu_bytes"]["total"] == lever["total_bytes"]


def test_cp_sweep_prints_a_table_of_seq_by_cp() -> None:
    args = ("plan", "--size", "8b", "--gpus", "8", "--precision", "bf16", "--activation-checkpointing", "full")
    result = invoke(*args, "--cp-sweep")
    assert result.exit_code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "llama 8b: 8 GPU(s) x 1 node(s), bf16, full AC, micro-batch 1, h100-80gb"
    assert lines[3].split() == ["seq_len", "cp", "1", "cp", "2", "cp", "4", "cp", "8"]
    rows = [line.split() for line in lines[4:]]
    assert [int(row[0]) for row in rows] == list(SWEEP_SEQ_LENS) and len(lines) == 8
    # Each cell is the single plan's activations / total (GiB), * where it does not fit.
    for row in rows:
        cells = " ".join(row[1:]).split()
        assert len(cells) == 3 * 4 and cells[1::3] == ["/"] * 4
        for cp, activations, total in zip((1, 2, 4, 8), cells[0::3], cells[2::3], strict=True):
            plan = plan_json(*args[1:], "--seq", row[0], "--cp", str(cp))
            assert activations == f"{plan['activations_bytes']['full'] / GIB:.1f}"
            assert total == f"{plan['per_gpu_bytes']['total'] / GIB:.1f}" + ("" if plan["fits"] else "*")
    # The rule of thumb README.md states: on 80 GB with full AC, 128k needs cp 2 and 256k cp 4.
    fits = {row[0]: [not cell.endswith("*") for cell in " ".join(row[1:]).split()[2::3]] for row in rows}
    assert fits == {"32768": [True] * 4, "65536": [True] * 4, "131072": [False, True, True, True],
                    "262144": [False, False, True, True]}  # fmt: skip
    # Four GPUs allow cp 1, 2 and 4; --json gives every plan.
    four = invoke("plan", "--size", "8b", "--gpus", "4", "--cp-sweep").stdout.splitlines()
    assert four[3].split() == ["seq_len", "cp", "1", "cp", "2", "cp", "4"]
    plans = json.loads(invoke(*args, "--cp-sweep", "--json").stdout)
    assert [(p["setup"]["seq_len"], p["setup"]["cp"]) for p in plans] == [
        (seq, cp) for seq in SWEEP_SEQ_LENS for cp in (1, 2, 4, 8)
    ]
    assert "--cp-sweep" in invoke("plan", "--help").stdout


def test_build_request_takes_cp() -> None:
    request = build_request(size="8b", gpus=8, cp=2, seq=65536)
    assert (request.cp, request.data_ranks, request.fsdp_ranks, request.local_seq_len) == (2, 4, 8, 32768)


def test_the_projects_simulation_refuses_cp_in_one_line_and_simulates_its_cp_1(tmp_path: Path) -> None:
    # scripts/plan_memory.py of a cp project: torch's context_parallel does not run on fake tensors, so cp > 1 is one
    # line naming the way out (the config's cp 1, or `fsdp2gen plan`), exit 2, before anything is built; with
    # --parallel.cp 1 the project's own train_step (which takes the mesh in a cp project) is simulated.
    # Both runs are the script's main() in one process (simulate_rows: torch imported once), as launches print them.
    project = generate(tmp_path / "run", "--gpus", "4", "--cp", "2", "--fp32")
    config = project / "config.toml"
    refused, result = simulate_rows(project, [config, config], ["text:4", "4 --parallel.cp 1"])
    assert (refused["exit"], refused["stdout"], refused["stderr"]) == (2, "", (
        "plan_memory.py: error: parallel.cp = 2 is not simulated (torch's context_parallel does not run on fake "
        "tensors); simulate with --parallel.cp 1 (`fsdp2gen plan` plans cp)\n"
    ))  # fmt: skip
    assert 0 < result["allocated"] <= result["reserved"]
