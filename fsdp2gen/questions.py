"""The template's questions, read from its copier.yml, and validation of answers against them.

copier.yml is the single source of truth: the CLI's options, prompts, defaults
and validators all come from it, so `fsdp2gen new` and `copier copy` accept
exactly the same answers.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jinja2.sandbox import SandboxedEnvironment

from fsdp2gen.files import FileInputError, read_text, read_yaml_mapping

PACKAGE_DIR = Path(__file__).resolve().parent


def template_dir() -> Path:
    """The copier template: shipped inside the wheel, or `templates/` of a source checkout."""
    for candidate in (PACKAGE_DIR / "templates", PACKAGE_DIR.parent / "templates"):
        if (candidate / "copier.yml").is_file():
            return candidate
    raise FileNotFoundError(f"fsdp2gen's template is missing (looked in {PACKAGE_DIR} and its parent)")


@dataclass(frozen=True)
class Question:
    name: str
    type: str
    help: str
    default: Any
    choices: tuple[tuple[str, str], ...] = ()  # (label, value)
    validator: str = ""
    when: str = ""  # a Jinja condition on the other answers; empty: always asked

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def choice_values(self) -> list[str]:
        return [value for _, value in self.choices]

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description, for agents that build their own prompt."""
        return {
            "name": self.name,
            "flag": self.flag,
            "type": self.type,
            "help": self.help,
            "default": self.default,
            "choices": self.choice_values,
            "choice_help": {value: label for label, value in self.choices},
            "when": self.when or None,
        }

    def applies(self, answers: dict[str, Any]) -> bool:
        """Whether the question is asked given the other answers (copier's `when:`)."""
        if not self.when:
            return True
        return _render(self.when, answers).lower() not in ("", "false", "0", "none")

    def convert(self, raw: str) -> Any:
        """Parse a typed-in string as this question's type (raises ValueError)."""
        if self.type == "int":
            return int(raw)
        if self.type == "bool":
            if raw.lower() not in ("true", "false", "yes", "no", "y", "n"):
                raise ValueError(f"{raw!r} is not yes or no")
            return raw.lower() in ("true", "yes", "y")
        return raw

    def type_error(self, value: Any) -> str | None:
        """The problem with `value`'s type or choice, or None (the validator is not consulted)."""
        # Only answers files (and a project's recorded answers) reach these: flags and prompts are typed.
        if self.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{_short(value)} is not an integer{self._example()}"
        if self.type == "bool" and not isinstance(value, bool):
            return f"{_short(value)} is not true or false{self._example()}"
        if self.type == "str" and not isinstance(value, str):
            return f"{_short(value)} is not a string{self._example()}"
        if self.choices and value not in self.choice_values:
            return f"{_short(value)} is not one of {', '.join(self.choice_values)}"
        return None

    def _example(self) -> str:
        """`, e.g. name: default` as YAML writes it (quoted where a string needs it), or "" without a default."""
        if self.default in ("", None) or "{{" in str(self.default):
            return ""
        return f", e.g. {yaml.safe_dump({self.name: self.default}, default_style=None).strip()}"

    def error(self, value: Any, answers: dict[str, Any]) -> str | None:
        """The problem with `value` as an answer, or None if it is valid."""
        if problem := self.type_error(value):
            return problem
        if self.validator:
            try:
                problem = _render(self.validator, {**answers, self.name: value})
            except (TypeError, ValueError, OverflowError, ArithmeticError) as error:
                # Another answer of the wrong type can break this validator's arithmetic: name that answer.
                return f"cannot be checked against the other answers ({error}); fix those first"
            if problem:
                return " ".join(problem.split())
        if check := PYTHON_CHECKS.get(self.name):
            return check(value, answers)
        return None

    def normalise(self, value: Any) -> Any:
        """`value` as written naturally in YAML, converted to this question's type where that is unambiguous.

        `reshard_after_forward: true` or `: 4` (a bool, an int) mean the strings "true" and "4" this str
        question takes; `gpus: "4"` means 4. Anything else is returned as is, for error() to refuse.
        """
        if self.type == "str" and isinstance(value, bool):
            return "true" if value else "false"
        if self.type == "str" and isinstance(value, int):
            return str(value)
        if self.type in ("int", "bool") and isinstance(value, str):
            try:
                return self.convert(value.strip())
            except ValueError:
                return value
        return value


def _short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a message stays one readable line whatever was given."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _hf_model_problem(value: str, answers: dict[str, Any]) -> str | None:
    """What the template's validator cannot read: a local model folder's config.json must be a transformers
    config (a JSON object with model_type), else loading it fails only when training starts."""
    config = Path(os.path.expanduser(value)) / "config.json"
    if not config.is_file():
        return None  # a hub id, or a folder that will exist by training time: the validator has judged it
    fix = "give a folder written by save_pretrained (config.json + *.safetensors) or a hub id"
    try:
        loaded = json.loads(read_text(config, "model config", fix))
    except FileInputError as error:
        return str(error)
    except json.JSONDecodeError as error:
        return f"{config} is not valid JSON ({error.msg}, line {error.lineno}); {fix}"
    if not isinstance(loaded, dict):
        return f"{config} holds a JSON {type(loaded).__name__}, not an object; {fix}"
    if not isinstance(loaded.get("model_type"), str) or not loaded["model_type"]:
        return f"{config} has no model_type, so transformers cannot tell the architecture; {fix}"
    if answers.get("family") == "llama":
        return _llama_checkpoint_problem(value, loaded)
    return None


@cache
def _llama_config_rules() -> Any:
    """The project's hf_llama_config.py, as the template ships it: what a config.json must say for the built-in
    llama to take it (architecture, biases, rotary scaling). Standard library only, so the generator runs the very
    rules training runs; loaded from its file, as no package holds it."""
    path = template_dir() / "project" / "{% if hf_adapter or moe %}hf_llama_config.py{% endif %}"
    module = types.ModuleType("hf_llama_config")  # its file name is copier's (no .py suffix): run its source
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    return module


def _llama_checkpoint_problem(value: str, config: dict[str, Any]) -> str | None:
    """--family llama --hf-model: the line training would stop with for this config.json (hf_llama_config.py's
    args_from_hf_config), now; None if it takes it. A config.json without a shape key (not save_pretrained's) is
    left to training, which reads the folder again then."""
    rules = _llama_config_rules()
    try:
        rules.args_from_hf_config(config)
    except rules.HFCheckpointError as error:
        return f"{value}: {error}"
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return None


def _local_hf_config(value: int, answers: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
    """(config.json's path, its content) of the local Hugging Face model a dimension of `value` > 1 is asked of;
    None when there is nothing to check here: a dimension of 1, another family, or a hub id or config.json that
    hf_model's own check speaks for."""
    if value <= 1 or answers.get("family") != "hf" or not answers.get("hf_model"):
        return None
    config = Path(os.path.expanduser(answers["hf_model"])) / "config.json"
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return (config, loaded) if isinstance(loaded, dict) else None


def _undeclared_plan(dimension: str, name: str, config: Path, loaded: dict[str, Any]) -> str | None:
    """The start of the line for a model type whose `dimension` plan (its config class's base_model_<dimension>_plan)
    is empty, as the installed transformers declared it when scripts/hf_plans.py wrote templates/hf_plans.json
    (fsdp2gen never imports transformers, which imports torch); None if it declares one, or if the file does not list
    the type (a newer transformers): preflight asks transformers itself."""
    model_type = loaded.get("model_type")
    plans = json.loads((template_dir() / "hf_plans.json").read_text())
    declared = plans["models"].get(model_type) if isinstance(model_type, str) else None
    if declared is None or declared[dimension]:
        return None
    return (
        f"{declared['class']} ({config}: model_type {model_type}) declares no {name} plan in transformers "
        f"{plans['transformers']} (its config class's base_model_{dimension}_plan is empty"
    )


def _tp_plan_problem(value: int, answers: dict[str, Any]) -> str | None:
    """--tp N for a local Hugging Face model whose type declares no tensor-parallel plan: refused now rather than
    at run time."""
    found = _local_hf_config(value, answers)
    if found and (undeclared := _undeclared_plan("tp", "tensor-parallel", *found)):
        return f"{undeclared}); use --tp 1 (FSDP shards it over every GPU)"
    return None


def _pp_plan_problem(value: int, answers: dict[str, Any]) -> str | None:
    """--pp N for a local Hugging Face model whose type declares no pipeline plan (which of the base model's
    children are cut into stages), or whose config.json asks for transformers' load-balancing loss of a mixture of
    experts (one function of every layer's router logits, which no stage holds): refused now rather than at run
    time."""
    found = _local_hf_config(value, answers)
    if found and (undeclared := _undeclared_plan("pp", "pipeline", *found)):
        return f"{undeclared}); use --pp 1 (FSDP shards it over every GPU)"
    if found and found[1].get("output_router_logits") is True:
        config, loaded = found
        name = (loaded.get("architectures") or [loaded.get("model_type")])[0]
        return (
            f"{name} ({config}) sets output_router_logits: transformers' load-balancing loss is one function of "
            "every layer's router logits at once, which the pipeline stages hold apart; use --pp 1, or set "
            "output_router_logits to false in its config.json"
        )
    return None


# The config.json keys that hold a mixture-of-experts model's number of (routed) experts.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _ep_plan_problem(value: int, answers: dict[str, Any]) -> str | None:
    """--ep N for a local Hugging Face model: refused now, rather than at run time, if its type declares no
    expert-parallel plan (a dense model) or its config.json's number of experts is not divisible by N."""
    if not (found := _local_hf_config(value, answers)):
        return None
    if undeclared := _undeclared_plan("ep", "expert-parallel", *found):
        return f"{undeclared}: a dense model has no experts to share out); use --ep 1"
    config, loaded = found
    # transformers' MoE configs name the count differently (Mixtral: num_local_experts; DeepSeek: n_routed_experts).
    key = next((key for key in EXPERT_COUNT_KEYS if isinstance(loaded.get(key), int) and loaded[key] > 0), None)
    if key is not None and loaded[key] % value:
        fitting = max(d for d in range(1, value + 1) if loaded[key] % d == 0)
        return f"{config} has {key} {loaded[key]}, which {value} GPUs cannot share out equally; e.g. --ep {fitting}"
    return None


# config.json keys of attention that ring attention (context parallelism: causal SDPA over the whole sequence, in
# pieces) cannot split, with the value that means "none", and what the attention does otherwise. (A sliding window
# depends on training.seq_len, and whether the model supports SDPA on its class: the project's preflight.py runs its
# attention once on the meta device and judges those.)
RING_CANNOT = {
    "attn_logit_softcapping": (None, "soft-caps its attention logits"),
    "attention_dropout": (0.0, "applies dropout to its attention weights"),
}


def _cp_attention_problem(value: int, answers: dict[str, Any]) -> str | None:
    """--cp N for a local Hugging Face model whose config.json says its attention is more than causal softmax
    attention (RING_CANNOT), or that some of its layers do not attend (layer_types: mamba, linear attention):
    refused now rather than at run time."""
    if not (found := _local_hf_config(value, answers)):
        return None
    config, loaded = found
    if isinstance(loaded.get("text_config"), dict):
        loaded = loaded["text_config"]  # a multimodal config: its language model's
    what = [text for key, (none, text) in RING_CANNOT.items() if loaded.get(key, none) not in (none, 0)]
    layers = sorted(set(map(str, loaded.get("layer_types") or [])) - {"full_attention", "sliding_attention"})
    if layers:
        what.append(f"has {', '.join(layers)} layers (state carried along the sequence)")
    if not what:
        return None
    name = (loaded.get("architectures") or [loaded.get("model_type")])[0]
    return (
        f"{name} ({config}) {' and '.join(what)}, which ring attention (causal SDPA over the whole sequence, in "
        "pieces) cannot split; use --cp 1"
    )


# Checks of an answer that Jinja cannot express (copier.yml's validators cannot read a file's content);
# run after the validator, by fsdp2gen only.
PYTHON_CHECKS = {
    "hf_model": _hf_model_problem,
    "tp": _tp_plan_problem,
    "pp": _pp_plan_problem,
    "cp": _cp_attention_problem,
    "ep": _ep_plan_problem,
}


def _render(template: str, answers: dict[str, Any]) -> str:
    """`template` rendered with `answers` over the defaults, as copier renders validators and `when:`."""
    defaults = {q.name: q.default for q in questions().values() if "{{" not in str(q.default)}
    return _jinja().from_string(template).render({**defaults, **answers}).strip()


@cache
def _jinja() -> SandboxedEnvironment:
    # The filters copier gives validators (regex_search and friends), so both evaluate them alike.
    return SandboxedEnvironment(extensions=["jinja2_ansible_filters.AnsibleCoreFiltersExtension"])


@cache
def questions() -> dict[str, Question]:
    """The questions a user answers, in copier.yml order (settings and `when: false` values left out)."""
    spec = yaml.safe_load((template_dir() / "copier.yml").read_text())
    found = {}
    for name, entry in spec.items():
        if name.startswith("_") or not isinstance(entry, dict) or entry.get("when") is False:
            continue
        choices = entry.get("choices") or {}
        if isinstance(choices, list):
            choices = {str(value): value for value in choices}
        found[name] = Question(
            name=name,
            type=entry.get("type", "str"),
            help=entry.get("help", name),
            default=entry.get("default"),
            choices=tuple((str(label), str(value)) for label, value in choices.items()),
            validator=entry.get("validator", ""),
            when=str(entry.get("when", "")),
        )
    return found


def validate(answers: dict[str, Any]) -> dict[str, str]:
    """{question name: problem} for every invalid answer among `answers`.

    Unknown names and wrong types come first, alone: a validator reads the other answers, and one of the
    wrong type would make its message (or its arithmetic) about the wrong thing.
    """
    all_questions = questions()
    problems = {}
    for name, value in answers.items():
        if name not in all_questions:
            problems[name] = f"unknown question; known: {', '.join(all_questions)}"
        elif message := all_questions[name].type_error(value):
            problems[name] = message
    if problems:
        return problems
    for name, value in answers.items():
        if message := all_questions[name].error(value, answers):
            problems[name] = message
    return problems


def first_problem(answers: dict[str, Any], sources: dict[str, str]) -> str | None:
    """The first invalid answer as one message naming where it came from (`sources`: a flag, or `name in FILE`;
    the question's flag when not listed), or None when all are valid."""
    for name, problem in validate(answers).items():
        return f"{sources.get(name, questions()[name].flag if name in questions() else name)}: {problem}"
    return None


# Answers that another answer implies when it is given without them: --qlora is LoRA on an NF4 base.
IMPLIED = {"qlora": {"lora": True}}


def with_implied(answers: dict[str, Any]) -> dict[str, Any]:
    """`answers` plus what those given imply (IMPLIED) where not answered: `new --qlora` and `update --qlora` answer
    lora true too. An explicit contrary answer (--qlora --no-lora) is kept, and the validator refuses it."""
    implied = dict(answers)
    for name, implies in IMPLIED.items():
        if implied.get(name):
            for other, value in implies.items():
                implied.setdefault(other, value)
    return implied


def with_recorded(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The answers of a re-render (`update`, `new --force`): every recorded answer the command does not change,
    under the `given` ones. The one place both commands merge them.

    Recorded values are normalised (YAML's natural types, as in an answers file); keys this template does not ask
    (copier's `_` keys, another version's questions) are left out; a recorded family answer (copier's `when:`)
    that no longer applies is dropped (`hf_model` after `--family llama`), as copier drops it. Questions that
    nothing answers are left to the caller (a default, or a prompt).
    """
    known = questions()
    merged = {name: known[name].normalise(value) for name, value in recorded.items() if name in known}
    merged.update(given)
    for name, question in known.items():
        if question.when and name not in given and name in merged and not question.applies(merged):
            del merged[name]
    return merged


def project_name_from_folder(folder_name: str) -> str:
    """The project name copier derives from the destination folder's name (project_name's default)."""
    return _jinja().from_string(questions()["project_name"].default).render(_folder_name=folder_name)


def read_answers(path: Path, fix: str) -> dict[str, Any]:
    """The mapping in an answers file: a project's .copier-answers.yml (`_`-keys included: copier's own) or the
    file of `new --answers-file`. The one reader of answers files (plan, update, `new --force` and
    load_answers_file use it); FileInputError names the file and the problem, and ends with `fix`."""
    return read_yaml_mapping(path, "answers file", fix)


def load_answers_file(path: Path) -> dict[str, Any]:
    """Answers from a YAML file with the keys of `.copier-answers.yml` (`_`-keys are ignored).

    Values written in YAML's natural types are converted (see Question.normalise); unknown keys and values
    of the wrong type are refused here. How the answers fit together is checked later, once they are merged
    with the flags and defaults, so that the messages speak of the answers that will be used.
    """
    try:
        loaded = read_answers(path, "pass a YAML file of answers like 'gpus: 8'")
    except FileInputError as error:
        raise ValueError(str(error)) from None
    all_questions = questions()
    answers = {}
    for key, value in loaded.items():
        name = str(key)
        if name.startswith("_"):
            continue
        if name not in all_questions:
            raise ValueError(f"{name} in {path}: unknown question; known: {', '.join(all_questions)}")
        answers[name] = all_questions[name].normalise(value)
        if problem := all_questions[name].type_error(answers[name]):
            raise ValueError(f"{name} in {path}: {problem}")
    return answers
