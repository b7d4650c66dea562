"""Chunked loss: peak memory of a training step with a large vocabulary, training.loss_chunks N vs 1.

    python benchmarks/chunked_loss.py [--chunks 8] [--tiny]

Generates a llama project (`fsdp2gen new --fp32 --gpus 2`) in a temporary folder and runs this file again under
`torchrun --nproc-per-node 2` (CPU, gloo) once per chunk count (--tiny: once for both), on a vocabulary-heavy
model: vocabulary 128,256 (Llama 3's), dim 256, 2 layers, seq_len 2048, one sample per rank. Each rank builds the
sharded model, trains one step (the optimizer state and one-off allocations then exist), and measures how far its
resident memory rises above that baseline during a second step, the generated train_step (forward with the loss,
backward, clip, AdamW).

With loss_chunks 1 the step holds the whole logits of a rank's tokens in fp32 (1 x 2048 x 128,256 x 4 bytes =
1.05 GB) and their gradient; chunked, one chunk's. Printed: each run's peak (largest over the ranks), step time
and loss, and the ratios chunked / whole. Nothing is asserted (tests/test_benchmarks.py runs it tiny).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_memory import PeakRSS, overrides  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 688, "vocab_size": 128_256}
SEQ_LEN = 2048
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 172, "vocab_size": 4096}
TINY_SEQ_LEN = 64
WORLD = 2


def worker(project: Path, runs: list[list[str]], outs: list[Path]) -> None:
    """Runs on every rank under torchrun: each of `runs` (config overrides) in turn, with a model and optimizer of
    its own; rank 0 writes every rank's measurement of each to its `outs` file."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(project))
    from config import parse_args
    from data import MicroBatch
    from train import TrainState, build_model_meta, build_optimizer, init_distributed, train_step

    device, mesh = None, None
    for args, out in zip(runs, outs, strict=True):
        config = parse_args(["--config", str(project / "config.toml"), "--job.device", "cpu", *args])
        training = config.training
        if mesh is None:
            device, mesh = init_distributed(config)
        model = build_model_meta(config, mesh, device)
        optimizer, scheduler = build_optimizer(model, training, device)
        state = TrainState(model, optimizer, scheduler, training.global_batch_size, device, "benchmark")
        generator = torch.Generator().manual_seed(dist.get_rank())
        micro_batch = training.global_batch_size // dist.get_world_size()
        tokens = torch.randint(config.model.vocab_size, (micro_batch, training.seq_len + 1), generator=generator)
        batches = [MicroBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
        train_step(state, batches, config)  # AdamW's state, the kernels' and gloo's one-off buffers: the baseline
        gc.collect()
        dist.barrier()

        meter = PeakRSS()
        baseline = meter.start()
        started = time.perf_counter()
        numbers = train_step(state, batches, config)
        loss = float(numbers["loss"])
        seconds = time.perf_counter() - started
        peak = meter.peak()
        measured = {"increase": peak - baseline, "seconds": seconds, "loss": loss, "method": meter.method}
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, measured)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(gathered))
        del state, optimizer, scheduler, model
        gc.collect()
        dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8, help="training.loss_chunks to compare with 1 (%(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check that the script runs")
    parser.add_argument("--worker", nargs=3, metavar=("PROJECT", "RUNS", "OUTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        project, runs, outs = args.worker
        import torch.distributed as dist

        worker(Path(project), json.loads(runs), [Path(out) for out in json.loads(outs)])
        # Collect the model before tearing the group down, as the generated train.py does.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return

    shape, seq_len = (TINY, TINY_SEQ_LEN) if args.tiny else (SHAPE, SEQ_LEN)
    train_args = [*overrides(shape), "--model.max_seq_len", str(seq_len), "--training.seq_len", str(seq_len),
                  "--training.global_batch_size", str(WORLD)]  # fmt: skip
    logits_mb = seq_len * shape["vocab_size"] * 4 / 1e6
    with tempfile.TemporaryDirectory(prefix="chunked-loss-") as tmp:
        root = Path(tmp)
        project = root / "project"
        command = [sys.executable, "-m", "fsdp2gen", "new", str(project), "--yes", "--gpus", str(WORLD), "--fp32"]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        print(f"vocabulary {shape['vocab_size']:,}, dim {shape['dim']}, {shape['n_layers']} layers, seq_len {seq_len}, "
              f"1 sample per rank, fp32, {WORLD} gloo ranks (CPU, 1 thread each)")  # fmt: skip
        print(f"fp32 logits of a rank's tokens: {logits_mb:.1f} MB")
        print(f"{'loss_chunks':>11} {'peak MB':>8} {'step s':>7} {'loss':>9}")
        results: dict[int, dict] = {}
        method = ""
        # One launch per chunk count, so that neither step runs in a process the other has used (its allocator's
        # free memory). --tiny, whose figures mean nothing: both in one launch (each with a model of its own), a
        # torchrun launch less.
        every = (1, args.chunks)
        for group in [every] if args.tiny else [(chunks,) for chunks in every]:
            outs = [root / f"chunks-{chunks}.json" for chunks in group]
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
            runs = json.dumps([[*train_args, "--training.loss_chunks", str(chunks)] for chunks in group])
            launch = [*torchrun, __file__, "--worker", str(project), runs, json.dumps([str(out) for out in outs])]
            result = subprocess.run(launch, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"loss_chunks {', '.join(map(str, group))} failed:\n{result.stderr[-4000:]}")
            for chunks, out in zip(group, outs, strict=True):
                ranks = json.loads(out.read_text())
                method = ranks[0]["method"]
                results[chunks] = {
                    "peak": max(r["increase"] for r in ranks),
                    "seconds": max(r["seconds"] for r in ranks),
                    "loss": ranks[0]["loss"],
                }
                row = results[chunks]
                print(f"{chunks:>11} {row['peak'] / 1e6:8.1f} {row['seconds']:7.2f} {row['loss']:9.5f}")
    print(f"peak measured as: {method}, above the rank's RSS after a first step")
    whole, chunked = results[1], results[args.chunks]
    print(f"peak memory loss_chunks {args.chunks} / 1 = {chunked['peak'] / max(whole['peak'], 1):.2f}")
    print(f"step time loss_chunks {args.chunks} / 1 = {chunked['seconds'] / whole['seconds']:.2f}")
    print(f"loss difference = {abs(chunked['loss'] - whole['loss']):.1e}")
    if args.tiny:
        print("(a tiny model: within the allocator's noise; these ratios mean nothing)")


if __name__ == "__main__":
    main()
