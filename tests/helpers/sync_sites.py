"""Which of the calls that sync_probe.py counts are device-to-host syncs on a GPU (test_no_host_sync_in_step.py and
benchmarks/syncs_per_step.py read its reports with these)."""

# Host reads that are no GPU sync: AdamW's step counters, which torch keeps on the CPU unless its fused or capturable
# kernels keep them on the GPU (then nothing is read), and, in fp16, GradScaler's found-inf flag, which torch reads
# on the host for a non-fused optimizer (on CPU ranks here; on a GPU the fused AdamW takes the flag on the device).
# (The functions of torch that read them, by file; GradScaler.get_scale, a real sync, stays counted.)
NO_GPU_SYNC = {
    "torch/optim/optimizer.py _get_value",
    "torch/amp/grad_scaler.py <genexpr>",  # _maybe_opt_step's sum over found_inf_per_device
    "torch/distributed/fsdp/sharded_grad_scaler.py _amp_update_scale_cpu_",
}


def where(call: str) -> str:
    """From "item torch/optim/optimizer.py:95 _get_value" to "torch/optim/optimizer.py _get_value"."""
    _, site, function = call.split()
    return f"{site.rsplit(':', 1)[0]} {function}"
