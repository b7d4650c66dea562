"""Meta-device initialisation is world-size invariant even when parameters are drawn in many row blocks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import torchrun
from tests.helpers.scripts import captured_in_this_process


@pytest.mark.parametrize("nproc", [1, 3])
def test_init_in_small_blocks_equals_eager_on_uneven_shards(
    projects: dict[str, Path], tmp_path: Path, nproc: int
) -> None:
    # A copy of the shared fp32 2-GPU project (conftest's projects), this test's to edit: no generation of its own.
    project = shutil.copytree(projects["fp32"], tmp_path / "run")
    sharded_init = project / "sharded_init.py"
    # 1000 values per block: every parameter spans several blocks, and 3 ranks split 130 rows unevenly.
    source = sharded_init.read_text()
    assert "INIT_BLOCK_ELEMENTS = 1 << 20\n" in source
    sharded_init.write_text(source.replace("INIT_BLOCK_ELEMENTS = 1 << 20\n", "INIT_BLOCK_ELEMENTS = 1000\n"))
    args = ["--job.device", "cpu", "--model.vocab_size", "130", "--model.dim", "64", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--model.ffn_dim", "172", "--model.n_layers", "2"]  # fmt: skip
    if nproc == 1:
        # One process, a group of one: `python tests/check_init.py`, run in this process (captured_in_this_process),
        # not a torchrun agent and a process that import torch again.
        code, stdout, stderr = captured_in_this_process(project, "tests/check_init.py", *args)
        assert code == 0, stderr[-3000:]
    else:
        stdout = torchrun(project, "tests/check_init.py", *args, nproc=nproc).stdout
    assert "rank 0: 21 tensors equal" in stdout and "MISMATCH" not in stdout
