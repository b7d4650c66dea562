"""The template's questions, read from its copier.yml, and validation of answers against them.

copier.yml is the single source of truth: the CLI's options, prompts, defaults
and validators all come from it, so `fsdp2gen new` and `copier copy` accept
exactly the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jinja2.sandbox import SandboxedEnvironment

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

    def error(self, value: Any, answers: dict[str, Any]) -> str | None:
        """The problem with `value` as an answer, or None if it is valid."""
        if self.choices and value not in self.choice_values:
            return f"{value!r} is not one of {', '.join(self.choice_values)}"
        if self.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{value!r} is not an integer"
        if self.type == "bool" and not isinstance(value, bool):
            return f"{value!r} is not true or false"
        if not self.validator:
            return None
        return _render(self.validator, {**answers, self.name: value}) or None


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
    """{question name: problem} for every invalid answer among `answers`."""
    all_questions = questions()
    problems = {}
    for name, value in answers.items():
        if name not in all_questions:
            problems[name] = f"unknown question; known: {', '.join(all_questions)}"
        elif message := all_questions[name].error(value, answers):
            problems[name] = message
    return problems


def load_answers_file(path: Path) -> dict[str, Any]:
    """Validated answers from a YAML file with the keys of `.copier-answers.yml` (`_`-keys are ignored)."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read answers file {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"answers file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"answers file {path} must be a mapping like 'gpus: 8', got {type(loaded).__name__}")
    answers = {str(key): value for key, value in loaded.items() if not str(key).startswith("_")}
    for name, problem in validate(answers).items():
        raise ValueError(f"{name} in {path}: {problem}")
    return answers
