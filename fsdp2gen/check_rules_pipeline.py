"""`fsdp2gen check`'s pipeline-parallel rules FSDP012-015: the optimizer, the stage cuts and tied weights of a
model split with torch.distributed.pipelining. Each is one function registered with `@rule`; check.py runs them.
"""

from __future__ import annotations

import ast

from fsdp2gen.check_analysis import (
    _argument,
    _inside,
    _is,
    _is_constant,
    _Module,
    _optimizer_owners,
    _Scope,
    rule,
)


def _uses_pipelining(module: _Module) -> bool:
    """The file imports torch.distributed.pipelining (PipelineStage, a schedule): the evidence for the PP rules."""
    return any(name.startswith("torch.distributed.pipelining") for name in module.imports.values())


def _pipeline_stages(module: _Module, scope: _Scope) -> list[tuple[ast.Call, str]]:
    """(call, path of the module it runs) of every PipelineStage(module, ...) in this scope."""
    stages = []
    for call in scope.calls:
        qualname = module.call_qualname(call) or ""
        target = _argument(call, 0, "submodule")
        if qualname.startswith("torch.distributed.pipelining") and qualname.endswith(".PipelineStage") and target:
            path = scope.path(target)
            if path:
                stages.append((call, path.replace("()", "")))
    return stages


def _cuts(scope: _Scope) -> list[tuple[ast.stmt, str]]:
    """(statement, path) of every part deleted from a module in this scope: `del model.layers[name]`, or
    `model.output = None` (a variable's own `del x` is not a cut)."""
    cuts = []
    for node in scope.nodes:
        if isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Assign) and _is_constant(node.value, None):
            targets = node.targets
        else:
            continue
        for target in targets:
            path = scope.path(target) if isinstance(target, ast.Attribute | ast.Subscript) else None
            # Not a part of a module: what a call returned (`for p in model.parameters(): p.grad = None`), a gradient.
            if path and "()" not in path and not path.endswith(".grad"):
                cuts.append((node, path))
    return cuts


def _derived_from(scope: _Scope, stage: ast.Call, path: str, owner: str) -> bool:
    """The stage's module `path` is a part of `owner` (model.layers[*]), or a name assigned from a call that takes
    `owner` (copy.deepcopy(model), split(model, rank)): a module cut from the whole model."""
    if path != owner and _inside(path, owner):
        return True
    assigned = scope.latest(path, stage.lineno) if "." not in path and "[" not in path else None
    if assigned is None or assigned[1] or not isinstance(assigned[0], ast.Call):
        return False
    arguments = [*assigned[0].args, *(keyword.value for keyword in assigned[0].keywords)]
    return any(scope.path(argument) == owner for argument in arguments if not isinstance(argument, ast.Starred))


@rule(
    "FSDP012",
    "optimizer built over the whole model instead of this rank's pipeline stage(s)",
    "cut the stages first (delete the other stages' blocks), then build the optimizer from the stage modules' "
    "parameters",
)
def _rule_optimizer_over_whole_model(module: _Module) -> None:
    if not _uses_pipelining(module):
        return
    for scope in module.scopes:
        stages, cuts = _pipeline_stages(module, scope), _cuts(scope)
        for call in scope.calls:
            qualname = module.call_qualname(call) or ""
            if not qualname.startswith("torch.optim.") or ".lr_scheduler." in qualname:
                continue
            for owner in sorted(_optimizer_owners(module, scope, call)):
                later_cuts = [cut for cut, path in cuts if cut.lineno > call.lineno and _inside(path, owner)]
                cut_from = [(stage, path) for stage, path in stages if _derived_from(scope, stage, path, owner)]
                if later_cuts:
                    module.report(
                        call,
                        f"optimizer built from {owner}.parameters() before the other stages' blocks are deleted "
                        f"from it on line {later_cuts[0].lineno}: it keeps every block of the whole model alive on "
                        "every rank, and their optimizer state",
                    )
                elif cut_from:
                    stage, path = cut_from[0]
                    module.report(
                        call,
                        f"optimizer built from {owner}.parameters(), the whole model, but this rank's pipeline stage "
                        f"on line {stage.lineno} runs {path}: it steps parameters the stage never uses, and the "
                        "whole model's optimizer state on every rank",
                    )
                else:
                    continue
                break


@rule(
    "FSDP013",
    "`PipelineStage` (or `fully_shard`) given a module before the other stages' blocks are deleted from it",
    "delete the other stages' blocks from the (meta) model first, then fully_shard the stage, then PipelineStage",
)
def _rule_stage_before_cut(module: _Module) -> None:
    if not _uses_pipelining(module):
        return
    for scope in module.scopes:
        cuts = _cuts(scope)
        built = [(call, "PipelineStage", path) for call, path in _pipeline_stages(module, scope)]
        for call in scope.calls:
            target = _argument(call, 0, "module") if module.is_fully_shard(call) else None
            path = scope.path(target) if target is not None else None
            if path:
                built.append((call, "fully_shard", path.replace("()", "")))
        for call, what, path in sorted(built, key=lambda entry: (entry[0].lineno, entry[0].col_offset)):
            later = [cut for cut, deleted in cuts if cut.lineno > call.lineno and _inside(deleted, path)]
            if later:
                module.report(
                    call,
                    f"{what}({path}) before the other stages' blocks are deleted from it on line "
                    f"{later[0].lineno}: the stage is set up holding the whole model, on every rank",
                )


@rule(
    "FSDP014",
    "a pipeline stage's blocks renumbered in a new `nn.ModuleList`/`nn.Sequential` (DCP keys collide across stages)",
    "keep the whole model's names: delete the other stages' blocks by name (layers in an nn.ModuleDict keyed by "
    "the global block index), so stage 1 still saves layers.4",
)
def _rule_renumbered_stage_blocks(module: _Module) -> None:
    if not _uses_pipelining(module):
        return
    for call in module.calls:
        if not _is(module.call_qualname(call), "ModuleList", "Sequential"):
            continue
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        # model.layers[4:8], or [model.layers[i] for i in range(4, 8)]: blocks picked out of an existing list
        # (a list of new blocks, [Block() for _ in range(n)], is the model's own definition).
        picked = [
            node
            for argument in arguments
            for node in ast.walk(argument)
            if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice))
            or (isinstance(node, ast.ListComp | ast.GeneratorExp) and isinstance(node.elt, ast.Subscript))
        ]
        if picked:
            module.report(
                call,
                f"{ast.unparse(call.func)}(...) of a part of the blocks numbers this stage's blocks from 0: every "
                "stage saves its first block as layers.0, and DCP keeps only one of them (the others' weights are "
                "lost, no error)",
            )


@rule(
    "FSDP015",
    "weights tied (`a.weight = b.weight`) in a pipelined model (embedding and output layer on different stages)",
    "untie them (a separate output weight), or keep the model unpipelined (pp 1)",
)
def _rule_tied_weights_across_stages(module: _Module) -> None:
    if not _uses_pipelining(module):
        return
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Attribute):
            continue
        tied = [t for t in node.targets if isinstance(t, ast.Attribute) and t.attr == node.value.attr == "weight"]
        if tied:
            module.report(
                node,
                f"{ast.unparse(tied[0])} = {ast.unparse(node.value)} ties two modules' weights in a pipelined model: "
                "the first stage holds the embedding and the last the output layer, so cutting the stages unties "
                "them silently (each trains its own copy, and a checkpoint keeps one)",
            )
