"""What `new` and `update` print: the files written (or what a re-render did to each) and the commands to run next,
as text or as one JSON object."""

from __future__ import annotations

import collections
import json
import shlex
from pathlib import Path
from typing import Any

from fsdp2gen import __version__
from fsdp2gen.update import CONFLICT, UNCHANGED, Rerendered


def new_report(
    dest: Path, answers: dict[str, Any], written: list[str], changes: dict[str, str], *, defaults_used: list[str],
    dry_run: bool, as_json: bool,
) -> str:  # fmt: skip
    """What was written (per file, when --force re-rendered a project) and the commands to run next."""
    commands = next_commands(dest, answers)
    if as_json:
        report = {
            "dest": str(dest.absolute()),
            "dry_run": dry_run,
            "answers": answers,
            "defaults_used": defaults_used,
            "files": written,
            "changes": changes,
            "next": [{"command": command, "why": why} for command, why in commands],
        }
        return json.dumps(report, indent=2)
    summary = ", ".join(f"{name}={value if value != '' else repr('')}" for name, value in answers.items())
    if changes:
        verb = "Would update" if dry_run else "Updated"
        tally = collections.Counter(changes.values())
        counts = ", ".join(f"{tally[change]} {change}" for change in sorted(tally))
        lines = [f"{verb} {dest} ({summary}): {counts}:"]
        lines += [f"  {change}: {path}" for path, change in changes.items() if change != UNCHANGED]
        if CONFLICT in changes.values():
            lines.append("Resolve the conflicts (between <<<<<<< and >>>>>>> markers) in the files listed as conflict.")
    else:
        verb = "Would create" if dry_run else "Created"
        lines = [f"{verb} {dest} ({summary}) with {len(written)} files:", *(f"  {path}" for path in written)]
    if not dry_run:
        lines.append("\nNext:")
        lines += [f"  {command}" + (f"   # {why}" if why else "") for command, why in commands]
    return "\n".join(lines)


def update_report(project: Path, given: dict[str, Any], result: Rerendered, *, as_json: bool) -> str:
    """`update`'s versions, the files in conflict, and those no longer generated (removed, or kept as edited)."""
    if as_json:
        return json.dumps(
            {"project": str(project.absolute()), "from": f"v{result.version}", "to": f"v{__version__}",
             "answers": given, "changes": result.changes, "conflicts": result.conflicts, "removed": result.removed,
             "kept": result.kept},
            indent=2,
        )  # fmt: skip
    versions = f"from v{result.version} to v{__version__}" if result.version != __version__ else f"(v{__version__})"
    if result.conflicts:
        lines = [f"Updated {project} {versions} with conflicts to resolve in: {', '.join(result.conflicts)}"]
    else:
        lines = [f"Updated {project} {versions}; review with `git diff` and commit"]
    lines += [f"  removed (no longer generated, unedited): {path}" for path in result.removed]
    lines += [f"  kept, edited: {path} (no longer generated; delete it yourself if unneeded)" for path in result.kept]
    return "\n".join(lines)


CPU_RUN = "NPROC=2 DEVICE=cpu scripts/launch_local.sh --training.global_batch_size 8 --training.seq_len 128"
# A short warm-up for the short CPU run: config.toml's (100 steps) would keep the learning rate near 0 in 20 steps.
CPU_WARMUP = " --training.warmup_steps 2"
# config.toml's dp_replicate = nodes makes one replica per node (HSDP); on one machine that would leave each replica
# a fraction of its GPUs (on 2 CPU processes: 2 replicas of 1, nothing sharded). One machine shards over all its ranks.
ONE_MACHINE = " --parallel.dp_replicate 1"
# Context parallelism needs CUDA: a --cp project's CPU run trains without it.
CPU_NO_CP = " --parallel.cp 1"
CPU_PP = " --parallel.pp 2"  # the 2 CPU processes hold 2 pipeline stages


def next_commands(dest: Path, answers: dict[str, Any]) -> list[tuple[str, str]]:
    """(command, why) pairs to run after generation, in order."""
    nodes = answers["nodes"]
    one_machine = ONE_MACHINE if nodes > 1 else ""
    sharded = f"; --parallel.dp_replicate 1 shards over all of them (dp_replicate = {nodes}: one replica per node)"
    commands = [
        # Absolute: the README's main command has already cd'ed into a relative DEST when this is read.
        (f"cd {shlex.quote(str(dest.absolute()))}", ""),
        ("pip install -e '.[test]'", ""),
        # The sizes of the README's CPU run: this continues that run in outputs/ (or starts one), as a resume must
        # keep the batch size and the sequence length.
        (
            f"{CPU_RUN}{CPU_NO_CP if answers.get('cp', 1) > 1 else ''}{CPU_PP if answers.get('pp', 1) > 2 else ''}"
            f"{CPU_WARMUP}{one_machine} --training.steps 20",
            "2 CPU processes, gloo" + (sharded if one_machine else ""),
        ),
        # A folder of its own: outputs/ may hold the CPU run, whose sizes a default run does not share.
        (
            f"scripts/launch_local.sh --job.output_dir outputs-gpu{one_machine}",
            f"{answers['gpus']} GPU(s) with nccl" + (sharded if one_machine else ""),
        ),
    ]
    if answers["launcher"] == "slurm":
        commands.append(("sbatch scripts/slurm.sbatch", f"{answers['nodes']} node(s) on SLURM"))
    if answers["launcher"] == "ray":
        workers = answers["gpus"] * answers["nodes"]
        commands.append((f"python ray_train.py --workers {workers}", "on the Ray cluster in RAY_ADDRESS"))
    if nodes > 1:
        commands.append(
            ("MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=<i> scripts/launch_multinode.sh", "on each node")
        )
    commands.append(("pytest", "the project's own tests"))
    return commands
