"""Evaluate a trained model with lm-eval (EleutherAI's lm-evaluation-harness), its own model class and scoring.

    python scripts/evaluate.py --tasks arc_easy,hellaswag               # the newest checkpoint in outputs/checkpoints
    python scripts/evaluate.py outputs/checkpoints/step-1000 --tasks arc_easy --limit 100
    python scripts/evaluate.py exported --tasks my_task --include-path tasks/   # a Hugging Face folder, a local task
    python scripts/evaluate.py --tasks tasks/my_task.yaml                       # a task's YAML file, by path

Needs `pip install -e '.[eval]'`. MODEL is a checkpoint (a step-N folder: it is exported first with
`scripts/export.py --format hf`, as transformers' LlamaForCausalLM, into a temporary folder, removed afterwards;
lm-eval needs a tokenizer: the run's data.tokenizer, else --tokenizer), a Hugging Face model folder
(`scripts/export.py --format hf`'s --output, or any save_pretrained folder) or a hub id. The model is lm-eval's
own `HFLM` (transformers' AutoModelForCausalLM) and the scores are lm-eval's: nothing here computes a
log-likelihood.

--tasks: any lm-eval task or group by name (`lm-eval ls tasks` lists them; their datasets download once into the
Hugging Face cache), or a task's YAML file. A local task needs no network: a YAML such as

    task: my_task
    dataset_path: json
    dataset_kwargs: {data_files: {test: /data/my_task.jsonl}}
    test_split: test
    output_type: multiple_choice
    doc_to_text: "{{question}}"
    doc_to_choice: "{{choices}}"
    doc_to_target: "{{answer}}"
    metric_list: [{metric: acc}]

next to a JSONL file of {"question": ..., "choices": [...], "answer": index} lines.

Results go into the run folder (--output-dir, default: the checkpoint's run, else outputs), never over earlier
ones: each evaluation creates a new folder evaluations/<UTC time>-<model>/ holding results.json (lm-eval's results:
each task's metrics and their standard errors, the configuration of each task, versions) and samples_<task>.jsonl
(each item: its requests, the model's per-choice log-likelihoods, the metrics), and appends one line per task to
evaluations.jsonl (run id, step, model, task, metrics).

On GPUs the evaluation uses all visible GPUs (--nproc, default: their number): this script starts torchrun with
one process per GPU, each holding the whole model and scoring its share of each task's items (lm-eval's
data-parallel path through accelerate); rank 0 gathers every rank's items and writes and logs the results, once.
Without a GPU (or with --device cpu) it runs in this one process, or with --nproc N in N CPU processes (gloo): the
same path, the same scores. --nproc may not exceed the visible GPUs (on GPUs) nor any task's items (a process
without items has nothing to score).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))  # the project's modules, from any current folder
from checkpoint_files import newest_checkpoint  # noqa: E402


class EvaluateError(Exception):
    """A mistake in the arguments or inputs; the message names it and the fix."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint or a Hugging Face folder with lm-eval.")
    parser.add_argument("model", nargs="?", help="a step-N checkpoint, a Hugging Face folder or hub id "
                        "(default: the newest checkpoint)")  # fmt: skip
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names or task YAML files")
    parser.add_argument("--include-path", type=Path, help="a folder of task YAML files to add to lm-eval's tasks")
    parser.add_argument("--checkpoints", type=Path, default=Path("outputs/checkpoints"),
                        help="where to look for the newest checkpoint (default: %(default)s)")  # fmt: skip
    parser.add_argument("--output-dir", type=Path,
                        help="the run folder of the results (default: the checkpoint's, else outputs)")  # fmt: skip
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per item (default: each task's own)")
    parser.add_argument("--limit", type=float, help="the first N items of each task (or a fraction, below 1)")
    parser.add_argument("--batch-size", default="8", help="items per forward pass, or auto (default: %(default)s)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, ...; auto: config.json's dtype (default: %(default)s)")  # fmt: skip
    parser.add_argument("--tokenizer", help="a folder or hub id (default: the model's own)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="(default: cuda when a GPU is visible)")
    parser.add_argument("--nproc", type=int, help="processes, one per GPU (default: every visible GPU, or 1)")
    parser.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (default: %(default)s)")
    return parser.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["--_rank"]:  # a torchrun rank started by run(): its arguments, model and folders
        rank = json.loads(sys.argv[2])
        evaluate(argparse.Namespace(**rank["args"]), rank["model"], Path(rank["evaluation"]), rank["source"])
        return
    args = parse_args()
    try:
        run(args)
    except EvaluateError as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    """Check the arguments, export a checkpoint, create the evaluation's folder, evaluate (here or under torchrun)."""
    import torch

    check_arguments(args)
    source = model_source(args)
    if source["step"] is not None and not source["config"]["data"]["tokenizer"] and not args.tokenizer:
        raise EvaluateError(
            f"{source['model']} was trained without a tokenizer (data.tokenizer is empty: token ids), and lm-eval "
            "scores text; give the tokenizer its token ids come from with --tokenizer (a folder or hub id)"
        )
    output_dir = args.output_dir or Path(source["run_dir"] or "outputs")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    nproc = args.nproc or max(gpus, 1)
    if device == "cuda" and nproc > gpus:
        raise EvaluateError(
            f"--nproc {nproc}: {gpus} GPU{'s are' if gpus > 1 else ' is'} visible (one process per GPU); use --nproc "
            f"{gpus} or fewer, or --device cpu for CPU processes"
        )
    if nproc > 1:
        check_items(args, nproc)
    evaluation = new_evaluation_folder(output_dir, source["name"])
    model = source["model"]
    try:
        if source["step"] is not None:
            model = str(evaluation / "model")
            export(Path(source["model"]), Path(model))
        if nproc == 1:
            evaluate(args, model, evaluation, source)
        else:
            # One process per GPU (or CPU process); each rank evaluates its share of every task's items (accelerate
            # reads torchrun's environment), and rank 0 writes the results. The ranks get the parsed arguments, not
            # the command line: torchrun would take --nproc for its own.
            rank = {"args": vars(args), "model": model, "evaluation": str(evaluation), "source": source}
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       __file__, "--_rank", json.dumps(rank, default=str)]  # fmt: skip
            # accelerate's own switch to CPU processes (`accelerate launch --cpu` sets it): without it accelerate
            # takes each CPU rank for a process of its own, not one of a gloo group.
            cpu = {"ACCELERATE_USE_CPU": "true"} if device == "cpu" else {}
            ranks = subprocess.run(command, env={**os.environ, **cpu})
            if ranks.returncode != 0:
                sys.exit(f"evaluate.py: the {nproc} evaluation processes failed (exit {ranks.returncode}); see above")
    finally:
        if model != source["model"]:
            shutil.rmtree(model, ignore_errors=True)  # the temporary export; the results stay


def check_arguments(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise EvaluateError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    if args.nproc is not None and args.nproc < 1:
        raise EvaluateError(f"--nproc must be at least 1, got {args.nproc}")
    if args.limit is not None and args.limit <= 0:
        raise EvaluateError(f"--limit must be above 0, got {args.limit}")
    if args.include_path is not None and not args.include_path.is_dir():
        raise EvaluateError(f"--include-path {args.include_path} is not a folder; give the folder of your task YAMLs")
    for task in args.tasks.split(","):
        if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
            raise EvaluateError(f"--tasks {task}: no such file; give a task's YAML file or an lm-eval task name")
        if task.endswith((".yaml", ".yml")) and task_name(Path(task)) is None:
            raise EvaluateError(f"--tasks {task} declares no `task: NAME`; add one (lm-eval calls a task by it)")
    if importlib_missing("lm_eval"):
        raise EvaluateError("evaluation needs the lm-eval package: pip install -e '.[eval]'")


def check_items(args: argparse.Namespace, nproc: int) -> None:
    """Each of the `nproc` processes needs an item of every task (lm-eval gives rank r the items r, r + nproc, ...).
    lm-eval's own task loading counts them; it also downloads a hub task's dataset here, once, not in each rank."""
    from lm_eval.evaluator_utils import get_sample_size

    names, task_manager = lm_eval_tasks(args)
    for name, task in task_manager.load(names)["tasks"].items():
        items = min(len(task.eval_docs), get_sample_size(task, args.limit) or len(task.eval_docs))
        if items < nproc:
            raise EvaluateError(
                f"--nproc {nproc}: task {name} has {items} items{' within --limit' if args.limit else ''} and each "
                f"process needs at least one; use --nproc {items} or fewer"
            )


def lm_eval_tasks(args: argparse.Namespace) -> tuple[list[str], TaskManager]:
    """--tasks as lm-eval's task names, and lm-eval's TaskManager that finds them: --include-path and the folder of
    each task given as a YAML file (then called by the name it declares) join lm-eval's own tasks. When every task is
    a YAML file, lm-eval's own are not indexed (~7 CPU-seconds in each process): a file declaring one task needs none
    of them (groups, which would, are refused by check_arguments: they declare no `task: NAME`)."""
    from lm_eval.tasks import TaskManager

    names, include = [], [str(args.include_path)] if args.include_path else []
    for task in args.tasks.split(","):
        if task.endswith((".yaml", ".yml")):
            include.append(str(Path(task).resolve().parent))
            names.append(task_name(Path(task)))
        else:
            names.append(task)
    files_only = all(task.endswith((".yaml", ".yml")) for task in args.tasks.split(","))
    return names, TaskManager(include_path=include or None, include_defaults=not files_only)


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def model_source(args: argparse.Namespace) -> dict:
    """What MODEL names: a checkpoint (its run folder, run id and step) or a Hugging Face folder or hub id."""
    if args.model is None:
        checkpoint = newest_checkpoint(args.checkpoints)
        if checkpoint is None:
            raise EvaluateError(
                f"no complete checkpoint (step-N folder) in {args.checkpoints}; give a checkpoint or a model folder"
            )
    else:
        checkpoint = Path(args.model)
    if (checkpoint / "checkpoint.json").is_file():
        record = json.loads((checkpoint / "checkpoint.json").read_text())
        run_dir = checkpoint.resolve().parent.parent
        return {"model": str(checkpoint), "name": checkpoint.name, "step": record["step"], "run_dir": str(run_dir),
                "run_id": record.get("run_id"), "config": record["config"]}  # fmt: skip
    if checkpoint.is_dir() and not (checkpoint / "config.json").is_file():
        raise EvaluateError(
            f"{checkpoint} is neither a checkpoint (no checkpoint.json) nor a Hugging Face model folder (no "
            "config.json); give a step-N folder or a folder written by scripts/export.py"
        )
    if not checkpoint.exists() and args.model.startswith((".", "/", "~")):
        raise EvaluateError(f"{args.model} does not exist; give a checkpoint, a model folder or a hub id")
    # A folder or hub id: no run and no step of its own.
    return {"model": args.model, "name": Path(args.model).name, "step": None, "run_dir": None, "run_id": None,
            "config": None}  # fmt: skip


def new_evaluation_folder(output_dir: Path, name: str) -> Path:
    """A folder of its own for this evaluation: created here, so that no earlier evaluation's files are touched."""
    evaluations = output_dir / "evaluations"
    evaluations.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1, 1000):
        folder = evaluations / (f"{stamp}-{name}" + (f"-{attempt}" if attempt > 1 else ""))
        try:
            folder.mkdir()  # exclusive: fails if the folder exists
            return folder
        except FileExistsError:
            continue
    raise EvaluateError(f"{evaluations} has 999 evaluations named {stamp}-{name}; give another --output-dir")


def export(checkpoint: Path, folder: Path) -> None:
    """The checkpoint as a Hugging Face folder, written by scripts/export.py --format hf (what a user would export):
    transformers' LlamaForCausalLM, which lm-eval's HFLM loads."""
    command = [sys.executable, str(PROJECT / "scripts" / "export.py"), str(checkpoint), "--output", str(folder),
               "--format", "hf"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise EvaluateError(f"scripts/export.py {checkpoint} failed: {lines[-1] if lines else result.returncode}")


def evaluate(args: argparse.Namespace, model: str, evaluation: Path, source: dict) -> None:
    """lm-eval's simple_evaluate on `model` (a folder or hub id); rank 0 writes the results and logs them."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tasks, task_manager = lm_eval_tasks(args)
    device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    lm = HFLM(pretrained=model, tokenizer=args.tokenizer, batch_size=args.batch_size, dtype=args.dtype, device=device)
    accelerator = getattr(lm, "accelerator", None)  # HFLM keeps accelerate's Accelerator when it has several ranks
    if accelerator is not None and lm.world_size == 1:
        # CPU ranks: HFLM turns on its data parallelism only when it counts more than one CUDA GPU, although its
        # Accelerator (accelerate's MULTI_CPU, gloo) holds them all; this sets the rank and world size its GPU
        # branch sets, from that Accelerator. The rest (each rank's items, the padding, the gathering) is lm-eval's.
        lm._rank, lm._world_size = accelerator.local_process_index, accelerator.num_processes
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
        task_manager=task_manager,
        log_samples=True,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
    )
    if results is None:  # not rank 0: it gathered every rank's items
        return
    write_results(results, evaluation, source)


def task_name(path: Path) -> str | None:
    """The name a task's YAML file declares (`task: NAME`), or None. lm-eval's YAML files may hold its own tags
    (`!function`), which safe_load does not know: only the `task:` line is read here."""
    for line in path.read_text().splitlines():
        if line.startswith("task:") and line[5:].strip():
            return line[5:].strip().strip("'\"")
    return None


def write_results(results: dict, evaluation: Path, source: dict) -> None:
    """results.json, samples_<task>.jsonl, a line per task in evaluations.jsonl, and the run's loggers."""
    from lm_eval.utils import handle_non_serializable

    samples = results.pop("samples")
    with open(evaluation / "results.json", "x") as file:
        json.dump(results, file, indent=2, default=handle_non_serializable)
    for task, items in samples.items():
        with open(evaluation / f"samples_{task}.jsonl", "x") as file:
            # In item order: from N processes they arrive rank after rank (rank r scored items r, r + N, ...).
            for item in sorted(items, key=lambda item: item["doc_id"]):
                file.write(json.dumps(item, default=handle_non_serializable) + "\n")
    # lm-eval names a score "metric,filter" ("acc,none", "acc_stderr,none"); the filter is "none" for most tasks.
    scores = {task: {} for task in results["results"]}
    for task, metrics in results["results"].items():
        for name, value in metrics.items():
            if "," in name and isinstance(value, int | float):
                scores[task][name.replace(",none", "").replace(",", "/")] = value
    run_dir = evaluation.parent.parent
    with open(run_dir / "evaluations.jsonl", "a") as file:
        for task, metrics in scores.items():
            row = {"run_id": source["run_id"], "step": source["step"], "model": source["model"], "task": task,
                   "metrics": metrics, "folder": str(evaluation)}  # fmt: skip
            file.write(json.dumps(row) + "\n")
    print(f"evaluated {source['model']}: {json.dumps(scores)}")
    print(f"results in {evaluation}")


if __name__ == "__main__":
    main()
