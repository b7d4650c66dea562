"""Run by test_model_interface.py inside a generated project (cwd and PYTHONPATH = the project), in one process:
`python PATH/model_interface_probe.py SPEC`, SPEC a JSON object {"table": {name: params}, "overrides": {key: value}}
where `table` is the model interface as the project's AGENTS.md lists it (params: the parameters its row shows,
[[name, default or null], ...], or null for a name that is not a function) and `overrides` the config keys the
test sets (a tiny model, the pretrained folder).

Every name of the table is called on a plain module (built by model.py's build_model on the meta device,
to_empty, NaN everywhere, then initialize: never fully_shard-ed) and on the model train.py builds
(build_model_meta: fully_shard-ed, over a mesh of this one rank), and the two must agree with each other and with
the family's own reference (transformers' init and from_pretrained for hf, the model's own init_weights for the
others). The interface needs a process group (hf's initialize and a mixture-of-experts model's balance_experts
run collectives): this is train.py's own group of one (init_distributed without torchrun: gloo, a HashStore).

Prints one JSON line: {name: "ok"} for each name checked, and {"unchecked": [...]} for the table's names this
probe has no check for (a name added to AGENTS.md later: add its check here).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from collections.abc import Callable
from functools import cached_property

import model as interface
import torch
import torch.nn.functional as F
from config import Config, load_config
from data import IGNORE
from schema import Rule
from torch import nn
from torch.distributed.tensor import DTensor
from train import build_model_meta, init_distributed

BATCH, SEQ = 2, 16


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (sharded) DTensor, or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too), whole, under the names of the unwrapped model."""
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name: full(tensor).detach() for name, tensor in named.items()}


def ties(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that has several (tied weights), sorted."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), (what, sorted(got.keys() ^ expected.keys())[:5])
    differ = [name for name in got if not torch.equal(got[name].cpu(), expected[name].cpu())]
    assert not differ, f"{what}: {differ[:5]} differ"


class Probe:
    def __init__(self, config: Config, device: torch.device, mesh) -> None:
        self.config, self.device, self.mesh = config, device, mesh

    def build_plain(self, config: Config) -> nn.Module:
        """model.py's own sequence on a plain module: build on meta, allocate, fill with NaN (garbage that no
        value equals), initialize; every parameter and buffer must then hold a number."""
        with torch.device("meta"):
            model = interface.build_model(config)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
        interface.initialize(model, config, self.device)
        left = [name for name, tensor in tensors(model).items() if tensor.is_floating_point() and tensor.isnan().any()]
        assert not left, f"initialize left {left[:5]} unfilled on a plain module"
        return model

    @cached_property
    def plain(self) -> nn.Module:
        return self.build_plain(self.config)

    @cached_property
    def sharded(self) -> nn.Module:
        model = build_model_meta(self.config, self.mesh, self.device)
        assert any(isinstance(param, DTensor) for param in model.parameters()), "build_model_meta shards nothing"
        return model

    @cached_property
    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = self.config.model.vocab_size
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (BATCH, SEQ), generator=generator)
        targets = torch.randint(vocab, (BATCH, SEQ), generator=generator)
        targets[:, :3] = IGNORE  # not counted
        return tokens.to(self.device), targets.to(self.device)

    # ---- one check per name of the table ----------------------------------------------------------------------

    def check_Model(self) -> None:
        assert inspect.isclass(interface.Model)
        assert isinstance(self.plain, interface.Model) and isinstance(self.sharded, interface.Model)

    def check_ModelArgs(self) -> None:
        assert dataclasses.is_dataclass(interface.ModelArgs)
        assert isinstance(self.config.model, interface.ModelArgs), type(self.config.model)

    def check_RESUME_MAY_CHANGE(self) -> None:
        fields = {field.name for field in dataclasses.fields(interface.ModelArgs)}
        assert all(isinstance(key, str) for key in interface.RESUME_MAY_CHANGE)
        assert set(interface.RESUME_MAY_CHANGE) <= fields, (interface.RESUME_MAY_CHANGE, fields)

    def check_MODEL_RULES(self) -> None:
        assert isinstance(interface.MODEL_RULES, list)
        # config.py checks them when it reads a config: each holds for this project's config.
        assert all(isinstance(rule, Rule) and rule.holds(self.config) for rule in interface.MODEL_RULES)

    def check_build_model(self) -> None:
        with torch.device("meta"):
            model = interface.build_model(self.config)
        assert isinstance(model, interface.Model)
        assert all(param.is_meta and param.dtype == torch.float32 for param in model.parameters())
        # fully_shard keeps the names: the sharded model's parameters and buffers are the plain one's.
        assert tensors(model).keys() == tensors(self.sharded).keys()

    def check_block_classes(self) -> None:
        shard_modules = self.config.parallel.shard_modules
        classes = interface.block_classes(self.plain, shard_modules)
        assert classes and all(isinstance(name, str) for name in classes), classes
        present = {type(module).__name__ for module in self.plain.modules()}
        assert set(classes) <= present, (classes, sorted(present))
        assert interface.block_classes(self.sharded, shard_modules) == classes

    def check_initialize(self) -> None:
        # The same values on the plain module as on the sharded one, and as the family's own initialisation.
        plain = tensors(self.plain)
        # Tied weights stay one tensor (to_empty gives each module of a plain model its own copy).
        assert ties(self.plain) == ties(self.sharded), (ties(self.plain), ties(self.sharded))
        assert_same(tensors(self.sharded), plain, "initialize: sharded vs plain")
        assert_same(plain, self.reference(self.config), "initialize: plain vs the family's own")
        if getattr(self.config.model, "pretrained", False) and not hasattr(self.config, "lora"):
            # hf: the model's own random initialisation too (model.pretrained = false).
            scratch = load_config("config.toml", {**OVERRIDES, "model.pretrained": "false"})
            assert_same(tensors(self.build_plain(scratch)), self.reference(scratch), "initialize from scratch")

    def reference(self, config: Config) -> dict[str, torch.Tensor]:
        """The family's own initialisation with the config's seed, on a model built on the CPU (no meta device)."""
        model = self.reference_model(config)
        assert ties(model) == ties(self.plain), (ties(model), ties(self.plain))
        return tensors(model)

    def reference_model(self, config: Config) -> nn.Module:
        seed = config.training.seed
        if not hasattr(config.model, "hf_config"):  # llama, custom: the model's own init_weights
            model = interface.Model(config.model)
            model.init_weights(seed=seed)
            return model
        from transformers import AutoModelForCausalLM

        if config.model.pretrained:  # from_pretrained: its weights, and the non-persistent buffers it computes
            model = AutoModelForCausalLM.from_pretrained(config.model.folder, dtype=torch.float32)
        else:  # transformers' own init_weights, run again with the seed (from_config ran it with the RNG as it was)
            model = AutoModelForCausalLM.from_config(config.model.hf_config, dtype=torch.float32)
            for module in model.modules():
                module.__dict__.pop("_is_hf_initialized", None)
            torch.manual_seed(seed)
            model.init_weights()
        if hasattr(config, "lora"):  # peft's adapters on it, initialised by peft with the seed
            from peft import LoraConfig, inject_adapter_in_model
            from peft.tuners.lora import LoraLayer

            lora = config.lora
            settings = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                  target_modules=lora.target_modules)  # fmt: skip
            inject_adapter_in_model(settings, model)
            torch.manual_seed(seed)
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    module.reset_lora_parameters("default", init_lora_weights=True)
        return model

    def check_output_logits(self) -> None:
        tokens, _ = self.batch
        with torch.no_grad():
            plain = interface.output_logits(self.plain.eval()(tokens))
            sharded = interface.output_logits(self.sharded.eval()(tokens))
        assert plain.shape == (BATCH, SEQ, self.config.model.vocab_size), plain.shape
        torch.testing.assert_close(full(sharded), plain)

    def check_loss(self) -> None:
        tokens, targets = self.batch
        loss = self.loss_of(self.plain.eval())
        with torch.no_grad():
            logits = interface.output_logits(self.plain(tokens)).float()
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(self.loss_of(self.sharded.eval()), loss)
        torch.testing.assert_close(self.loss_of(self.plain, chunks=2), loss)
        counted = (targets != IGNORE).sum()
        torch.testing.assert_close(self.loss_of(self.plain, reduction="sum"), loss * counted)
        # One document per row, said explicitly: the same as saying nothing.
        positions = torch.arange(SEQ, device=self.device).expand(BATCH, SEQ)
        document_ids = torch.zeros_like(tokens)
        torch.testing.assert_close(self.loss_of(self.plain, positions=positions, document_ids=document_ids), loss)

    def loss_of(self, model: nn.Module, **options) -> torch.Tensor:
        tokens, targets = self.batch
        with torch.no_grad():
            return interface.loss(model, tokens, targets, **options)

    def check_balance_experts(self) -> None:
        # As train_step calls it: after a training forward and backward. The same figures plain and sharded.
        figures = [self.train_and_balance(model) for model in (self.plain, self.sharded)]
        assert figures[0].keys() == figures[1].keys(), figures
        for name in figures[0]:
            torch.testing.assert_close(full(figures[1][name]), figures[0][name])
        experts = any("expert" in name for name, _ in self.plain.named_modules())
        assert bool(figures[0]) == experts, figures[0]  # {} for a dense model
        if experts:
            assert "moe_load_max_mean" in figures[0] and figures[0]["moe_load_max_mean"] >= 1, figures[0]

    def train_and_balance(self, model: nn.Module) -> dict[str, torch.Tensor]:
        tokens, targets = self.batch
        model.train()
        torch.manual_seed(1)  # dropout, if any, alike in both
        interface.loss(model, tokens, targets).backward()
        return interface.balance_experts(model, self.config)


def check_signature(name: str, function: Callable, params: list) -> None:
    """The function's parameters and their defaults are those its row of AGENTS.md shows."""
    shown = [(param.name, None if param.default is inspect.Parameter.empty else param.default)
             for param in inspect.signature(function).parameters.values()]  # fmt: skip
    assert shown == [tuple(param) for param in params], f"{name}: model.py has {shown}, AGENTS.md {params}"


spec = json.loads(sys.argv[1])
OVERRIDES = spec["overrides"]
config = load_config("config.toml", OVERRIDES)
device, mesh = init_distributed(config)  # no torchrun: train.py's group of one
probe = Probe(config, device, mesh)
checked, unchecked = {}, []
for name, params in spec["table"].items():
    check = getattr(probe, f"check_{name}", None)
    if check is None:
        unchecked.append(name)
        continue
    assert name in interface.__all__, f"model.py's __all__ lacks {name}"
    if params is not None:
        check_signature(name, getattr(interface, name), params)
    check()
    checked[name] = "ok"
print(json.dumps({**checked, "unchecked": unchecked}))
torch.distributed.destroy_process_group()
