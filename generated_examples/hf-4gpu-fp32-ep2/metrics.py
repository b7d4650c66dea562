"""What a run reports after each step: a row of metrics.jsonl, a progress line every job.log_every steps and a
validation line. Rank 0 writes everything."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from config import Config

# Dense fp32 peak FLOP/s (no TF32) of known GPUs, for the MFU estimate: the first name found in the device's
# name wins, so the PCIe and NVL boards (lower clocks and power) come before their SXM namesakes.
PEAK_FLOPS = {
    "H100 PCIe": 51e12, "H100 NVL": 60e12, "H200 NVL": 60e12, "H100": 67e12, "H200": 67e12, "A100": 19.5e12,
    "L40S": 91.6e12, "A10": 31.2e12, "V100": 15.7e12,
}  # fmt: skip


def peak_flops_per_device(device: torch.device) -> float | None:
    """The device's peak from PEAK_FLOPS, or None (CPU, unknown GPU): then no MFU is reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for model, flops in PEAK_FLOPS.items() if model in name), None)


def local_peak_mib(device: torch.device) -> float:
    """This rank's peak memory in MiB: a host-side counter, read without waiting for the device."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the peak resident memory of this process.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def local_reserved_mib(device: torch.device) -> float:
    """This rank's peak of the memory the CUDA caching allocator reserved, in MiB: what nvidia-smi shows and what an
    out-of-memory error counts (allocated memory plus the allocator's cached blocks). On CPU the resident peak."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return local_peak_mib(device)


def largest_over_ranks(peaks: list[float], device: torch.device) -> torch.Tensor:
    """The largest rank's value of each of `peaks` (the rank that runs out first), on the device: one all-reduce,
    a collective, so every rank calls it."""
    largest = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest


# Where a resumed run keeps the rows of the steps it repeats (set_aside_rows_after): never deleted.
SET_ASIDE = "metrics.rewound.jsonl"


def set_aside_rows_after(metrics_file: Path, step: int) -> None:
    """Before a run goes on from its checkpoint at `step` (0: from the start), move the rows of later steps, which
    an earlier launch wrote before it stopped (a crash after the checkpoint), from `metrics_file` to SET_ASIDE
    next to it: metrics.jsonl then holds one row per step, the run's own history, as the steps are repeated.
    Appended there first (a torn last row too), then metrics.jsonl replaced whole: a crash in between leaves a
    row in both files, never in neither."""
    try:
        lines = metrics_file.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return
    kept, aside = [], []
    for line in lines:
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            row_step = None  # the torn row of a write cut short
        (kept if isinstance(row_step, int) and row_step <= step else aside).append(line)
    if not aside:
        return
    with open(metrics_file.with_name(SET_ASIDE), "a") as side:
        side.writelines(line if line.endswith("\n") else line + "\n" for line in aside)
        side.flush()
        os.fsync(side.fileno())
    staging = metrics_file.with_name(metrics_file.name + ".tmp")
    staging.write_text("".join(kept))
    staging.replace(metrics_file)


class MetricsLog:
    """Rank 0's report of each step; the other ranks only take part in its all-reduce of the peak memory.

    A step's numbers stay on the device (train_step returns tensors): copying one to the host (.item()) would
    make the CPU wait until the GPU has run everything queued so far, a stall every step. They are copied, the
    pending steps' all at once, only on the steps that print or need them (FLUSH_ON); every step's row is then
    written, in order, as if each had been written at its own step.
    """

    def __init__(self, config: Config, output_dir: Path, run_id: str, device: torch.device, first_step: int) -> None:
        training = config.training
        self.config, self.run_id, self.world_size = config, run_id, dist.get_world_size()
        self.tokens_per_step = training.global_batch_size * training.seq_len
        # Model FLOPs utilisation: achieved training FLOP/s over the peak of all devices together.
        self.peak_flops = peak_flops_per_device(device)
        self.flops_per_token = config.model.flops_per_token(training.seq_len)
        self.first_step, self.started = first_step, time.perf_counter()
        self.device = device
        # Steps not yet copied to the host: (step, numbers, (peak allocated, peak reserved), validation loss).
        self.pending: list[tuple[int, dict, tuple[float, float], float | None]] = []
        self.device_wait = 0.0  # seconds the host waited for the device to finish the pending steps
        self.file = None
        if dist.get_rank() == 0:
            # Appended to: a resumed run goes on in the same file (its rows carry the run id), from its checkpoint.
            set_aside_rows_after(output_dir / "metrics.jsonl", first_step)
            self.file = open(output_dir / "metrics.jsonl", "a")

    def log(self, step: int, numbers: dict[str, float | torch.Tensor], validation: float | None) -> None:
        """Record `step`: train_step's numbers (loss, lr, grad_norm, ..., device tensors or floats) and
        step_time_s, this rank's peak memory and the validation loss when there is one. Every rank calls it."""
        peaks = (local_peak_mib(self.device), local_reserved_mib(self.device))
        self.pending.append((step, numbers, peaks, validation))
        training, job = self.config.training, self.config.job
        # Steps that print (progress, validation), the last one, and those that save a checkpoint: a resumed run
        # finds the rows of every step up to its checkpoint in metrics.jsonl. (A crash loses the rows after the
        # last of these, fewer than job.log_every: the resumed run writes them again anyway.)
        flush = step % job.log_every == 0 or step == training.steps or validation is not None
        if flush or step % self.config.checkpoint.interval == 0:
            self.flush()

    def wait_for_device(self) -> None:
        """Wait until the device has run the pending steps. The host queues a step's work and goes on, so a step's
        step_time_s is the host's time; the wait here is the rest of the pending steps' time, which flush() shares
        out among their rows. train() calls it before validation, which would otherwise absorb that wait."""
        if self.device.type == "cuda":
            started = time.perf_counter()
            torch.cuda.synchronize(self.device)
            self.device_wait += time.perf_counter() - started

    def flush(self) -> None:
        """Copy the pending steps' numbers to the host in one transfer (the only sync) and write their rows."""
        self.wait_for_device()
        rows, self.pending = self.pending, []
        waited, self.device_wait = self.device_wait, 0.0
        peaks = largest_over_ranks([peak for _, _, pair, _ in rows for peak in pair], self.device)
        if self.file is None:
            return
        tensors = [value for _, numbers, _, _ in rows for value in numbers.values() if isinstance(value, torch.Tensor)]
        # float64 holds each fp32 number exactly: the values are those .item() would have given, step by step.
        on_device = [peaks, *(value.detach().to(self.device, torch.float64).reshape(1) for value in tensors)]
        host = torch.cat(on_device).tolist()
        peak_values, values = host[: 2 * len(rows)], iter(host[2 * len(rows) :])
        allocated, reserved = peak_values[::2], peak_values[1::2]
        for (step, numbers, _, validation), peak, reserved_peak in zip(rows, allocated, reserved, strict=True):
            on_host = {name: next(values) if torch.is_tensor(number) else number for name, number in numbers.items()}
            on_host["step_time_s"] += waited / len(rows)  # each step's share of the device's backlog
            self.write(step, on_host, (peak, reserved_peak), validation)

    def write(self, step: int, numbers: dict[str, float], peaks: tuple[float, float], validation: float | None) -> None:
        """One row of metrics.jsonl for `step`: train_step's numbers and step_time_s, with the throughput, MFU and
        peak memory they imply (`peaks`: the largest rank's allocated and reserved), and the validation loss when
        there is one."""
        elapsed = numbers["step_time_s"]
        record = {
            "run_id": self.run_id,
            "step": step,
            **numbers,
            "tokens_per_s": self.tokens_per_step / elapsed,
            # What published figures quote: throughput per GPU (per rank on CPU).
            "tokens_per_s_per_gpu": self.tokens_per_step / elapsed / self.world_size,
            "mfu": self.flops_per_token * self.tokens_per_step / elapsed / (self.peak_flops * self.world_size)
            if self.peak_flops
            else None,
            "peak_mem_mib": peaks[0],
            "peak_reserved_mib": peaks[1],
        }
        if validation is not None:
            # Perplexity is exp(mean loss); capped so that a diverged run still writes valid JSON.
            record |= {"val_loss": validation, "val_perplexity": math.exp(min(validation, 80.0))}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.print_progress(step, record)

    def print_progress(self, step: int, record: dict) -> None:
        steps = self.config.training.steps
        if step % self.config.job.log_every == 0 or step == steps:
            # Time left at the average step time of this launch so far (the first steps include warm-up).
            per_step = (time.perf_counter() - self.started) / (step - self.first_step)
            remaining = timedelta(seconds=round(per_step * (steps - step)))
            print(
                f"step {step:>6}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} "
                f"| grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s "
                f"({record['tokens_per_s_per_gpu']:,.0f}/GPU) | peak {record['peak_mem_mib']:,.0f} MiB "
                # A mixture-of-experts model: the busiest expert's tokens over the mean (1.00 = even).
                + (f"| experts max/mean {record['moe_load_max_mean']:.2f} " if "moe_load_max_mean" in record else "")
                + f"| ETA {remaining}",
                flush=True,
            )
        if "val_loss" in record:
            print(
                f"step {step:>6}/{steps} | val loss {record['val_loss']:.4f} "
                f"| val perplexity {record['val_perplexity']:.2f}",
                flush=True,
            )

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
