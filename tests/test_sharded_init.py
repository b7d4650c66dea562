"""Meta-device initialisation is world-size invariant even when parameters are drawn in many row blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import generate, torchrun


@pytest.mark.parametrize("nproc", [1, 3])
def test_init_in_small_blocks_equals_eager_on_uneven_shards(tmp_path: Path, nproc: int) -> None:
    project = generate(tmp_path / "run", "--gpus", "2", "--fp32")
    sharded_init = project / "sharded_init.py"
    # 1000 values per block: every parameter spans several blocks, and 3 ranks split 130 rows unevenly.
    source = sharded_init.read_text()
    assert "INIT_BLOCK_ELEMENTS = 1 << 20\n" in source
    sharded_init.write_text(source.replace("INIT_BLOCK_ELEMENTS = 1 << 20\n", "INIT_BLOCK_ELEMENTS = 1000\n"))
    result = torchrun(
        project, "tests/check_init.py", "--job.device", "cpu", "--model.vocab_size", "130", "--model.dim", "64",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "172", "--model.n_layers", "2",
        nproc=nproc,
    )  # fmt: skip
    assert "rank 0: 21 tensors equal" in result.stdout and "MISMATCH" not in result.stdout
