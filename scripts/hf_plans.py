"""Write templates/hf_plans.json: the parallelism plans the installed transformers declares for each causal
LM model type (its config class's base_model_tp_plan, base_model_ep_plan and base_model_pp_plan).

fsdp2gen never imports transformers (which imports torch), so it reads this file instead: `fsdp2gen new --family hf
--tp N` (--ep N) refuses a local model whose type declares no tensor- (expert-) parallel plan, and the README of an
hf project carries the table of which dimension works for which model type, and why. Rerun after upgrading transformers:

    python scripts/hf_plans.py

tests/test_tensor_parallel.py fails while the file differs from what the installed transformers declares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent.parent / "templates" / "hf_plans.json"


def declared_plans() -> dict:
    """{"transformers": version, "models": {model_type: {"class", "tp", "tp_plan", "ep", "pp"}}}: "class" the causal LM
    class, "tp" / "ep" the sorted plan words of its tensor- / expert-parallel plan ([]: none declared), "tp_plan" the
    tensor-parallel plan itself ({module pattern: word}: which layers `fsdp2gen plan --tp` splits how), "pp" whether
    it declares a pipeline-parallel plan. Config classes only: no modeling module is imported."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        config = CONFIG_MAPPING[model_type]
        models[model_type] = {
            "class": class_name,
            "tp": sorted(set((getattr(config, "base_model_tp_plan", None) or {}).values())),
            "tp_plan": dict(getattr(config, "base_model_tp_plan", None) or {}),
            "ep": sorted(set((getattr(config, "base_model_ep_plan", None) or {}).values())),
            "pp": bool(getattr(config, "base_model_pp_plan", None)),
        }
    return {"transformers": transformers.__version__, "models": models}


def main() -> None:
    text = json.dumps(declared_plans(), indent=1, sort_keys=True) + "\n"
    if "--check" in sys.argv[1:]:
        sys.exit(0 if OUTPUT.read_text() == text else f"{OUTPUT} differs from the installed transformers' plans")
    OUTPUT.write_text(text)


if __name__ == "__main__":
    main()
