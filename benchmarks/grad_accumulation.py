"""Gradient accumulation: memory and step time of training.grad_sync's two modes, 2 ranks on CPU/gloo.

    python benchmarks/grad_accumulation.py [--steps 3] [--repeat 5] [--accum 4] [--tiny]

Generates a project (`fsdp2gen new --gpus 2 --fp32`) into a temporary folder and runs this file again under
`torchrun --nproc-per-node 2`. Each rank builds the project's model with its own `build_model_meta` and
`build_optimizer` and runs its `train_step` on the same global batches in three settings:

- `every_micro_batch` (the default, the reference): grad_accum_steps micro-batches, a reduce-scatter after each;
- `last_micro_batch`: the same micro-batches, gradients held unsharded until the last one;
- `no accumulation`: the same global batch in one micro-batch per rank (for scale: more activations).

Memory, per rank, as multiples of the rank's gradient shard (= its fp32 parameter shard), max over ranks:
- held: bytes of the tensors alive at the start of the last micro-batch (what earlier micro-batches left:
  the gradients), counted op by op (tests/helpers/plan_measure.py's LiveTensorBytes: CPU has no allocator statistics);
- peak: the peak of those tensors during forward and backward (before optimizer.step);
- rss: growth of the process's peak RSS (VmHWM, reset before the step) over its RSS before the step, with
  MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB so that freed tensors go back to the OS. RSS includes everything the
  process touches (gloo buffers, the allocator's slack): compare the modes with each other, not with the plan.
Step time: median over repetitions of the slowest rank's mean step, the settings interleaved; each ratio is
against every_micro_batch measured in the same run. Timed in a second torchrun launch without the mmap
threshold (a page fault per allocation would swamp the step time); --tiny times in the memory launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def flags(section: str, values: dict[str, int]) -> list[str]:
    """{"seq_len": 128} -> ["--training.seq_len", "128"]: the project's config overrides."""
    return [arg for key, value in values.items() for arg in (f"--{section}.{key}", str(value))]


# 31.6M parameters (126 MB fp32): the gradients are large next to the activations of a micro-batch.
FULL_MODEL = {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1376, "vocab_size": 8192}
FULL = flags("model", {**FULL_MODEL, "max_seq_len": 128}) + flags("training", {"global_batch_size": 8, "seq_len": 128})
TINY_MODEL = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 172, "vocab_size": 128}
TINY = flags("model", {**TINY_MODEL, "max_seq_len": 64}) + flags("training", {"global_batch_size": 8, "seq_len": 16})
SETTINGS = {"every_micro_batch": "every_micro_batch", "last_micro_batch": "last_micro_batch", "no accumulation": None}


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(
    project: Path, steps: int, repeat: int, accum: int, overrides: list[str], memory_file: Path, one_launch: bool
) -> None:
    """Runs on every rank under torchrun: measures memory into `memory_file` if it does not exist yet (first
    launch), else times the settings and prints the results (rank 0). `one_launch`: both, in this launch."""
    import json

    measuring = not memory_file.exists()  # decided once, before rank 0 writes it

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(project))
    sys.path.insert(0, str(REPO))
    from config import parse_args
    from data import ShuffledEpochs, SyntheticTokens, micro_batches
    from train import TrainState, build_model_meta, build_optimizer, init_distributed, train_step

    from tests.helpers.plan_measure import local_bytes, measure_train_step

    config = parse_args(["--config", str(project / "config.toml"), "--job.device", "cpu", *overrides])
    base = config.training
    device, mesh = init_distributed(config)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model_meta(config, mesh, device)
    optimizer, scheduler = build_optimizer(model, base, device)
    state = TrainState(model, optimizer, scheduler, base.global_batch_size, device, "benchmark")
    shard = sum(local_bytes(p) for p in model.parameters())  # fp32: the gradient shard has the same size

    samples = ShuffledEpochs(
        SyntheticTokens(config.model.vocab_size, base.seq_len, config.data.synthetic_samples, base.seed), base.seed
    )
    training = {
        name: dataclasses.replace(base, grad_accum_steps=accum if sync else 1, grad_sync=sync or "every_micro_batch")
        for name, sync in SETTINGS.items()
    }
    configs = {name: dataclasses.replace(config, training=t) for name, t in training.items()}
    batches = {
        name: [
            micro_batches(samples, step, base.global_batch_size, t.grad_accum_steps, rank, world_size)
            for step in range(steps)
        ]
        for name, t in training.items()
    }

    def run(name: str, step: int) -> None:
        train_step(state, batches[name][step], configs[name])

    memory: dict[str, dict[str, float]] = {}
    for name in SETTINGS if measuring else ():
        run(name, 0)  # warm-up: first-call allocations, AdamW state
        gc.collect()
        before = rss_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        run(name, 0)
        rss = rss_bytes("VmHWM") - before
        marks = measure_train_step(state, configs[name], batches[name][0])
        figures = torch.tensor(
            [marks.get("held_between_micro_batches", 0), marks["peak_forward_backward"], rss], dtype=torch.float64
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the worst rank
        memory[name] = dict(zip(("held", "peak", "rss"), (figures / shard).tolist(), strict=True))
    if measuring and not one_launch:
        if rank == 0:
            memory_file.write_text(json.dumps(memory))
        return
    if not measuring:
        memory = json.loads(memory_file.read_text())  # (every rank measured the same: all_reduce MAX)

    def seconds_per_step(name: str) -> float:
        dist.barrier()
        started = time.perf_counter()
        for step in range(steps):
            run(name, step)
        elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        return elapsed.item() / steps

    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for index in range(repeat):
        # Rotate the order, so that no setting always runs right after another.
        for name in names[index % len(names) :] + names[: index % len(names)]:
            times[name].append(seconds_per_step(name))

    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())  # a DTensor's numel() is the full tensor's
        print(
            f"world size {world_size} (gloo, CPU, {torch.get_num_threads()} thread(s) per rank), "
            f"{parameters / 1e6:.2f}M parameters ({4 * parameters / 1e6:.1f} MB fp32, shard {shard / 1e6:.1f} MB), "
            f"global batch {base.global_batch_size} x {base.seq_len} tokens, grad_accum_steps {accum}, "
            f"{steps} steps x {repeat} repetitions"
        )
        columns = ("held/shard", "peak/shard", "rss/shard", "ms/step", "time ratio")
        print(f"{'setting':<18} " + " ".join(f"{column:>10}" for column in columns))
        reference = statistics.median(times["every_micro_batch"])
        for name in SETTINGS:
            median = statistics.median(times[name])
            held = f"{memory[name]['held']:.2f}" if SETTINGS[name] else "-"
            print(
                f"{name:<18} {held:>10} {memory[name]['peak']:>10.2f} {memory[name]['rss']:>10.2f} "
                f"{median * 1e3:>10.1f} {median / reference:>10.3f}"
            )
        extra = memory["last_micro_batch"]["held"] - memory["every_micro_batch"]["held"]
        print(f"last_micro_batch holds {extra:.2f} x the shard more between micro-batches (expected {world_size - 1})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per repetition and setting")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each setting, interleaved")
    parser.add_argument("--accum", type=int, default=4, help="grad_accum_steps of the accumulating settings")
    parser.add_argument("--tiny", action="store_true", help="tiny model, for a quick check that the script runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set when started by torchrun
    parser.add_argument("--memory-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = TINY if args.tiny else FULL
    if args.worker:
        import torch.distributed as dist

        worker(args.worker, args.steps, args.repeat, args.accum, overrides, args.memory_file, args.one_launch)
        # Collect the models before tearing the group down, as the generated train.py does.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return
    # One thread per rank unless told otherwise: two ranks share two cores.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp) / "accumulation"
        subprocess.run(
            [sys.executable, "-m", "fsdp2gen", "new", str(project), "--yes", "--gpus", "2", "--fp32"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        worker_args = ["--worker", str(project), "--steps", str(args.steps), "--repeat", str(args.repeat)]
        worker_args += ["--accum", str(args.accum), "--memory-file", str(Path(tmp) / "memory.json")]
        command = [*torchrun, __file__, *worker_args, *(["--tiny"] if args.tiny else [])]
        # Memory first, with freed tensors going back to the OS at once (RSS then follows the live tensors).
        memory_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
        if args.tiny:
            # Its figures mean nothing: the times too are taken in the memory launch (a torchrun launch less).
            sys.exit(subprocess.run([*command, "--one-launch"], env=memory_env).returncode)
        memory = subprocess.run(command, env=memory_env)
        if memory.returncode:
            sys.exit(memory.returncode)
        sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
