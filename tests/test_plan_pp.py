"""`fsdp2gen plan --pp N`: pipeline parallelism planned for its worst stage (fsdp2gen/plan_pp.py). The rows of a small
shape by hand, the in-flight activations against torch's own schedule order, the bubble, the refusals as exact
lines, and properties over drawn (n_layers, pp, V, m, GPUs): planned or refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp2gen import plan_pp
from fsdp2gen.plan import estimate
from fsdp2gen.plan_activations import activation_bytes, block_activation_bytes
from fsdp2gen.plan_layout import AC_MODES, PlanError, PlanRequest
from fsdp2gen.plan_request import _check_request
from fsdp2gen.plan_shapes import SIZES
from fsdp2gen.sizes import LlamaShape
from tests.conftest import invoke

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FP32 = 4
# dim 64, 4 heads of 16, 2 kv heads, 4 blocks: every matrix splits over 2 FSDP ranks exactly.
SMALL = LlamaShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=32)


def small_request(**changes: object) -> PlanRequest:
    base = PlanRequest(model=SMALL, label="small", gpus=4, precision="fp32", seq_len=32, micro_batch=1,
                       grad_accum_steps=4, pp=2)  # fmt: skip
    return replace(base, **changes)


def plan_json(*args: str) -> dict:
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_small_shape_by_hand_1f1b() -> None:
    # pp 2 on 4 GPUs: FSDP over 2 ranks per stage. Stage 0: blocks 0-1 + embedding; stage 1: blocks 2-3 + norm +
    # output. A block: norms 2 x 64, wq 64x64, wk and wv 32x64, wo 64x64, w1 w3 128x64, w2 64x128 = 36992 elements.
    block, embedding, output = 64 + 4096 + 2048 + 2048 + 4096 + 64 + 3 * 8192, 256 * 64, 256 * 64
    assert block == 36992
    plan = estimate(small_request())
    ranks = plan.pipeline["ranks"]
    assert [r["blocks"] for r in ranks] == [[[0, 2]], [[2, 4]]]
    # 1F1B: stage s holds min(m, pp - s) micro-batches: 2 on the first, 1 on the last.
    assert [r["in_flight"] for r in ranks] == [2, 1]
    assert plan.pipeline["bubble_fraction"] == 1 / (4 + 1)  # (pp - 1) / (m + pp - 1)
    first, last = plan_pp.rank_stages(small_request())
    # fp32 shards of this stage's parameters over 2 ranks; AdamW: 2 more, and a step per tensor (19 and 20 tensors).
    assert first.per_gpu["parameters"] == FP32 * (2 * block + embedding) // 2 == 180736
    assert last.per_gpu["parameters"] == FP32 * (2 * block + 64 + output) // 2 == 180864
    assert first.per_gpu["optimizer_state"] == 2 * 180736 + FP32 * 19
    assert last.per_gpu["optimizer_state"] == 2 * 180864 + FP32 * 20
    # No reshard under PP: the stage stays gathered, its fp32 gradients unsharded until the last micro-batch.
    assert first.per_gpu["all_gather_buffers"] == first.per_gpu["deferred_gradients"] == FP32 * (2 * block + embedding)
    # A block's saved tensors for 1 x 32 tokens in fp32 (block_activation_bytes' count): norms 2 x 8 x 2048,
    # q k v out 4 x (2048 + 1024 + 1024 + 2048), the MLP 4 x 4 x 4096, rsqrt and logsumexp 4 x (64 + 128), the
    # inputs of wq/wk/wv and w1/w3 4 x 2 x 2048.
    one = 2 * 8 * 2048 + 4 * (2048 + 2 * 1024 + 2048) + 16 * 4096 + 4 * (64 + 128) + 8 * 2048
    assert block_activation_bytes(SMALL, 1, 32, FP32) == one == 140032
    assert first.activations["none"] == 2 * 2 * one  # 2 micro-batches x 2 blocks
    assert first.activations["full"] == 2 * 2 * FP32 * 32 * 64 + one  # their inputs, and one block recomputed
    # The last stage: 1 micro-batch of its 2 blocks and the loss's saved tensors (of the whole logits: loss_chunks is
    # 1 under PP), with the logits themselves (fp32, 32 x 256), which the schedule keeps as the stage's output.
    head = activation_bytes(SMALL, 1, 32, FP32, "none", loss_chunks=1) - 4 * one + FP32 * 32 * 256
    assert last.activations["none"] == 2 * one + head
    assert last.per_gpu["loss_backward"] > 0 == first.per_gpu["loss_backward"]
    # The plan's rows are the worst rank's, and its total the larger of the last backward and the reduce-scatter.
    worst = max((first, last), key=lambda r: r.per_gpu["total"])
    assert plan.per_gpu == worst.per_gpu and plan.pipeline["worst_rank"] == worst.rank
    p = first.per_gpu
    base = p["parameters"] + p["optimizer_state"] + p["model_buffers"] + p["all_gather_buffers"]
    base += p["deferred_gradients"]
    assert p["total"] == max(base + p["activations"], base + p["gradients"] + p["reduce_scatter_buffers"])


def test_gpipe_holds_every_micro_batch_and_interleaved_as_torch_counts() -> None:
    gpipe = plan_pp.rank_stages(small_request(pp_schedule="GPipe"))
    assert [r.in_flight for r in gpipe] == [4, 4]
    one = block_activation_bytes(SMALL, 1, 32, FP32)
    assert gpipe[0].activations["none"] == 4 * 2 * one
    # Interleaved, pp 2 x V 2 = 4 stages of 1 block, m 4: rounds 2, m_round 2; rank 0 warms up
    # min((V - 1) x 2 + 2 x (pp - 1), 8) = 4 forwards then holds one more: 5; rank 1: 2 + 1 = 3.
    interleaved = plan_pp.rank_stages(small_request(pp_schedule="Interleaved1F1B", pp_stages_per_rank=2))
    assert [r.stages for r in interleaved] == [(0, 2), (1, 3)]
    assert [r.in_flight for r in interleaved] == [5, 3]
    assert interleaved[0].activations["none"] == 5 * one
    plan = estimate(small_request(pp_schedule="Interleaved1F1B", pp_stages_per_rank=2))
    assert plan.pipeline["bubble_fraction"] == 1 / (2 * 4 + 1)  # (pp - 1) / (V x m + pp - 1)


def torch_interleaved_in_flight(pp: int, v: int, m: int, rank: int) -> int:
    """The most (stage, micro-batch) forwards without their backward in torch's own ScheduleInterleaved1F1B order."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    held = most = 0
    for action in schedule._calculate_single_rank_operations(rank):
        if action is None:
            continue
        held += 1 if action.computation_type == _ComputationType.FORWARD else -1
        most = max(most, held)
    return most


@PROPERTY
@given(pp=st.integers(2, 8), v=st.integers(2, 4), m=st.integers(1, 24), data=st.data())
def test_interleaved_in_flight_is_torchs(pp: int, v: int, m: int, data: st.DataObject) -> None:
    if m % max(1, m // pp):
        return  # torch refuses it (and so does plan)
    rank = data.draw(st.integers(0, pp - 1))
    assert plan_pp.in_flight("Interleaved1F1B", pp, rank, m, v) == torch_interleaved_in_flight(pp, v, m, rank)


def test_1f1b_warmup_is_torchs_rule() -> None:
    # Schedule1F1B._step_microbatches warms up min(n_microbatches, num_stages - stage_index) forwards, then runs
    # backward before each next forward (1B1F): that many are in flight at most.
    import inspect

    from torch.distributed.pipelining.schedules import Schedule1F1B

    source = inspect.getsource(Schedule1F1B._step_microbatches)
    assert "self._n_microbatches,\n            self._num_stages - self._stage.stage_index," in source
    assert [plan_pp.in_flight("1F1B", 4, s, 8, 1) for s in range(4)] == [4, 3, 2, 1]
    assert [plan_pp.in_flight("1F1B", 4, s, 2, 1) for s in range(4)] == [2, 2, 2, 1]


def test_torch_keeps_a_stage_gathered_and_its_gradients_unsharded_until_the_last_micro_batch() -> None:
    # plan_pp counts every block of a rank's stages gathered and their fp32 gradients unsharded for the whole step
    # because torch's pipeline stage turns FSDP's reshard and gradient sync off for each micro-batch's backward and
    # reduces once after the last: if torch changes this, so must plan.
    import inspect

    from torch.distributed.pipelining.stage import _PipelineStageBase

    backward = inspect.getsource(_PipelineStageBase.backward_maybe_with_nosync)
    fsdp = backward[backward.index("isinstance(self.submod, FSDPModule)") :]
    assert "set_reshard_after_backward(False)" in fsdp and "set_requires_gradient_sync(False)" in fsdp
    reduce = inspect.getsource(_PipelineStageBase.perform_reduce_grad)
    assert "set_reshard_after_backward(True)" in reduce and "set_requires_gradient_sync(True)" in reduce


@pytest.mark.parametrize("ac", AC_MODES)
def test_one_stage_holding_everything_is_the_plan_without_pp(ac: str) -> None:
    # stage_activation_bytes with 1 micro-batch in flight over every block, loss included = activation_bytes of the
    # whole logits (loss_chunks is 1 under PP), and the logits the schedule keeps as the last stage's output.
    request = small_request(pp=1, pp_schedule="1F1B", model=replace(SMALL, n_layers=5))
    got = plan_pp.stage_activation_bytes(request, FP32, ac, range(5), 1, True)
    assert got == activation_bytes(request.model, 1, 32, FP32, ac, loss_chunks=1) + FP32 * 32 * SMALL.vocab_size


def test_refusals_are_one_line_naming_the_fix(tmp_path: Path) -> None:
    cases = {
        ("--pp", "3"): "--pp 3 does not divide 8 GPUs; choose a divisor, e.g. --pp 2",
        ("--pp", "4", "--tp", "4"): "--pp 4 x --tp 4 does not divide 8 GPUs; choose degrees whose product divides it",
        ("--pp", "2", "--pp-schedule", "ZB"): "--pp-schedule ZB: choose one of 1F1B, GPipe, Interleaved1F1B, "
        "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
        ("--pp", "2", "--pp-schedule", "GPipe", "--pp-stages-per-rank", "2"): "--pp-schedule GPipe runs 1 stage per "
        "rank, got 2; give --pp-stages-per-rank 1, or --pp-schedule Interleaved1F1B",
        ("--pp", "2", "--pp-schedule", "Interleaved1F1B", "--pp-stages-per-rank", "1"): "--pp-schedule "
        "Interleaved1F1B needs 2 or more stages per rank, got 1; give --pp-stages-per-rank 2",
        ("--pp", "8", "--grad-accum-steps", "4"): "--pp-schedule 1F1B needs at least pp (8) micro-batches, got "
        "grad_accum_steps 4; give --grad-accum-steps 8 or more, or --pp-schedule GPipe",
        ("--pp", "4", "--pp-schedule", "Interleaved1F1B", "--grad-accum-steps", "9"): "--pp-schedule "
        "Interleaved1F1B needs grad_accum_steps (9) to be a multiple of its rounds (grad_accum_steps // pp = 2); "
        "give --grad-accum-steps 8 or a multiple of pp",
        ("--pp", "0"): "--pp must be at least 1, got 0; give --pp 1 or more",
        ("--pp", "2", "--cp", "2"): "--pp 2 with --cp 2 is not built; use --cp 1 or --pp 1",
        ("--pp", "2", "--cp-sweep"): "--cp-sweep: --pp 2 with cp > 1 is not built; use --pp 1 or drop --cp-sweep",
        ("--pp", "2", "--loss-chunks", "4"): "--loss-chunks 4 with --pp 2 is not built (the last pipeline stage "
        "computes the loss of the whole logits); use --loss-chunks 1 or --pp 1",
    }
    for args, message in cases.items():
        result = invoke("plan", "--size", "8b", *args)
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"fsdp2gen: error: {message}\n"), args
    result = invoke("plan", "--size", "debug", "--gpus", "8", "--pp", "8")
    assert result.stderr == "fsdp2gen: error: --pp 8 x 1 stages per rank = 8 stages for 4 blocks; each stage needs " \
        "a block, lower --pp or --pp-stages-per-rank\n"  # fmt: skip
    result = invoke("plan", "--size", "debug-moe", "--pp", "2")
    assert result.stderr == "fsdp2gen: error: --pp 2: the llama family's mixture-of-experts models are not built " \
        "for pp > 1; use --pp 1 (--ep splits the experts over GPUs)\n"  # fmt: skip
    config = tmp_path / "config.toml"
    config.write_text('[model]\nsize = "debug"\ntie_embeddings = true\n\n[parallel]\npp = 2\n')
    result = invoke("plan", "--config", str(config))
    assert (result.exit_code, result.stderr) == (2, "fsdp2gen: error: --pp 2: tied embeddings cannot span the first "
                                                 "and the last stage; set model.tie_embeddings = false or plan with "
                                                 "--pp 1\n")  # fmt: skip
    config.write_text('[model]\nsize = "debug"\n\n[parallel]\npp = 2\npp_layers = [3, 2]\n')
    result = invoke("plan", "--config", str(config))
    assert result.stderr == (
        "fsdp2gen: error: parallel.pp_layers [3, 2] must give 2 stages (pp x pp_stages_per_rank) 1 or more blocks "
        "each, 4 in all; fix it in the config, or [] for an even split\n"
    )


def test_the_allocator_rounds_the_last_stage_s_whole_logits() -> None:
    # --size's loss chunks (8 by default) do not apply under pp: a pp project computes the loss of the whole logits
    # (its config.py takes training.loss_chunks 1 only), the largest single request: 8192 tokens x 128256 x fp32.
    result = invoke("plan", "--size", "8b", "--gpus", "8", "--pp", "2")
    whole_logits = 8192 * 128256 * 4 / 2**30
    assert f"allocator fragmentation (largest request)         {whole_logits:.2f} GiB" in result.stdout, result.stdout
    assert "the last stage's loss of the whole logits (training.loss_chunks 1, the only value a pp project takes)" in (
        result.stdout
    )


def test_a_project_s_parallel_pp_keys_are_read_and_flags_override_them(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[model]\nsize = "debug"\n\n[training]\nseq_len = 64\nglobal_batch_size = 16\ngrad_accum_steps = 4\n\n'
        '[parallel]\npp = 2\npp_schedule = "GPipe"\npp_layers = [1, 3]\n'
    )
    plan = plan_json("--config", str(config), "--gpus", "4")
    setup, pipeline = plan["setup"], plan["pipeline"]
    # 4 GPUs: pp 2 x dp_shard 2; 16 samples over 2 data ranks x 4 micro-batches: micro-batches of 2.
    assert (setup["pp"], setup["pp_schedule"], setup["fsdp_ranks"], setup["micro_batch"]) == (2, "GPipe", 2, 2)
    assert [r["blocks"] for r in pipeline["ranks"]] == [[[0, 1]], [[1, 4]]]
    assert pipeline["micro_batches"] == 4 and pipeline["bubble_fraction"] == 1 / 5
    # A flag overrides the schedule; another pp drops the project's pp_layers (they are the project's stages).
    assert plan_json("--config", str(config), "--gpus", "4", "--pp-schedule", "1F1B")["pipeline"]["ranks"][0][
        "in_flight"] == 2  # fmt: skip
    four = plan_json("--config", str(config), "--gpus", "4", "--pp", "4")
    assert [r["blocks"] for r in four["pipeline"]["ranks"]] == [[[i, i + 1]] for i in range(4)]
    assert plan_json("--config", str(config), "--gpus", "4", "--pp", "1")["pipeline"] is None


def test_405b_on_64_nodes_with_tp_8_and_pp_8() -> None:
    args = ("--size", "405b", "--gpus", "8", "--nodes", "64", "--tp", "8", "--pp", "8", "--seq", "8192",
            "--activation-checkpointing", "full", "--grad-accum-steps", "16")  # fmt: skip
    plan = plan_json(*args)
    assert plan["setup"]["fsdp_ranks"] == 8 and plan["pipeline"]["bubble_fraction"] == 7 / 23
    # 126 blocks in 8 stages: 16 on the first six, 15 on the last two; the first stage (embedding, 8 micro-batches in
    # flight) is the worst.
    assert [b for r in plan["pipeline"]["ranks"] for b in r["blocks"]] == [
        [0, 16], [16, 32], [32, 48], [48, 64], [64, 80], [80, 96], [96, 111], [111, 126]]  # fmt: skip
    assert plan["pipeline"]["worst_rank"] == 0 and plan["fits"]
    text = invoke("plan", *args).stdout
    assert "bubble (pp - 1) / (m + pp - 1) = 30.4%" in text
    assert "the worst pipeline rank 0 (stage 0: blocks 0-15 + embedding; 8 micro-batch activations in flight)" in text


def test_a_pp_lever_is_offered_where_pp_lowers_the_total() -> None:
    # last_micro_batch: every GPU holds the whole model's fp32 gradients (its TP slice) through the accumulation; a
    # pipeline rank only its stage's.
    big = PlanRequest(model=SIZES["70b"], label="70b", gpus=8, nodes=2, seq_len=8192, micro_batch=1,
                      grad_accum_steps=8, grad_sync="last_micro_batch", ac="full")  # fmt: skip
    plan = estimate(big)
    pp_levers = [lever for lever in plan.levers if lever.option.startswith("--pp ")]
    assert len(pp_levers) == 1 and not plan.fits
    lever = pp_levers[0]
    pp = int(lever.option.split()[1])
    changed = estimate(replace(big, pp=pp), with_levers=False)
    assert lever.total_bytes == changed.per_gpu["total"] < plan.per_gpu["total"]


def expected_refusal(n_layers: int, pp: int, v: int, m: int, gpus: int, schedule: str) -> bool:
    """Whether plan must refuse the drawn pipeline (the rules written out again, independently of plan_pp)."""
    if pp == 1:
        return False
    multi = schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    rounds = schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
    return (
        gpus % pp != 0
        or (multi and v < 2)
        or (schedule in ("ZBVZeroBubble", "DualPipeV") and v != 2)
        or (not multi and v != 1)
        or n_layers < pp * v
        or (schedule == "1F1B" and m < pp)
        or (rounds and m % max(1, m // pp) != 0)
        or (schedule == "DualPipeV" and m < 2 * pp)
        or (schedule == "InterleavedZeroBubble" and m < pp)
    )


@PROPERTY
@given(
    n_layers=st.integers(1, 40),
    pp=st.integers(1, 16),
    v=st.integers(1, 4),
    m=st.integers(1, 40),
    gpus=st.integers(1, 64),
    schedule=st.sampled_from(plan_pp.PP_SCHEDULES),
)
def test_drawn_pipelines_are_planned_or_refused_in_one_line(
    n_layers: int, pp: int, v: int, m: int, gpus: int, schedule: str
) -> None:
    model = replace(SMALL, n_layers=n_layers)
    request = small_request(model=model, gpus=gpus, pp=pp, pp_stages_per_rank=v, grad_accum_steps=m,
                            pp_schedule=schedule)  # fmt: skip
    refused = expected_refusal(n_layers, pp, v, m, gpus, schedule)
    try:
        _check_request(request, None)
    except PlanError as error:
        message = str(error)
        assert refused and "\n" not in message and "; " in message, message
        return
    assert not refused
    plan = estimate(request)
    if pp == 1:
        assert plan.pipeline is None
        return
    ranks = plan.pipeline["ranks"]
    blocks = [b for r in ranks for b in r["blocks"]]
    # Every block on exactly one stage, each stage 1 or more blocks, sizes within 1 of each other.
    stage_blocks = sorted(blocks)
    assert [start for start, _ in stage_blocks] == [0] + [stop for _, stop in stage_blocks[:-1]]
    assert stage_blocks[-1][1] == n_layers and min(stop - start for start, stop in blocks) >= 1
    assert max(stop - start for start, stop in blocks) - min(stop - start for start, stop in blocks) <= 1
    assert plan.per_gpu["total"] == max(r["total_bytes"] for r in ranks)
    if schedule in ("1F1B", "GPipe", "Interleaved1F1B"):
        slots = m * (v if schedule == "Interleaved1F1B" else 1)
        assert plan.pipeline["bubble_fraction"] == (pp - 1) / (slots + pp - 1)
    held = [r["in_flight"] for r in ranks]
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # the V: every rank holds 2 stages' activations
        assert held == sorted(held) and 1 <= held[0] and held[-1] <= 2 * m + 1
    else:
        assert held == sorted(held, reverse=True) and 1 <= held[-1] and held[0] <= m * v
    if schedule == "1F1B":
        assert held == [min(m, pp - s) for s in range(pp)]


def torch_zero_bubble_table(schedule: str, pp: int, v: int, m: int) -> dict[int, list]:
    """torch's own compute actions of each rank for a zero-bubble schedule (its constructor's table, without stages)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, f"Schedule{schedule}")
    table = cls.__new__(cls)
    table.pp_group_size, table.n_local_stages, table._n_microbatches = pp, v, m
    table._num_stages = table.num_stages = pp * v
    table.number_of_rounds = max(1, m // pp)
    table.microbatches_per_round = m // table.number_of_rounds
    order = {rank: table._calculate_single_rank_operations(rank) for rank in range(pp)}
    if schedule == "InterleavedZeroBubble":
        table.pipeline_order = order
        order = table._add_bubbles_to_actions(pp * v)
    # DualPipeV runs a forward and a backward as one overlapped action: its parts, in order.
    return {rank: [sub for a in actions if a is not None for sub in (a.sub_actions or (a,))] for rank, actions in
            order.items()}  # fmt: skip


def run_in_unit_time(table: dict[int, list], n_stages: int) -> tuple[float, list[int]]:
    """Each rank runs its actions in order, a forward, an input gradient and a weight gradient one unit each (the
    zero-bubble papers' cost model; a full backward two), each waiting for the previous stage's forward or the next
    stage's input gradient of its micro-batch. The idle fraction, and the most activations each rank holds (a
    forward's until its weight gradient)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    cost = {C.FORWARD: 1, C.BACKWARD_INPUT: 1, C.BACKWARD_WEIGHT: 1, C.FULL_BACKWARD: 2}
    done: dict[tuple, int] = {}
    clock, position, held, most = ({rank: 0 for rank in table} for _ in range(4))
    while any(position[rank] < len(table[rank]) for rank in table):
        moved = False
        for rank, actions in table.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                kind, stage, micro = action.computation_type, action.stage_index, action.microbatch_index
                if kind == C.FORWARD:
                    needs = [("F", stage - 1, micro)] if stage > 0 else []
                elif kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
                    needs = [("B", stage + 1, micro)] if stage < n_stages - 1 else [("F", stage, micro)]
                else:
                    needs = [("B", stage, micro)]
                if not all(need in done for need in needs):
                    break
                clock[rank] = max([clock[rank]] + [done[need] for need in needs]) + cost[kind]
                if kind == C.FORWARD:
                    done[("F", stage, micro)], held[rank] = clock[rank], held[rank] + 1
                if kind in (C.BACKWARD_INPUT, C.FULL_BACKWARD):
                    done[("B", stage, micro)] = clock[rank]
                held[rank] -= kind in (C.BACKWARD_WEIGHT, C.FULL_BACKWARD)
                most[rank] = max(most[rank], held[rank])
                position[rank] += 1
                moved = True
        assert moved, "the table deadlocks"
    work = sum(cost[action.computation_type] for action in table[0])
    return 1 - work / max(clock.values()), [most[rank] for rank in table]


@PROPERTY
@given(
    schedule=st.sampled_from(["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]),
    pp=st.integers(2, 8),
    v=st.integers(2, 4),
    m=st.integers(1, 32),
)
def test_zero_bubble_in_flight_and_bubble_are_torchs(schedule: str, pp: int, v: int, m: int) -> None:
    # plan's closed forms against torch's own action tables run in unit time, for every setup plan accepts.
    v = 2 if schedule != "InterleavedZeroBubble" else v
    request = small_request(model=replace(SMALL, n_layers=pp * v), gpus=pp, pp=pp, pp_stages_per_rank=v,
                            grad_accum_steps=m, pp_schedule=schedule)  # fmt: skip
    if plan_pp.check_pipeline(request):
        return
    bubble, held = run_in_unit_time(torch_zero_bubble_table(schedule, pp, v, m), pp * v)
    assert [plan_pp.in_flight(schedule, pp, rank, m, v) for rank in range(pp)] == held
    assert plan_pp.bubble_fraction(pp, m, schedule, v) == pytest.approx(bubble, abs=1e-12)


def test_the_same_unit_time_run_gives_interleaved_1f1b_its_formula() -> None:
    # The simulation is not blind: torch's Interleaved1F1B table in it gives (pp - 1) / (V x m + pp - 1) and the
    # in-flight counts plan takes from torch's warm-up rule (a full backward holds its activations until it ends).
    table = {rank: [a for a in torch_interleaved_table(4, 2, 8, rank) if a is not None] for rank in range(4)}
    bubble, held = run_in_unit_time(table, 8)
    assert bubble == pytest.approx((4 - 1) / (2 * 8 + 4 - 1))
    assert held == [plan_pp.in_flight("Interleaved1F1B", 4, rank, 8, 2) for rank in range(4)]


def torch_interleaved_table(pp: int, v: int, m: int, rank: int) -> list:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    return schedule._calculate_single_rank_operations(rank)


def test_zero_bubble_plans_place_the_v_and_name_their_rules() -> None:
    # ZBV on 4 GPUs (pp 2, V 2): rank 0 holds stages 0 and 3 (embedding, output and loss), rank 1 stages 1 and 2.
    ranks = plan_pp.rank_stages(small_request(pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2))
    assert [r.stages for r in ranks] == [(0, 3), (1, 2)]
    assert ranks[0].first and ranks[0].per_gpu["loss_backward"] > 0 == ranks[1].per_gpu["loss_backward"]
    assert [r.in_flight for r in ranks] == [4, 4]  # min(2m, m + 1 + r, 2 pp)
    cases = {
        ("--pp-schedule", "ZBVZeroBubble", "--pp-stages-per-rank", "3"): "--pp-schedule ZBVZeroBubble places 2 "
        "stages per rank (a V), got 3; give --pp-stages-per-rank 2",
        ("--pp-schedule", "DualPipeV", "--grad-accum-steps", "3"): "--pp-schedule DualPipeV needs at least 2 x pp = 4 "
        "micro-batches (its stages), got 3; give --grad-accum-steps 4 or more",
        ("--pp-schedule", "InterleavedZeroBubble", "--grad-accum-steps", "1"): "--pp-schedule InterleavedZeroBubble "
        "is planned for at least pp (2) micro-batches, got 1; give --grad-accum-steps 2 or more",
    }
    for args, message in cases.items():
        result = invoke("plan", "--size", "8b", "--pp", "2", *args)
        assert (result.exit_code, result.stderr) == (2, f"fsdp2gen: error: {message}\n"), args
    text = invoke("plan", "--size", "8b", "--gpus", "8", "--pp", "4", "--pp-schedule", "DualPipeV").stdout
    assert "bubble (pp - 1) / (3 x V x m + pp - 1) = 5.9%" in text  # m = pp x V = 8: 3 / 51
