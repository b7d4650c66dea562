"""Build memory: peak RSS of each rank while the generated `build_model_meta` builds, shards and initialises.

    python benchmarks/build_memory.py [--worlds 1,2,4] [--tiny]

Generates projects (`fsdp2gen new --fp32`, and `--family hf --pretrained --fp32`) into a temporary folder and,
for two model sizes and each world size, runs this file again under `torchrun --nproc-per-node WORLD` (CPU,
gloo). Each rank measures how far its resident memory rises above its own baseline during `build_model_meta`
and prints it over its fair share, full model bytes / world.

- llama (meta build, fully_shard per block and root, to_empty, init_weights): target <= 1.2 on every rank,
  i.e. meta init never materialises the full model on any rank.
- hf --pretrained (meta build, fully_shard, to_empty, then rank 0 reads each safetensors file and broadcasts
  it, every rank keeping its shard): target <= 1.2 on every rank but 0. Rank 0 holds one weight file at a
  time, so its figure is also printed against the largest file: the "large" model is saved in 100 MB files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = 1.2
# name -> model overrides. Large enough that the fp32 parameters (128 MB, 350 MB) dwarf the allocator's noise;
# torch's own ~300 MB per process is in the baseline, which is subtracted.
SIZES = {
    "small": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1408, "vocab_size": 8192},
    "large": {"dim": 1024, "n_layers": 6, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 2816, "vocab_size": 8192},
}
# --tiny (tests/test_benchmarks.py): one model, whose hf files are in shards like "large"'s; the warm-up model's are
# one file like "small"'s, so that both ways of reading weight files still run.
TINY_SIZES = {"tiny": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 344, "vocab_size": 256}}
WARM_UP = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 172, "vocab_size": 128}
# The same shapes as Hugging Face Llama models (tied embeddings off), written by save_pretrained in fp32;
# name -> max_shard_size of its safetensors files (None: one file). Sharded files bound rank 0's extra memory.
HF_MAX_SHARD = {"small": None, "large": "100MB", "tiny": "200KB", "warm-up": None}


def hf_config(shape: dict[str, int]):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=shape["dim"], num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"], intermediate_size=shape["ffn_dim"], vocab_size=shape["vocab_size"],
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip


def save_hf_model(shape: dict[str, int], folder: Path, max_shard_size: str | None) -> int:
    """Save a random Llama of `shape` to `folder`; return the size of its largest weight file in bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.float32)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return max(file.stat().st_size for file in folder.glob("*.safetensors"))


def overrides(shape: dict[str, int]) -> list[str]:
    return [arg for key, value in shape.items() for arg in (f"--model.{key}", str(value))]


def status_kib(field: str) -> int:
    """A `VmRSS:  1234 kB` line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRSS:
    """The peak resident set size between start() and peak(), in bytes.

    ru_maxrss cannot be reset, and the ~300 MB that importing torch costs would hide a small build. Writing
    5 to /proc/self/clear_refs resets the kernel's high-water mark (VmHWM) to the current RSS, which catches
    every peak however short. Where the kernel does not support that (the mark stays above the current RSS
    after the write), a thread samples VmRSS every millisecond instead, which can miss a short peak.
    """

    def __init__(self) -> None:
        self.method = "VmHWM after writing 5 to /proc/self/clear_refs"
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Reset the mark; return the baseline RSS in bytes."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            reset = status_kib("VmHWM") <= status_kib("VmRSS") + 1024
        except OSError:
            reset = False
        baseline = status_kib("VmRSS") * 1024
        if not reset:
            self.method = "VmRSS sampled every 1 ms by a thread (VmHWM could not be reset here)"
            self._sampled = baseline
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return baseline

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._sampled = max(self._sampled, status_kib("VmRSS") * 1024)

    def peak(self) -> int:
        if self._thread is None:
            return status_kib("VmHWM") * 1024
        self._stop.set()
        self._thread.join()
        return max(self._sampled, status_kib("VmRSS") * 1024)


def worker(project: Path, model_overrides: list[str], warm_up_overrides: list[str], out: Path) -> None:
    """Runs on every rank under torchrun; rank 0 writes every rank's measurement to `out`."""
    import torch.distributed as dist

    sys.path.insert(0, str(project))
    from config import Config, parse_args
    from train import build_model_meta, init_distributed

    def config_for(model: list[str]) -> Config:
        return parse_args(["--config", str(project / "config.toml"), "--job.device", "cpu", *model])

    config = config_for(model_overrides)
    device, mesh = init_distributed(config)
    # A throw-away build of a tiny model first, so that the code pages and one-off allocations that any build
    # touches (kernels, DTensor dispatch caches, gloo buffers) are in the baseline, not charged to the model.
    build_model_meta(config_for(warm_up_overrides), mesh, device)
    gc.collect()
    dist.barrier()

    meter = PeakRSS()
    baseline = meter.start()
    model = build_model_meta(config, mesh, device)
    peak = meter.peak()

    params = list(model.parameters())
    measured = {
        "rank": dist.get_rank(),
        "baseline": baseline,
        "increase": peak - baseline,
        # A DTensor's numel() is the full (unsharded) tensor's.
        "full_bytes": sum(p.numel() * p.element_size() for p in params),
        "parameters": sum(p.numel() for p in params),
        "method": meter.method,
    }
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))


def measure(project: Path, model: list[str], warm_up: list[str], world: int, out: Path) -> list[dict]:
    """Every rank's measurement of one build, `world` ranks under torchrun."""
    # One thread per rank unless told otherwise: up to 4 ranks share the cores, and RSS does not depend on it.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    launch = [*torchrun, __file__, "--worker", str(project), json.dumps(model), json.dumps(warm_up), str(out)]
    result = subprocess.run(launch, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(model)} world {world} failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a quick check that the script runs")
    parser.add_argument("--worker", nargs=4, metavar=("PROJECT", "MODEL", "WARM_UP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        project, model, warm_up, out = args.worker
        import torch.distributed as dist

        worker(Path(project), json.loads(model), json.loads(warm_up), Path(out))
        # The worker's models are freed once it returns; collect them before tearing the group down, as the
        # generated train.py does (gloo now and then aborts at exit when tensors outlive their group).
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        return

    worlds = [int(w) for w in args.worlds.split(",")]
    sizes = TINY_SIZES if args.tiny else SIZES
    header = (
        f"{'model':<10} {'params':>8} {'full MB':>8} {'world':>5} {'rank':>4} {'increase MB':>11} "
        f"{'full/world MB':>13} {'ratio':>5}"
    )
    worst: dict[tuple[str, int], float] = {}
    hf_worst: dict[tuple[str, int], float] = {}
    rank0: list[str] = []
    method = ""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def generate(dest: Path, *options: str) -> None:
            command = [sys.executable, "-m", "fsdp2gen", "new", str(dest), "--yes", "--gpus", str(max(worlds))]
            subprocess.run([*command, "--fp32", *options], cwd=REPO, check=True, capture_output=True)

        def report(
            name: str, world: int, ranks: list[dict], into: dict[tuple[str, int], float], rank0_reads_files: bool
        ) -> None:
            nonlocal method
            for rank in ranks:
                share = rank["full_bytes"] / world
                ratio = rank["increase"] / share
                # The target is for the ranks that read no weight file.
                if not (rank0_reads_files and rank["rank"] == 0):
                    into[name, world] = max(into.get((name, world), 0.0), ratio)
                method = rank["method"]
                print(
                    f"{name:<10} {rank['parameters'] / 1e6:7.2f}M {rank['full_bytes'] / 1e6:8.1f} {world:>5} "
                    f"{rank['rank']:>4} {rank['increase'] / 1e6:11.1f} {share / 1e6:13.1f} {ratio:5.2f}"
                )

        project = root / "memory"
        generate(project)
        print("llama: peak RSS increase over each rank's pre-build baseline during build_model_meta (fp32, CPU, gloo)")
        print(header)
        for name, shape in sizes.items():
            for world in worlds:
                ranks = measure(project, overrides(shape), overrides(WARM_UP), world, root / f"{name}-{world}.json")
                report(name, world, ranks, worst, rank0_reads_files=False)

        # hf --pretrained: real safetensors folders of the same shapes, loaded by the generated load_pretrained.
        folders, largest_file = {}, {}
        for name, shape in {**sizes, "warm-up": WARM_UP}.items():
            folders[name] = root / f"hf-{name}"
            largest_file[name] = save_hf_model(shape, folders[name], HF_MAX_SHARD.get(name))
        hf_project = root / "memory-hf"
        generate(hf_project, "--family", "hf", "--hf-model", str(folders["warm-up"]), "--pretrained")
        print()
        print("hf --pretrained: the same, with rank 0 reading the safetensors files and broadcasting them")
        print(header)
        warm_up = ["--model.path", str(folders["warm-up"])]
        for name in sizes:
            for world in worlds:
                model = ["--model.path", str(folders[name])]
                ranks = measure(hf_project, model, warm_up, world, root / f"hf-{name}-{world}.json")
                report(f"hf-{name}", world, ranks, hf_worst, rank0_reads_files=True)
                first = ranks[0]
                over_share = first["increase"] - first["full_bytes"] / world
                largest = largest_file[name]
                rank0.append(
                    f"hf-{name} world {world}: rank 0 {first['increase'] / 1e6:.1f} MB = its share + "
                    f"{over_share / largest:.2f} x the largest weight file ({largest / 1e6:.1f} MB)"
                )
    print(f"peak measured as: {method}")
    for (name, world), ratio in worst.items():
        print(f"worst ratio {name} world {world} = {ratio:.2f}")
    overall = max(worst.values())
    print(f"worst ratio = {overall:.2f}: {'meets' if overall <= TARGET else 'MISSES'} the {TARGET} target")
    if hf_worst:
        hf_overall = max(hf_worst.values())
        print(
            f"hf --pretrained: worst ratio of the ranks that read no file = {hf_overall:.2f}: "
            f"{'meets' if hf_overall <= TARGET else 'MISSES'} the {TARGET} target"
        )
    else:
        print("hf --pretrained: world 1 only, where the one rank reads the files (see the rank 0 lines)")
    for line in rank0:
        print(line)
    if args.tiny:
        print("(a tiny model: a few hundred KB, within the allocator's noise; these ratios mean nothing)")


if __name__ == "__main__":
    main()
