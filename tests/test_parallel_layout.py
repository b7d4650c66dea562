"""The generated project's layout.py (ParallelLayout) is the one place that lays the ranks out on the mesh: its
arithmetic holds for any world size and dimensions (hypothesis), its messages are one line naming only the
dimensions a project has, it imports no torch, and neither the rendered projects nor fsdp2gen compute the mesh
anywhere else."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2gen.plan_layout import EVERY_DIMENSION, layout_module, render_layout
from tests.conftest import REPO, generate

ParallelLayout = layout_module().ParallelLayout
LayoutError = layout_module().LayoutError


def parallel(**sizes: int) -> SimpleNamespace:
    """A config.parallel: dp_replicate and dp_shard always, the other dimensions only when given."""
    return SimpleNamespace(**{"dp_replicate": 1, "dp_shard": -1, "reshard_after_forward": True, **sizes})


def training(global_batch_size: int = 64, grad_accum_steps: int = 1, seq_len: int = 32) -> SimpleNamespace:
    return SimpleNamespace(global_batch_size=global_batch_size, grad_accum_steps=grad_accum_steps, seq_len=seq_len)


MODEL = SimpleNamespace(n_heads=8, n_kv_heads=4, ffn_dim=64)


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(1, 256),
    dp_replicate=st.integers(1, 16),
    dp_shard=st.one_of(st.just(-1), st.integers(1, 64)),
    tp=st.one_of(st.none(), st.integers(1, 8)),
)
def test_the_layout_covers_the_ranks_or_says_why_in_one_line(
    world_size: int, dp_replicate: int, dp_shard: int, tp: int | None
) -> None:
    config = parallel(dp_replicate=dp_replicate, dp_shard=dp_shard, **({} if tp is None else {"tp": tp}))
    layout = ParallelLayout.of(config, world_size)
    try:
        layout.check_product()
    except LayoutError as error:
        message = str(error)
        assert "\n" not in message and error.problem == "ranks"
        assert message.startswith("parallel.dp_replicate x dp_shard") and "(dp_shard = -1 takes the rest)" in message
        # A project without tp is not told about it (no "x 1" for a dimension it does not have).
        assert ("tp" in message) == (tp is not None)
        assert world_size > 1
        return
    sizes = [layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp]
    assert math.prod(sizes) == world_size
    assert layout.data_ranks * layout.tp == world_size
    if world_size == 1:
        assert sizes == [1] * 5 and layout.mesh_sizes == {"dp_shard": 1}
    # tp groups are consecutive ranks reading the same samples; each data rank is read by exactly one tp group.
    readers = [layout.data_rank(rank) for rank in range(world_size)]
    assert all(readers[rank] == readers[rank - rank % layout.tp] for rank in range(world_size))
    assert sorted(readers) == sorted(list(range(layout.data_ranks)) * layout.tp)
    assert all(layout.holds_loss(rank) for rank in range(world_size))  # no pipeline stages yet
    # The mesh: the same names and order as before (dp_replicate, dp_shard, tp), size-1 dims left out but dp_shard.
    assert list(layout.mesh_sizes) == [
        name for name in ("dp_replicate", "dp_shard", "tp") if getattr(layout, name) > 1 or name == "dp_shard"
    ]
    assert math.prod(layout.mesh_sizes.values()) == world_size
    assert layout.ep == 1 and "ep" not in layout.mesh_sizes


@settings(max_examples=200, deadline=None)
@given(
    world_size=st.integers(2, 64),
    tp=st.integers(1, 4),
    batch=st.integers(1, 512),
    accumulate=st.integers(1, 8),
    reshard=st.one_of(st.booleans(), st.integers(1, 64)),
)
def test_each_check_is_one_line_and_refuses_only_what_cannot_split(
    world_size: int, tp: int, batch: int, accumulate: int, reshard: bool | int
) -> None:
    config = parallel(tp=tp, reshard_after_forward=reshard)
    layout = ParallelLayout.of(config, world_size)
    try:
        layout.check(training(batch, accumulate), MODEL)
    except LayoutError as error:
        assert "\n" not in str(error) and "; " in str(error)  # the problem; the fix
        if error.problem == "batch":
            assert batch % (layout.data_ranks * accumulate)
        elif error.problem == "reshard":
            assert not isinstance(reshard, bool) and layout.dp_shard % reshard and reshard < layout.dp_shard
        else:
            assert error.problem in ("ranks", "tp_shape")
        return
    assert world_size % tp == 0 and batch % (world_size // tp * accumulate) == 0


def test_messages_are_todays_for_projects_with_tp_and_name_no_missing_dimension() -> None:
    with pytest.raises(LayoutError) as error:
        ParallelLayout.of(parallel(dp_replicate=3, tp=2), 4).check_product()
    assert str(error.value) == (
        "parallel.dp_replicate x dp_shard x tp = 3 x -1 x 2 does not match the 4 ranks; choose dp_replicate (and tp) "
        "whose product divides 4 (dp_shard = -1 takes the rest)"
    )
    with pytest.raises(LayoutError) as error:
        ParallelLayout.of(parallel(dp_replicate=3), 2).check_product()
    assert str(error.value) == (
        "parallel.dp_replicate x dp_shard = 3 x -1 does not match the 2 ranks; choose dp_replicate that divides 2 "
        "(dp_shard = -1 takes the rest)"
    )


def test_one_process_has_every_dimension_1() -> None:
    # `python train.py` of a tp project: no mesh to split, the batch still split by grad_accum_steps.
    layout = ParallelLayout.of(parallel(dp_replicate=2, tp=4), 1)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp, layout.data_ranks, layout.data_rank(0)) == (1, 1, 1, 1, 0)
    layout.check(training(8, 2, seq_len=31), MODEL)  # tp 1: the sequence need not split
    with pytest.raises(LayoutError, match=r"\(1 x 3\)"):
        layout.check(training(8, 3), MODEL)


def test_layout_imports_no_torch(tmp_path: Path) -> None:
    # fsdp2gen plan loads it, and the generator never imports torch: neither a dense project's nor the planner's.
    for name, answers in (("dense", {"pp": 1, "tp": 1, "cp": 1, "moe": False}), ("every", EVERY_DIMENSION)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "layout.py").write_text(render_layout(**answers))
        probe = (
            f"import sys; sys.path.insert(0, {str(tmp_path / name)!r}); import layout; print('torch' in sys.modules)"
        )
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert result.stdout.strip() == "False"


def rendered_layout(pp: int, tp: int, cp: int, moe: bool) -> Any:
    module = ModuleType(f"layout_{pp}_{tp}_{cp}_{moe}")
    sys.modules[module.__name__] = module  # dataclasses look the module up
    exec(compile(render_layout(pp=pp, tp=tp, cp=cp, moe=moe), module.__name__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize(("pp", "tp", "cp", "moe"), [(1, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False),
                                                     (2, 1, 1, False), (1, 1, 1, True), (2, 2, 2, False)])  # fmt: skip
def test_a_project_s_layout_with_only_its_dimensions_lays_out_as_the_planner_s(
    pp: int, tp: int, cp: int, moe: bool
) -> None:
    # The planner reasons with every dimension rendered; a project holds only its own: the same mesh, the same
    # samples per rank, the same refusals, for every layout the project's config can hold.
    mine = rendered_layout(pp, tp, cp, moe)
    assert set(mine.MESH_DIMS) == {"dp_replicate", "dp_shard"} | {
        d for d, n in (("pp", pp), ("tp", tp), ("cp", cp)) if n > 1
    }
    model = SimpleNamespace(**vars(MODEL), n_experts=4 if moe else 0, tie_embeddings=False, n_layers=4)
    batches = (
        SimpleNamespace(**vars(training(8, 1)), loss_chunks=4),
        SimpleNamespace(**vars(training(6, 2, 24)), loss_chunks=8),
    )
    for world in (1, 2, 4, 8):
        for sizes in ({}, {"dp_replicate": 2}, {"tp": tp}, {"cp": cp}, {"pp": pp}, {"ep": 2}, {"tp": tp, "cp": cp}):
            # config.parallel as the project's config holds it: only its own dimensions (ep with --moe).
            config = parallel(**{name: size for name, size in sizes.items() if size > 1 and name != "ep"})
            if moe:
                config.ep = sizes.get("ep", 1)
            ours, planners = mine.ParallelLayout.of(config, world), ParallelLayout.of(config, world)
            assert ours.mesh_sizes == planners.mesh_sizes and ours.shard_ranks == planners.shard_ranks
            if ours.data_ranks:  # 0: more ranks configured than there are (check() refuses it)
                assert [ours.data_rank(r) for r in range(world)] == [planners.data_rank(r) for r in range(world)]
            for batch in batches:
                outcomes = []
                for layout, error in ((ours, mine.LayoutError), (planners, LayoutError)):
                    try:
                        layout.check(batch, model, 4)
                        outcomes.append(None)
                    except error as refusal:
                        outcomes.append(str(refusal))
                assert outcomes[0] == outcomes[1], (world, sizes)


# How the mesh used to be computed outside layout.py: the dp_shard = -1 rule, and the ranks divided by tp.
MESH_ARITHMETIC = re.compile(r"dp_shard\W{0,3}\s*==\s*-1|//\s*\(?\s*(?:self\.|parallel\.)?(?:tp|dp_replicate)\b")


def mesh_arithmetic(files: list[Path]) -> dict[str, list[str]]:
    found = {}
    for path in files:
        lines = [line.strip() for line in path.read_text().splitlines() if MESH_ARITHMETIC.search(line)]
        if lines:
            found[path.name] = lines
    return found


def test_the_mesh_arithmetic_lives_in_layout_py_only(tmp_path: Path) -> None:
    default = generate(tmp_path / "default", "--gpus", "2", "--nodes", "2")
    with_tp = generate(tmp_path / "with-tp", "--gpus", "4", "--tp", "2")
    for project in (default, with_tp):
        found = mesh_arithmetic(sorted(project.rglob("*.py")))
        assert list(found) == ["layout.py"], found
        assert "tp = 1" not in (project / "preflight.py").read_text()
    assert mesh_arithmetic(sorted((REPO / "fsdp2gen").glob("*.py"))) == {}
