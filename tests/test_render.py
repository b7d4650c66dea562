"""What the template renders: the six blocks, only the code the answers need, lint-clean Python."""

from __future__ import annotations

import ast
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import generate, tree

BLOCKS = ["init_distributed", "build_model_meta", "build_optimizer", "train_step", "checkpoint_save", "checkpoint_load"]


def test_train_py_has_the_six_marked_blocks_in_order(projects: dict[str, Path]) -> None:
    for project in projects.values():
        source = (project / "train.py").read_text()
        markers = re.findall(r"^# fsdp2gen: block (\w+)\ndef (\w+)\(", source, flags=re.M)
        assert markers == [(name, name) for name in BLOCKS]
        assert source.count("# fsdp2gen: block") == 6
        # main() runs train() through run_on_every_rank, which calls init_distributed first; train() calls the
        # other blocks in this order.
        functions = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
        called = [
            n.func.id
            for name in ("run_on_every_rank", "train")
            for n in ast.walk(functions[name])
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        ]
        order = [name for name in called if name in BLOCKS]
        assert order == ["init_distributed", "build_model_meta", "build_optimizer", "checkpoint_load", "train_step",
                         "checkpoint_save"]  # fmt: skip


def test_generated_python_passes_ruff_and_compiles(projects: dict[str, Path]) -> None:
    for project in projects.values():
        for path in project.rglob("*.py"):
            py_compile.compile(str(path), doraise=True)
        lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=project,
                              capture_output=True, text=True)  # fmt: skip
        assert lint.returncode == 0, lint.stdout
        fmt = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=project,
                             capture_output=True, text=True)  # fmt: skip
        assert fmt.returncode == 0, fmt.stdout


def test_seed_rules_hold_in_train_py(projects: dict[str, Path]) -> None:
    for project in projects.values():
        source = (project / "train.py").read_text()
        calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)}
        assert not any(call.endswith((".forward", "no_sync", "torch.save", ".state_dict")) for call in calls - {
            "self.scheduler.state_dict", "self.scaler.state_dict"}), calls  # fmt: skip
        assert "model.set_requires_gradient_sync" in calls
        assert re.search(r"dist\.barrier\(\)\n    dist\.destroy_process_group\(\)", source)
        # meta build -> shard -> materialize in build_model_meta; blocks -> root in shard_model; to_empty -> fill
        # in materialize (model.py's initialize: init_weights for llama), in that order.
        steps = [r'torch\.device\("meta"\)', r"shard_model\(model", r"materialize\(model", r"fully_shard\(block",
                 r"fully_shard\(model", r"model\.to_empty\(", r"initialize\(model"]  # fmt: skip
        positions = [re.search(step, source).start() for step in steps]
        assert positions == sorted(positions)
        model = (project / "model.py").read_text()
        assert "model.init_weights(seed=config.training.seed, buffer_device=device)" in model
        # set_device comes before init_process_group.
        assert source.index("torch.cuda.set_device") < source.index("dist.init_process_group")


def test_precision_renders_only_its_own_code(projects: dict[str, Path]) -> None:
    fp32, bf16, fp16 = (projects[p].joinpath("train.py").read_text() for p in ("fp32", "bf16", "fp16"))
    assert "MixedPrecisionPolicy" not in fp32 and "GradScaler" not in fp32
    reduce = "reduce_dtype=getattr(torch, parallel.reduce_dtype)"
    assert f"MixedPrecisionPolicy(param_dtype=torch.bfloat16, {reduce})" in bf16
    assert "GradScaler" not in bf16
    assert f"MixedPrecisionPolicy(param_dtype=torch.float16, {reduce})" in fp16
    assert "scaler.scale(loss).backward()" in fp16 and '"loss_scale"' in fp16
    for source in (fp32, bf16, fp16):
        assert "{%" not in source and "{{" not in source


def test_nodes_and_gpus_shape_the_launchers(tmp_path: Path) -> None:
    one = generate(tmp_path / "one", "--gpus", "4", "--nodes", "1")
    two = generate(tmp_path / "two", "--gpus", "8", "--nodes", "2")
    assert not (one / "scripts" / "launch_multinode.sh").exists()
    assert 'NPROC="${NPROC:-4}"' in (one / "scripts" / "launch_local.sh").read_text()
    multinode = (two / "scripts" / "launch_multinode.sh").read_text()
    assert 'NNODES="${NNODES:-2}"' in multinode and 'NPROC="${NPROC:-8}"' in multinode
    assert "--rdzv-backend c10d" in multinode
    for script in (one / "scripts" / "launch_local.sh", two / "scripts" / "launch_multinode.sh"):
        assert os.access(script, os.X_OK)
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_multinode_script_names_missing_variables(tmp_path: Path) -> None:
    project = generate(tmp_path / "two", "--nodes", "2")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    result = subprocess.run(["scripts/launch_multinode.sh"], cwd=project, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "set MASTER_ADDR to the hostname or IP of node 0" in result.stderr


def test_project_name_comes_from_the_folder(tmp_path: Path) -> None:
    project = generate(tmp_path / "My_Run")
    assert 'name = "my-run"' in (project / "pyproject.toml").read_text()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_answers_file_records_every_answer(projects: dict[str, Path], precision: str) -> None:
    files = tree(projects[precision])
    answers = files[".copier-answers.yml"].decode()
    assert f"precision: {precision}\n" in answers and "gpus: 2\n" in answers


# One option at a time over the defaults (--gpus 2, bf16): each renders its own imports and code, so each alone
# must leave a lint-clean project (e.g. --compile alone once left an unused `import pytest` in the tests).
SINGLE_OPTIONS = [
    ["--compile"], ["--float8"], ["--cpu-offload"], ["--prefetch"], ["--tensorboard"],
    ["--activation-checkpointing", "full"], ["--reshard-after-forward", "false"], ["--reshard-after-forward", "2"],
    ["--tp", "2"], ["--checkpoint", "dcp-async"], ["--checkpoint", "full"], ["--launcher", "slurm"],
    ["--launcher", "ray"], ["--nodes", "2"], ["--family", "custom"], ["--fp16"], ["--fp32"],
    ["--moe", "--ep", "2"],
]  # fmt: skip


@pytest.mark.parametrize("options", SINGLE_OPTIONS, ids=" ".join)
def test_each_option_alone_renders_a_lint_clean_project(tmp_path: Path, options: list[str]) -> None:
    project = generate(tmp_path / "run", "--gpus", "2", *options)
    for args in (["check"], ["format", "--check"]):
        lint = subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=project,
                              capture_output=True, text=True)  # fmt: skip
        assert lint.returncode == 0, lint.stdout


def test_cpu_offload_on_gpus_reduces_cpu_tensors_over_gloo(tmp_path: Path) -> None:
    # Offloaded gradients are CPU tensors, and clipping (and the fp16 scaler) all-reduce them: on CUDA the
    # process group needs a CPU backend beside NCCL. No GPU here, so read the CUDA branch of init_distributed.
    def cuda_backend(project: Path) -> str:
        tree = ast.parse((project / "train.py").read_text())
        init = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "init_distributed")
        branches = [node for node in ast.walk(init) if isinstance(node, ast.If) and "cuda" in ast.unparse(node.test)]
        assigned = [node.value.value for branch in branches for node in branch.body
                    if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "backend"]  # fmt: skip
        assert len(assigned) == 1, assigned
        return assigned[0]

    offload = generate(tmp_path / "offload", "--gpus", "2", "--fp16", "--cpu-offload")
    plain = generate(tmp_path / "plain", "--gpus", "2", "--fp16")
    assert cuda_backend(offload) == "cuda:nccl,cpu:gloo"
    assert cuda_backend(plain) == "nccl"
