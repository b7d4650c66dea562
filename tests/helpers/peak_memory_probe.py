"""Run under torchrun in a generated project: rank 1 allocates 200 MiB more than rank 0, then every rank asks
metrics.largest_over_ranks, which must report the largest rank's peak (rank 1's) on every rank."""

import resource

import numpy as np
import torch
import torch.distributed as dist
from metrics import largest_over_ranks, local_peak_mib

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    ballast = np.ones(200 * 2**20, dtype=np.uint8)  # touched, so resident
own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
reported = largest_over_ranks([local_peak_mib(torch.device("cpu"))], torch.device("cpu")).item()
readings = [None] * dist.get_world_size()
dist.all_gather_object(readings, (own, reported))
if dist.get_rank() == 0:
    # One process prints every rank's line: lines written by two processes at once can interleave.
    largest = max(own for own, _ in readings)
    for rank, (own, reported) in enumerate(readings):
        print(f"rank {rank}: own {own:.1f} reported {reported:.1f} largest {largest:.1f}", flush=True)
dist.barrier()
dist.destroy_process_group()
