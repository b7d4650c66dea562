"""Training configuration: `config.toml` plus `--section.key VALUE` overrides.

Every section is a dataclass, so a key that does not exist, or a value of the
wrong type, is an error before any process group or model is created.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from model import ModelArgs


@dataclass
class JobConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str = "outputs"
    log_every: int = 10
    timeout_minutes: float = 10  # config.toml sets 60 for full checkpoints (rank 0 writes, the others wait)

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("job.output_dir is empty; name a folder, e.g. --job.output_dir outputs")
        if self.log_every < 1:
            raise ValueError(f"job.log_every must be at least 1, got {self.log_every}")
        if not 0 < self.timeout_minutes < math.inf:
            raise ValueError(f"job.timeout_minutes must be a positive number, got {self.timeout_minutes}")


@dataclass
class TrainingConfig:
    steps: int = 1000
    seed: int = 0
    global_batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-4
    lr_min_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_accum_steps: int = 1
    # When gradients are reduce-scattered with grad_accum_steps > 1: "every_micro_batch" keeps only sharded
    # gradients (1/N of the model per rank) at the cost of one reduce-scatter per micro-batch;
    # "last_micro_batch" reduces once per step but every rank holds the whole model's unsharded gradients
    # (in reduce_dtype) from the first micro-batch until the last one's backward.
    grad_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"
    max_norm: float = 1.0

    def __post_init__(self) -> None:
        at_least_one = ("steps", "global_batch_size", "seq_len", "grad_accum_steps")
        for key in at_least_one:
            if getattr(self, key) < 1:
                raise ValueError(f"training.{key} must be at least 1, got {getattr(self, key)}")
        # NaN compares false with everything, so each range is written to fail for it too.
        if not 0 < self.lr < math.inf:
            raise ValueError(f"training.lr must be a positive number, got {self.lr}")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"training.lr_min_ratio must be between 0 and 1, got {self.lr_min_ratio}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"training.weight_decay must be 0 or more, got {self.weight_decay}")
        if not 0 <= self.max_norm < math.inf:
            raise ValueError(f"training.max_norm must be 0 (no clipping) or more, got {self.max_norm}")
        if self.warmup_steps < 0:
            raise ValueError(f"training.warmup_steps must be 0 or more, got {self.warmup_steps}")
        if self.seed < 0:
            raise ValueError(f"training.seed must be 0 or more, got {self.seed}")


@dataclass
class DataConfig:
    # "" = synthetic tokens; a folder written by scripts/prepare_data.py; or a flat file of token ids.
    path: str = ""
    # The tokenizer of scripts/prepare_data.py and scripts/generate.py; "" = the model's own (model.path).
    tokenizer: str = ""
    synthetic_samples: int = 4096

    def __post_init__(self) -> None:
        if self.synthetic_samples < 1:
            raise ValueError(f"data.synthetic_samples must be at least 1, got {self.synthetic_samples}")


@dataclass
class EvalConfig:
    every: int = 100  # validation loss every N steps and after the last one; 0 = never
    batches: int = 4  # of training.global_batch_size samples each, the same samples every time

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every must be 0 (off) or more, got {self.every}")
        if self.batches < 1:
            raise ValueError(f"eval.batches must be at least 1, got {self.batches}")


@dataclass
class ProfileConfig:
    # torch.profiler traces of `steps` steps from step `start` (1-based; 0 = off), one Chrome trace per rank
    # in output_dir/profile/ (open in https://ui.perfetto.dev).
    start: int = 0
    steps: int = 2
    # On CUDA, a memory snapshot (https://pytorch.org/memory_viz) of the allocations up to this step; 0 = off.
    memory_snapshot_step: int = 0

    def __post_init__(self) -> None:
        if self.start < 0 or self.memory_snapshot_step < 0:
            raise ValueError(
                f"profile.start and profile.memory_snapshot_step must be 0 (off) or more, got "
                f"{self.start}, {self.memory_snapshot_step}"
            )
        if self.steps < 1:
            raise ValueError(f"profile.steps must be at least 1, got {self.steps}")


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    # The linear layers that get adapters, by name: the attention and MLP projections of Llama/Qwen/Mistral models.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be at least 1, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be at least 0 and below 1, got {self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name the linear layers to adapt, e.g. q_proj,v_proj")


@dataclass
class ParallelConfig:
    # HSDP: shard over groups of dp_shard ranks, replicate across dp_replicate groups (-1: the rest).
    dp_replicate: int = 1
    dp_shard: int = -1
    # true, false, or the size of the groups that keep parameters sharded between forward and backward.
    reshard_after_forward: bool | int = True
    # Classes to fully_shard one module at a time; empty: the model's _no_split_modules (its decoder layers).
    shard_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dp_replicate < 1 or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(
                f"parallel.dp_replicate must be >= 1 and dp_shard >= 1 or -1, not {self.dp_replicate}, {self.dp_shard}"
            )
        if not isinstance(self.reshard_after_forward, bool) and self.reshard_after_forward < 1:
            raise ValueError(
                f"parallel.reshard_after_forward must be true, false or >= 1, not {self.reshard_after_forward}"
            )


@dataclass
class CheckpointConfig:
    interval: int = 100
    keep_last: int = 2
    model_only_final: bool = False
    resume: Literal["auto", "never"] = "auto"

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"checkpoint.interval must be at least 1, got {self.interval}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be at least 1, got {self.keep_last}")


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


class ConfigError(ValueError):
    pass


def _field_types(section_cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _convert(value: object, expected: typing.Any, key: str) -> object:
    """Check (TOML values) or parse (command-line strings) `value` as the type declared for `key`."""
    if isinstance(expected, types.UnionType):  # e.g. bool | int: the first type that accepts the value
        for option in typing.get_args(expected):
            try:
                return _convert(value, option, key)
            except ConfigError:
                pass
        names = " or ".join(option.__name__ for option in typing.get_args(expected))
        raise ConfigError(f"{key} must be {names}, got {value!r}")
    if typing.get_origin(expected) is Literal:
        choices = typing.get_args(expected)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if expected == list[str]:
        # On the command line a comma-separated list: --parallel.shard_modules Block,Embedding
        items = [item for item in value.split(",") if item] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        return items
    if isinstance(value, str) and expected is not str:
        if expected is bool:
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
            return value.lower() == "true"
        try:
            return expected(value)
        except ValueError:
            raise ConfigError(f"{key} must be {expected.__name__}, got {value!r}") from None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{key} must be {expected.__name__}, got {value!r}")
    return value


def load_config(path: str | Path, overrides: dict[str, str] | None = None) -> Config:
    """Read `path`, apply `{"section.key": "value"}` overrides, and return a typed Config."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    sections = _field_types(Config)
    values: dict[str, dict[str, object]] = {name: {} for name in sections}
    for section, table in raw.items():
        if section not in sections:
            raise ConfigError(f"unknown section [{section}] in {path}; known: {', '.join(sections)}")
        values[section].update(table)
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in sections or not key:
            raise ConfigError(f"unknown option --{dotted}; options look like --training.steps 20")
        values[section][key] = value
    kwargs = {}
    for section, section_cls in sections.items():
        types = _field_types(section_cls)
        for key, value in values[section].items():
            if key not in types:
                raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(types)}")
            values[section][key] = _convert(value, types[key], f"{section}.{key}")
        kwargs[section] = section_cls(**values[section])
    return Config(**kwargs)


def parse_args(argv: list[str] | None = None) -> Config:
    """`train.py [--config config.toml] [--section.key VALUE ...]`; a mistake exits with one line and code 2."""
    parser = argparse.ArgumentParser(description="FSDP2 training", allow_abbrev=False)
    parser.add_argument("--config", default="config.toml", help="TOML file (default: %(default)s)")
    args, rest = parser.parse_known_args(argv)
    try:
        return load_config(args.config, parse_overrides(rest))
    except (ConfigError, TypeError, ValueError) as error:
        message = str(error)
    except FileNotFoundError:
        message = f"config file {args.config} not found; pass --config PATH"
    except OSError as error:
        message = f"config file {args.config} cannot be read ({error.strerror or error}); pass --config PATH"
    # Under torchrun every rank parses the same arguments: one of them says what is wrong.
    parser.exit(2, f"{parser.prog}: error: {message}\n" if os.environ.get("RANK", "0") == "0" else None)


def parse_overrides(rest: list[str]) -> dict[str, str]:
    """["--training.steps", "20", "--job.device=cpu"] -> {"training.steps": "20", "job.device": "cpu"}."""
    overrides: dict[str, str] = {}
    while rest:
        flag = rest.pop(0)
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"unexpected argument {flag!r}; overrides look like --training.steps 20")
        name, eq, value = flag[2:].partition("=")
        if not eq:
            if not rest:
                raise ConfigError(f"{flag} needs a value")
            value = rest.pop(0)
        overrides[name] = value
    return overrides
