"""Device-to-host syncs per training step of a generated project, on steps that report and steps that do not.

    python benchmarks/syncs_per_step.py [--precision fp32] [--steps 8] [--device cpu] [--tiny]

Generates a project (`fsdp2gen new --gpus 2 --precision P`) into a temporary folder and runs its train.py under
`torchrun --nproc-per-node 2` through tests/helpers/sync_probe.py, the probe of test_no_host_sync_in_step.py: it
counts, per step and rank, every call that copies a tensor's value to the host (Tensor.item/tolist/cpu/... and,
on a GPU, whatever CUDA's sync debug mode reports). A progress line every 4 steps, validation every 6 steps, and
the checkpoint of the last step make the reporting steps. Per step, the worst rank's count of:

- syncs: the project's own calls that wait for a GPU's queue (tests/helpers/sync_sites.py leaves out AdamW's
  step counters and GradScaler's found-inf flag, which torch keeps on the host for the non-fused CPU optimizer);
- in torch: those made inside torch (DCP copying each shard to the host to save the checkpoint);
- all host reads: every call the probe saw, those left out included.

Target: 0 syncs on every step that does not report (counts, not timings: the same on any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.helpers.sync_sites import NO_GPU_SYNC, where  # noqa: E402

PROBE = REPO / "tests" / "helpers" / "sync_probe.py"
LOG_EVERY, EVAL_EVERY = 4, 6
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.vocab_size", "128", "--model.ffn_dim", "172", "--model.max_seq_len", "64",
        "--training.seq_len", "32", "--training.global_batch_size", "8"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--steps", type=int, default=8, help="training steps (the last one saves a checkpoint)")
    parser.add_argument("--device", default="cpu", help="job.device of the run (cuda: CUDA's sync count as well)")
    parser.add_argument("--tiny", action="store_true", help="tiny model, for a quick check that the script runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project, out = Path(tmp) / "syncs", Path(tmp) / "probe"
        out.mkdir()
        command = [sys.executable, "-m", "fsdp2gen", "new", str(project), "--yes", "--gpus", "2",
                   "--precision", args.precision]  # fmt: skip
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        run = [*(TINY if args.tiny else []), "--job.log_every", str(LOG_EVERY), "--training.steps", str(args.steps),
               "--eval.every", str(EVAL_EVERY), "--eval.batches", "1", "--checkpoint.interval", str(args.steps + 1),
               "--job.device", args.device, "--job.output_dir", str(Path(tmp) / "run")]  # fmt: skip
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        # One thread per rank: two ranks share the cores. PYTHONPATH: the probe imports the project's modules.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(project),
               "PROBE_OUT": str(out)}  # fmt: skip
        result = subprocess.run([*torchrun, str(PROBE), *run], cwd=project, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(result.stdout[-3000:] + result.stderr[-3000:])
        reports = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]

    def count(step: int, kind: str) -> int:
        """The worst rank's count on `step` of the project's own syncs ("own"), of those inside torch ("torch":
        e.g. DCP copying the shards to the host to save them) or of every host read ("all")."""

        def counted(call: str) -> bool:
            inside_torch = where(call).startswith("torch/")
            return kind == "all" or (where(call) not in NO_GPU_SYNC and inside_torch == (kind == "torch"))

        return max(sum(map(counted, report["sites"].get(str(step), []))) for report in reports)

    reporting = {step for step in range(1, args.steps + 1) if step % LOG_EVERY == 0 or step % EVAL_EVERY == 0}
    reporting.add(args.steps)
    print(f"world size 2 (gloo, {args.device}), {args.precision}, {args.steps} steps: a progress line every "
          f"{LOG_EVERY}, validation every {EVAL_EVERY}, a checkpoint on the last")  # fmt: skip
    print("step  reports  syncs  in torch  all host reads")
    for step in range(1, args.steps + 1):
        counts = (count(step, "own"), count(step, "torch"), count(step, "all"))
        print(f"{step:4d}  {'yes' if step in reporting else 'no':>7}  {counts[0]:5d}  {counts[1]:8d}  {counts[2]:14d}")
    quiet = [step for step in range(1, args.steps + 1) if step not in reporting]
    quiet_syncs = max((count(step, "own") + count(step, "torch") for step in quiet), default=0)
    print(f"syncs per non-reporting step (worst) = {quiet_syncs}")
    loud = sorted(reporting)
    print(f"syncs per reporting step (worst, the project's own) = {max(count(step, 'own') for step in loud)} "
          f"(steps {', '.join(map(str, loud))})")  # fmt: skip
    print("meets the 0 target" if quiet_syncs == 0 else "MISSES the 0 target")


if __name__ == "__main__":
    main()
