"""Run under torchrun in a generated hf project (test_hf.py): the sharded model filled by model.load_pretrained
from FOLDER must equal transformers' from_pretrained(FOLDER, dtype=float32) bit for bit, every tensor.

    torchrun ... hf_load_probe.py FOLDER [--blind | --both] [--pretrained MODEL,...] [--then-train RUNS.json]
        [--section.key VALUE ...]

--blind: every rank but 0 is given a folder that does not exist, as a rank on a node that does not see rank 0's
folder would, so that load_pretrained must take its rank-0 broadcast path. --both: first every rank sees FOLDER,
then the same with --blind, in one launch. Rank 0 prints, for each load, "every-rank: equal" or "blind: equal"
(or "...: differ: " and the names of the tensors that differ).

--pretrained MODEL,...: first, in the same launch, what the project's tests/check_pretrained.py MODEL ... checks and
prints (each model's logits and memory line per rank, its "MISMATCH" lines, then the last model built from scratch),
so that test_hf.py checks several models and FOLDER's loads with one launch (an hf project's imports cost ~6 CPU-s a
process).

--then-train RUNS.json: last, in the same launch, the training runs of RUNS.json (then_train.py).
"""

import importlib.util
import sys
from pathlib import Path

import model as model_module
import torch
import torch.distributed as dist
from model import ModelArgs
from then_train import take_option, train_runs  # beside this file (sys.path[0])
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from train import build_model_meta, run_on_every_rank
from transformers import AutoModelForCausalLM


def check(config, device, mesh, folder: Path, blind: bool) -> None:
    """One load of FOLDER (blind: rank 0's broadcast path) and rank 0's line. hf_moe_probe.py calls it too."""
    # Built from scratch (random weights), then loaded: every weight must change to the files' values.
    config.model = ModelArgs(path=str(folder), pretrained=False)
    model = build_model_meta(config, mesh, device)
    seen = folder if not blind or dist.get_rank() == 0 else folder.parent / "not-on-this-node"
    model_module.load_pretrained(model, seen)
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        differ = [name for name, tensor in reference.state_dict().items()
                  if name not in gathered or not torch.equal(gathered[name], tensor)]  # fmt: skip
        mode = "blind" if blind else "every-rank"
        print(f"{mode}: differ: " + " ".join(differ) if differ else f"{mode}: equal", flush=True)


def check_pretrained(config, device, mesh, models: list[str]) -> None:
    """tests/check_pretrained.py's checks of `models`, as `check_pretrained.py MODEL ...` makes them."""
    spec = importlib.util.spec_from_file_location("check_pretrained", Path("tests") / "check_pretrained.py")
    project_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(project_check)
    Path(config.job.output_dir).mkdir(parents=True, exist_ok=True)
    mismatches = []
    for model in models:
        config.model = ModelArgs(path=model, pretrained=True)
        mismatches += project_check.check_pretrained(config, mesh, device)
    mismatches += project_check.check_from_scratch(config, mesh, device)
    for line in mismatches:
        print("MISMATCH " + line, flush=True)


def main() -> None:
    folder, args = Path(sys.argv[1]), sys.argv[2:]
    runs, args = take_option(args, "--then-train")
    modes = [False, True] if "--both" in args else ["--blind" in args]
    models = args.pop(args.index("--pretrained") + 1).split(",") if "--pretrained" in args else []
    args = [arg for arg in args if arg not in ("--blind", "--both", "--pretrained")]

    def check_every_mode(config, device, mesh) -> int:
        if models:
            check_pretrained(config, device, mesh, models)
        for blind in modes:
            check(config, device, mesh, folder, blind)
        return train_runs(runs, device)

    run_on_every_rank(check_every_mode, args)


if __name__ == "__main__":
    main()
