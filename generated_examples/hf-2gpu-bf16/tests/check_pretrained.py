"""Run under torchrun by test_training.py: build_model_meta fills the sharded model exactly as transformers'
from_pretrained does, without any rank but 0 ever holding the whole model.

    torchrun ... tests/check_pretrained.py [MODEL_FOLDER ...] [--section.key VALUE ...]

For each model folder (default: model.path) every rank prints one line: the largest difference between its
logits and from_pretrained's, and how much its memory (GPU memory on CUDA, else resident memory) grew during
build_model_meta (the peak over the start) next to the size of the full model. Rank 0 also compares every
gathered weight with from_pretrained's, and every rank its buffers (non-persistent ones included), bit for
bit: "MISMATCH" lines. Then the model is built with model.pretrained = false, and its weights must have the
statistics of transformers' own initialisation, with different values in each rank's shard. Rank 0 saves
them, gathered, to job.output_dir/from_scratch.pt: they must be the same bit for bit on any number of ranks
(test_training.py).

    torchrun ... tests/check_pretrained.py [--section.key VALUE ...] from-scratch

checks (and saves) only the model built from scratch; then, in the same launch, on each other layout of these ranks
that FROM_SCRATCH_LAYOUTS (JSON: {NAME: [--parallel.key VALUE ...]}) names, saving to job.output_dir/NAME.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

from config import parse_args
from layout import ParallelLayout
from model import ModelArgs
from train import build_model_meta, run_on_every_rank


def memory_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process, in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_growth_mib(build, device: torch.device):
    """build() and how far the memory that holds the shards rose above its start meanwhile, in MiB: the GPU's
    on CUDA (where the shards live), else this process's resident memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = build()
        return result, (torch.cuda.max_memory_allocated(device) - before) / 2**20
    # Linux: writing 5 to clear_refs resets the peak (VmHWM) to the current resident memory.
    Path("/proc/self/clear_refs").write_text("5")
    before = memory_kib("VmRSS")
    result = build()
    return result, (memory_kib("VmHWM") - before) / 1024


def gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # A collective: rank 0 receives every full tensor (on CPU), the other ranks an empty dict.
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check_pretrained(config, mesh, device) -> list[str]:
    rank = dist.get_rank()
    model, growth_mib = peak_growth_mib(lambda: build_model_meta(config, mesh, device), device)
    # A DTensor's numel() is that of the whole tensor; tied weights count once.
    tensors = {id(t): t for t in model.state_dict().values()}.values()
    full_mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20

    reference = AutoModelForCausalLM.from_pretrained(config.model.folder, dtype=torch.float32).eval()
    tokens = torch.randint(config.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model(tokens.to(device)).logits.float().cpu()
        expected = reference(tokens).logits
    diff = (logits - expected).abs().max().item()
    # One write of one line: the ranks share stdout, and a single short write is not interleaved with theirs.
    sys.stdout.write(
        f"rank {rank}: {config.model.path}: logits max |diff| {diff:.3e}; "
        f"build_model_meta peak +{growth_mib:.1f} MiB, full model {full_mib:.1f} MiB\n"
    )
    sys.stdout.flush()
    mismatches = []
    for name, buffer in model.named_buffers():
        if not torch.equal(buffer.cpu(), reference.get_buffer(name)):
            mismatches.append(f"rank {rank}: buffer {name}")
    gathered = gathered_state(model)
    if rank == 0:
        for name, tensor in reference.state_dict().items():
            if name not in gathered or not torch.equal(gathered[name], tensor):
                mismatches.append(f"{name} differs from from_pretrained")
    return mismatches


def check_from_scratch(config, mesh, device) -> list[str]:
    """Each tensor's mean and std near those of transformers' init; each rank's shard drawn separately; saved."""
    config.model = ModelArgs(path=config.model.path, pretrained=False)
    model = build_model_meta(config, mesh, device)
    mismatches = []
    for name, param in model.named_parameters():
        # The first row of each shard (every rank has rows when their number divides evenly), within a group of
        # ranks holding different shards (the last mesh dimension; with HSDP, replicas hold the same shards).
        shards = param.device_mesh.size(param.device_mesh.ndim - 1)
        if shards > 1 and param.ndim == 2 and param.shape[0] % shards == 0:
            rows = [torch.empty_like(param.to_local()[0]) for _ in range(shards)]
            dist.all_gather(rows, param.to_local()[0].contiguous(), group=param.device_mesh.get_group(-1))
            if rows[0].std() > 0 and any(torch.equal(rows[0], row) for row in rows[1:]):
                mismatches.append(f"{name}: the same values in every rank's shard")
    gathered = gathered_state(model)
    if dist.get_rank() == 0:
        torch.save(gathered, Path(config.job.output_dir) / "from_scratch.pt")
        torch.manual_seed(config.training.seed)
        reference = AutoModelForCausalLM.from_config(config.model.hf_config, dtype=torch.float32).state_dict()
        for name, tensor in reference.items():
            got, std = gathered[name].float(), tensor.float().std().item() if tensor.numel() > 1 else 0.0
            if abs(got.mean().item() - tensor.float().mean().item()) > 0.2 * std + 1e-6 or (
                tensor.numel() > 1 and abs(got.std().item() - std) > 0.2 * std + 1e-6
            ):
                mismatches.append(f"{name}: from scratch mean/std {got.mean():.4f}/{got.std():.4f}, "
                                  f"transformers' init {tensor.mean():.4f}/{std:.4f}")  # fmt: skip
        print(f"from scratch: {len(reference)} tensors checked", flush=True)
    return mismatches


def main() -> None:
    # "from-scratch" may come anywhere among the overrides (runs.launch puts its own first).
    from_scratch_only = "from-scratch" in sys.argv[1:]
    args = [arg for arg in sys.argv[1:] if arg != "from-scratch"]
    folders = []
    while args and not args[0].startswith("--"):
        folders.append(args.pop(0))

    def check(config, device, mesh) -> int:
        Path(config.job.output_dir).mkdir(parents=True, exist_ok=True)
        mismatches = []
        for folder in [] if from_scratch_only else folders or [config.model.path]:
            config.model = ModelArgs(path=folder, pretrained=True)
            mismatches += check_pretrained(config, mesh, device)
        mismatches += check_from_scratch(config, mesh, device)
        for name, overrides in json.loads(os.environ.get("FROM_SCRATCH_LAYOUTS", "{}")).items():
            layout = parse_args([*args, *overrides, "--job.output_dir", str(Path(config.job.output_dir) / name)])
            Path(layout.job.output_dir).mkdir(parents=True, exist_ok=True)
            # Its own mesh, as init_distributed builds the launch's.
            layout_mesh = ParallelLayout.of(layout.parallel, dist.get_world_size()).build_mesh(device.type)
            mismatches += check_from_scratch(layout, layout_mesh, device)
        for line in mismatches:
            print("MISMATCH " + line, flush=True)
        return 1 if mismatches else 0

    run_on_every_rank(check, args)


if __name__ == "__main__":
    main()
