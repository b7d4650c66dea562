"""Run under torchrun inside a generated `--qlora` project (PYTHONPATH = the project) by test_qlora.py, with the
training run's options (job.output_dir: a run with checkpoints).

Builds the model with train.py's build_model_meta, measuring this rank's resident memory around it (as the hf
projects' check_pretrained.py does: VmRSS before, VmHWM peak, and VmRSS after), then rank 0 writes $PROBE_OUT (JSON):
- per rank, whether each NF4 shard equals, bit for bit, the same rows of torchao's to_nf4 of the file's whole weight
  (4-bit values, block scales, scale factors, mean);
- the loss of the step after the newest checkpoint, train.py's train_step on the micro-batches train.py would use,
  and the same loss computed in one process: from_pretrained's model with the adapted weights replaced by their NF4
  quantization dequantized (nf4.dequantized) and peft adapters holding the checkpoint's values, fp32;
- whether every NF4 tensor is bit-identical after that step;
and saves the checkpoint's model output on a fixed input (before the step) to job.output_dir/model_output.pt.
"""

import copy
import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from checkpoint import Checkpointer, TrainState
from config import parse_args
from data import IGNORE, ShuffledEpochs, micro_batches
from layout import ParallelLayout
from model_args import ModelArgs
from nf4 import adapted_layers, dequantize_bases, is_nf4
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchao.quantization import to_nf4
from train import (
    build_model_meta,
    build_optimizer,
    checkpoint_load,
    close_process_group,
    init_distributed,
    open_datasets,
    train_step,
)
from transformers import AutoModelForCausalLM

PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def memory_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def measure_memory(config, folder: str) -> dict[str, float]:
    """Build the model of `folder` (QLoRA, pretrained) and measure how this rank's resident memory grew: at the peak
    of build_model_meta and once it returned, in MiB, next to the fp16 bytes of the rank's shards and the bytes of
    its NF4 shards."""
    config = copy.deepcopy(config)
    config.model = ModelArgs(path=folder, pretrained=True)
    # glibc keeps freed memory for reuse: trimmed before and after, resident memory is what the tensors hold.
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    gc.collect()
    trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = {field: memory_kib(field) for field in ("VmRSS", "RssAnon", "RssFile")}
    model = build_model_meta(config, mesh, device)
    memory = {"peak_mib": (memory_kib("VmHWM") - before["VmRSS"]) / 1024}
    memory["untrimmed_mib"] = (memory_kib("VmRSS") - before["VmRSS"]) / 1024
    trim(0)
    memory |= {field: (memory_kib(field) - kib) / 1024 for field, kib in before.items()}
    memory["fp16_share_mib"] = sum(p.to_local().numel() * 2 for p in model.parameters()) / 2**20
    memory["nf4_fp16_mib"] = sum(p.to_local().numel() * 2 for p in model.parameters() if is_nf4(p)) / 2**20
    memory["nf4_share_mib"] = sum(
        getattr(p.to_local(), part).numel() * getattr(p.to_local(), part).element_size()
        for p in model.parameters() if is_nf4(p) for part in PARTS[:3]
    ) / 2**20  # fmt: skip
    memory["dense_share_mib"] = sum(
        p.to_local().numel() * p.to_local().element_size() for p in model.parameters() if not is_nf4(p)
    ) / 2**20  # fmt: skip
    return memory


config = parse_args(sys.argv[1:])
device, mesh = init_distributed(config)
rank, world = dist.get_rank(), dist.get_world_size()
model = build_model_meta(config, mesh, device)
# A larger model (MEMORY_MODEL) measured after this one was built: the imports and caches are warm by then.
memory = measure_memory(config, os.environ["MEMORY_MODEL"]) if os.environ.get("MEMORY_MODEL") else {}

# The NF4 shards against torchao's quantization of the whole weights (the same rows).
pretrained = load_file(config.model.folder / "model.safetensors")
nf4_params = {name: param for name, param in model.named_parameters() if is_nf4(param)}
equal = []
for name, param in nf4_params.items():
    whole = to_nf4(pretrained[name.replace(".base_layer", "")].float())
    local = param.to_local()
    index = param.device_mesh.get_local_rank(0)
    same = [torch.equal(getattr(local, part), getattr(whole, part).chunk(world)[index]) for part in PARTS[:3]]
    same.append(torch.equal(local.scaler_mean, whole.scaler_mean))
    equal.append(all(same) and tuple(local.shape) == (whole.shape[0] // world, whole.shape[1]))

optimizer, scheduler = build_optimizer(model, config.training, device)
state = TrainState(model, optimizer, scheduler, config.training.global_batch_size, device, run_id="probe")
checkpointer = Checkpointer(Path(config.job.output_dir) / "checkpoints", config)
assert checkpoint_load(state, checkpointer) is not None
checkpointer.close()

# The checkpoint's model output on a fixed input, for the export test.
generator = torch.Generator().manual_seed(0)
tokens = torch.randint(config.model.vocab_size, (2, config.training.seq_len), generator=generator)
model.eval()
with torch.no_grad():
    logits = model(tokens).logits.float()
model.train()
adapters = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))

# The step after the checkpoint, as train.py runs it.
train_samples, _ = open_datasets(config)
samples = ShuffledEpochs(train_samples, config.training.seed)
layout = ParallelLayout.of(config.parallel, world)
training = config.training


def batches_of(data_rank: int) -> list:
    return micro_batches(samples, state.step, training.global_batch_size, training.grad_accum_steps, data_rank,
                         layout.data_ranks)  # fmt: skip


everyone = [batch for data_rank in range(layout.data_ranks) for batch in batches_of(data_rank)]
nf4_before = {name: [getattr(p.to_local(), part).clone() for part in PARTS] for name, p in nf4_params.items()}
step_loss = train_step(state, batches_of(layout.data_rank(rank)), config)["loss"].item()
unchanged = all(
    all(torch.equal(getattr(p.to_local(), part), old) for part, old in zip(PARTS, nf4_before[name], strict=True))
    for name, p in nf4_params.items()
)
reports = [None] * world
dist.all_gather_object(reports, {"memory": memory, "nf4_equal": equal, "nf4_unchanged": unchanged})

if rank == 0:
    # One process, fp32: the dequantized base with peft adapters holding the checkpoint's values.
    lora = config.lora
    reference = AutoModelForCausalLM.from_pretrained(config.model.folder, dtype=torch.float32)
    settings = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules)  # fmt: skip
    reference = get_peft_model(reference, settings)
    dequantize_bases(reference)
    missing = reference.load_state_dict({"base_model.model." + k: v for k, v in adapters.items()}, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    total, targets = 0.0, 0
    with torch.no_grad():
        for batch in everyone:
            # No cache: transformers then derives the packed documents from position_ids (as the project's model).
            output = reference(batch.inputs, position_ids=batch.positions, use_cache=False).logits.float()
            total += F.cross_entropy(output.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE,
                                     reduction="sum").item()  # fmt: skip
            targets += (batch.targets != IGNORE).sum().item()
        reference.eval()
        reference_logits = reference(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, Path(config.job.output_dir) / "model_output.pt")
    report = {
        "ranks": reports,
        "nf4_weights": len(nf4_params),
        "adapted_layers": len(adapted_layers(model)),
        "step_loss": step_loss,
        "reference_loss": total / targets,
        "documents_masked": any(batch.positions is not None for batch in everyone),
        "reference_logits_diff": (reference_logits - logits).abs().max().item(),
    }
    Path(os.environ["PROBE_OUT"]).write_text(json.dumps(report))
close_process_group()
