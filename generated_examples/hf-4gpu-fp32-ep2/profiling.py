"""[profile]: a torch.profiler trace of chosen steps and, on CUDA, a snapshot of the allocations."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from config import ProfileConfig


class Profiler:
    """[profile]: a torch.profiler trace of steps start .. start + steps - 1 (one Chrome trace per rank in
    output_dir/profile/), and on CUDA a snapshot of the allocations up to memory_snapshot_step."""

    def __init__(self, profile: ProfileConfig, output_dir: Path, device: torch.device) -> None:
        self.profile, self.device, self.rank = profile, device, dist.get_rank()
        self.folder = output_dir / "profile"
        self.folder.mkdir(exist_ok=True)
        self.running: torch.profiler.profile | None = None
        self.last_step = profile.start + profile.steps - 1
        if profile.memory_snapshot_step and device.type == "cuda":
            # Records every allocation from here on, with its stack: the snapshot shows what held memory when.
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def step_starting(self, step: int) -> None:
        if step == self.profile.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.running = torch.profiler.profile(activities=activities, record_shapes=True)
            self.running.start()

    def step_done(self, step: int) -> None:
        if self.running is not None and step == self.last_step:
            self.close()
        if step == self.profile.memory_snapshot_step and self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-step-{step}-rank-{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def close(self) -> None:
        """Stop a running trace and write it (also when training ends before its last step)."""
        if self.running is None:
            return
        self.running.stop()
        first = self.profile.start
        self.running.export_chrome_trace(str(self.folder / f"steps-{first}-{self.last_step}-rank-{self.rank}.json"))
        self.running = None


class ProfileError(Exception):
    """[profile] asks for what this run cannot do: the message is one line that names why and the fix."""


def check_profile(profile: ProfileConfig, steps: int, device: str) -> None:
    """[profile] fits the run (`steps` long, on job.device `device`): found by preflight.py, before any rank starts."""
    if profile.memory_snapshot_step and (device == "cpu" or not torch.cuda.is_available()):
        raise ProfileError(
            "profile.memory_snapshot_step records CUDA allocations, but this run has no CUDA device; set "
            "--profile.memory_snapshot_step 0"
        )
    for key in ("start", "memory_snapshot_step"):
        if getattr(profile, key) > steps:
            raise ProfileError(
                f"profile.{key} {getattr(profile, key)} is after the last step (training.steps {steps}); choose a "
                "step of this run, or 0 for off"
            )
