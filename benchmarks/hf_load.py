"""hf --pretrained loading: rank 0's peak RSS and the load time, DCP's Hugging Face reader vs rank-0 broadcast.

    python benchmarks/hf_load.py [--worlds 2,4] [--tiny]

Saves a random Llama (hidden 1024, 8 layers, vocab 8192: 111M parameters, 445 MB of fp32 safetensors in one
file, as save_pretrained writes a model under 5 GB) in a temporary folder, generates a project for it
(`fsdp2gen new --family hf --pretrained --fp32`) and runs this file again under `torchrun` (CPU, gloo) once
per path and world size (--tiny: once per world size, for both paths). Each rank builds the sharded model with
random weights, then times the generated model.py filling it from the files:

- dcp: `load_pretrained`, every rank reading the slices of its own shards (HuggingFaceStorageReader);
- broadcast: `load_from_rank0` + `finish_pretrained`, rank 0 reading each file whole and broadcasting every
  tensor (the path load_pretrained keeps for ranks that do not see rank 0's folder).

Reported: rank 0's peak RSS increase over its baseline during the load, and the load time (slowest rank), with
the ratios dcp / broadcast. Figures vary with the machine and the page cache: nothing is asserted.
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
from build_memory import PeakRSS, hf_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHAPE = {"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 2816, "vocab_size": 8192}
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 172, "vocab_size": 128}
PATHS = ("dcp", "broadcast")


def worker(project: Path, folder: Path, paths: list[str], outs: list[Path]) -> None:
    """Runs on every rank under torchrun: each of `paths` in turn, on a model of its own; rank 0 writes each
    measurement to its `outs` file."""
    import torch.distributed as dist

    sys.path.insert(0, str(project))
    import model as model_module
    from config import parse_args
    from model_args import ModelArgs
    from train import build_model_meta, init_distributed

    config = parse_args(["--config", str(project / "config.toml"), "--job.device", "cpu", "--model.path", str(folder)])
    device, mesh = init_distributed(config)
    config.model = ModelArgs(path=str(folder), pretrained=False)  # random weights: the load is measured alone
    for path, out in zip(paths, outs, strict=True):
        model = build_model_meta(config, mesh, device)
        gc.collect()
        dist.barrier()
        meter = PeakRSS()
        baseline = meter.start()
        start = time.perf_counter()
        if path == "dcp":
            model_module.load_pretrained(model, folder)
        else:
            model_module.load_from_rank0(model, folder)
            model_module.finish_pretrained(model)
        dist.barrier()
        seconds = time.perf_counter() - start
        measured = {"increase": meter.peak() - baseline, "seconds": seconds, "method": meter.method}
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, measured)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(gathered))
        del model
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check that the script runs")
    parser.add_argument("--worker", nargs=4, metavar=("PROJECT", "FOLDER", "PATHS", "OUTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        project, folder, paths, outs = args.worker
        worker(Path(project), Path(folder), paths.split(","), [Path(out) for out in outs.split(",")])
        return

    import torch
    from transformers import AutoModelForCausalLM

    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = root / "llama"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_config(TINY if args.tiny else SHAPE), dtype=torch.float32).save_pretrained(
            folder
        )
        file_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
        project = root / "project"
        command = [sys.executable, "-m", "fsdp2gen", "new", str(project), "--yes", "--gpus", str(max(worlds)),
                   "--fp32", "--family", "hf", "--hf-model", str(folder), "--pretrained"]  # fmt: skip
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        print(f"weights: {file_mb:.1f} MB of fp32 safetensors (1 file); CPU, gloo, 1 thread per rank")
        print(f"{'path':<10} {'world':>5} {'rank 0 peak MB':>14} {'load s':>7}")
        results: dict[tuple[str, int], dict] = {}
        method = ""
        # One launch per path and world size, so that neither path's load runs in a process the other has used
        # (its allocator's free memory, its page-cache mappings). --tiny, whose figures mean nothing: one launch
        # per world size, both paths in it (each on a model of its own), a torchrun launch less.
        groups = [PATHS] if args.tiny else [(path,) for path in PATHS]
        for world in worlds:
            for group in groups:
                outs = [root / f"{path}-{world}.json" for path in group]
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
                launch = [*torchrun, __file__, "--worker", str(project), str(folder), ",".join(group),
                          ",".join(map(str, outs))]  # fmt: skip
                result = subprocess.run(launch, env=env, capture_output=True, text=True)
                if result.returncode != 0:
                    sys.exit(f"{', '.join(group)} world {world} failed:\n{result.stderr[-4000:]}")
                for path, out in zip(group, outs, strict=True):
                    ranks = json.loads(out.read_text())
                    method = ranks[0]["method"]
                    results[path, world] = {"rss": ranks[0]["increase"], "seconds": max(r["seconds"] for r in ranks)}
                    row = results[path, world]
                    print(f"{path:<10} {world:>5} {row['rss'] / 1e6:14.1f} {row['seconds']:7.2f}")
        print(f"peak measured as: {method}")
        for world in worlds:
            dcp, broadcast = results["dcp", world], results["broadcast", world]
            print(f"world {world}: rank 0 peak RSS dcp / broadcast = {dcp['rss'] / max(broadcast['rss'], 1):.2f}")
            print(f"world {world}: load time dcp / broadcast = {dcp['seconds'] / broadcast['seconds']:.2f}")
    if args.tiny:
        print("(a tiny model: within the allocator's noise; these ratios mean nothing)")


if __name__ == "__main__":
    main()
