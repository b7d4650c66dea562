"""`fsdp2gen check`: find FSDP2 mistakes in training scripts by reading them, never running them.

Only Python's `ast` is used: no torch import, no code executed, so it runs anywhere in milliseconds.
Every rule fires only on evidence inside the file it reads (a `fully_shard` call, an import, a
call order in one function or across the helper functions it calls, a dtype bound to a name); when
the evidence lives elsewhere the rule stays silent, so that a finding is worth reading.
`# fsdp2gen: noqa FSDPxxx` on a finding's line silences it.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    code: str
    catches: str  # one line for the README table
    fix: str
    check: Callable[[_Module], None] = field(compare=False, repr=False)


# Every rule, in code order: each check below registers itself with @rule, its one place in this file.
RULES: dict[str, Rule] = {}


def rule(code: str, catches: str, fix: str) -> Callable[[Callable[[_Module], None]], Callable[[_Module], None]]:
    """Register the decorated function as the check of rule `code`."""

    def register(check: Callable[[_Module], None]) -> Callable[[_Module], None]:
        if code in RULES:
            raise ValueError(f"{code} is registered twice")
        RULES[code] = Rule(code, catches, fix, check)
        return check

    return register


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str


class CheckInputError(Exception):
    """A path that cannot be read, parsed or analysed; the CLI reports it as bad input (exit 2), in one line."""


NOQA = re.compile(r"#\s*fsdp2gen:\s*noqa\b(?P<codes>(?:[\s,:]+FSDP\d{3})*)", re.IGNORECASE)
LOSSY_DTYPES = {"torch.bfloat16", "torch.float16", "torch.half"}
STATE_DICT_GETTERS = {"get_model_state_dict", "get_state_dict"}
# Names of calls that initialise (or load) parameters after to_empty.
INIT_CALL = re.compile(
    r"init|reset_parameters|load|set_.*state_dict|apply|fill_|normal_|uniform_|zero_|copy_|constant_|ones_"
)
NOT_INIT_CALLS = {"init_process_group", "init_device_mesh", "__init__"}


def _is(qualname: str | None, *names: str) -> bool:
    """True if `qualname` is torch.<any submodules>.<name> for one of `names`."""
    return bool(qualname) and qualname.startswith("torch.") and qualname.rsplit(".", 1)[-1] in names


def _call_name(call: ast.Call) -> str:
    """The last name of what is called: `model.init_weights(...)` -> init_weights."""
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    if position < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value


class _Scope:
    """One function body (or the module, or a class body): the unit in which call order is judged."""

    def __init__(self, node: ast.AST, module: _Module) -> None:
        self.node = node
        self.module = module
        self._parents: dict[ast.AST, ast.AST] | None = None
        own = list(self._own_nodes(node))
        self.nodes = sorted((n for n in own if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset))
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]
        # name -> [(line, value, is_loop)]: the assignments that `path` follows to see through aliases.
        self.assignments: dict[str, list[tuple[int, ast.expr, bool]]] = {}
        for n in own:
            if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for target in targets:
                    for name in self._target_names(target):
                        self.assignments.setdefault(name.id, []).append((n.lineno, n.value, False))
            elif isinstance(n, ast.For | ast.AsyncFor | ast.comprehension):
                iterated = n.iter
                # `for i, block in enumerate(model.layers)`: block comes from model.layers.
                if isinstance(iterated, ast.Call) and _call_name(iterated) in ("enumerate", "reversed", "list"):
                    iterated = iterated.args[0] if iterated.args else iterated
                for name in self._target_names(n.target):
                    self.assignments.setdefault(name.id, []).append((n.target.lineno, iterated, True))
        for entries in self.assignments.values():
            entries.sort(key=lambda entry: entry[0])

    @staticmethod
    def _own_nodes(root: ast.AST) -> Iterator[ast.AST]:
        """Every node of this scope, not descending into nested functions, classes or lambdas."""
        stack = list(ast.iter_child_nodes(root))
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
                continue
            yield node
            stack.extend(ast.iter_child_nodes(node))

    @staticmethod
    def _target_names(target: ast.expr) -> Iterator[ast.Name]:
        if isinstance(target, ast.Name):
            yield target
        elif isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                yield from _Scope._target_names(element)

    def latest(self, name: str, before: int) -> tuple[ast.expr, bool] | None:
        """The value last assigned to `name` on a line before `before` (or the for-loop it iterates)."""
        found = None
        for line, value, is_loop in self.assignments.get(name, []):
            if line < before or (is_loop and line == before):
                found = (value, is_loop)
        return found

    def path(self, node: ast.expr, depth: int = 0) -> str | None:
        """What object `node` denotes, as text with aliases resolved: `for b in model.layers` -> model.layers[*]."""
        if depth > 20:
            return None
        if isinstance(node, ast.Name):
            assigned = self.latest(node.id, node.lineno)
            if assigned is None:
                return node.id
            value, is_loop = assigned
            if is_loop:
                inner = self.path(value, depth + 1)
                return f"{inner}[*]" if inner else node.id
            if isinstance(value, ast.Call) and self.module.is_fully_shard(value):
                # fully_shard returns the module it was given.
                value = _argument(value, 0, "module")
            if isinstance(value, ast.Name | ast.Attribute | ast.Subscript):
                return self.path(value, depth + 1) or node.id
            return node.id
        if isinstance(node, ast.Attribute):
            inner = self.path(node.value, depth + 1)
            return f"{inner}.{node.attr}" if inner else None
        if isinstance(node, ast.Subscript):
            inner = self.path(node.value, depth + 1)
            return f"{inner}[*]" if inner else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            # model.modules(), model.layers.children(): everything they yield lies inside model.
            inner = self.path(node.func, depth + 1)
            return f"{inner}()" if inner else None
        return None

    def parents(self) -> dict[ast.AST, ast.AST]:
        """Child -> parent for every node of this scope (computed once, on first use)."""
        if self._parents is None:
            self._parents = {
                child: parent
                for parent in [self.node, *self._own_nodes(self.node)]
                for child in ast.iter_child_nodes(parent)
            }
        return self._parents

    def returns(self, path: str) -> bool:
        return any(isinstance(n, ast.Return) and n.value is not None and self.path(n.value) == path for n in self.nodes)


def _inside(path: str | None, root: str | None) -> bool:
    """`path` is `root` or something reached from it (model.layers[*] is inside model)."""
    if not path or not root:
        return False
    return path == root or path.startswith((root + ".", root + "["))


class _Module:
    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree = tree
        self.path = path
        nodes = list(ast.walk(tree))
        self.imports: dict[str, str] = {}
        self.star_modules: list[str] = []
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # `import torch.distributed` binds `torch`; `import torch.distributed as dist` binds `dist`.
                    name = alias.asname or alias.name.split(".")[0]
                    self.imports[name] = alias.name if alias.asname else name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if alias.name == "*":
                        self.star_modules.append(node.module)
                    else:
                        self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        self.defined = {n.name for n in nodes if isinstance(n, definitions)}
        self.calls = [n for n in nodes if isinstance(n, ast.Call)]
        self.called_names = {n.func.id for n in self.calls if isinstance(n.func, ast.Name)}
        self.strings = [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        self.scopes = [_Scope(tree, self)] + [_Scope(n, self) for n in nodes if isinstance(n, definitions)]
        self.findings: list[Finding] = []
        self.checking: Rule  # the rule whose check runs: its code and fix go with what it reports
        # FSDP001's memo of what each helper function does (see _effects), and the helpers by name.
        self.effects: dict[tuple[int, int], list] = {}
        self.functions: dict[str, _Scope] | None = None
        self.following: set[_Scope] = set()
        # Every path that some fully_shard call sharded, in any scope: evidence for FSDP003/004/005.
        self.sharded: list[str] = []
        for scope in self.scopes:
            for call in scope.calls:
                target = _argument(call, 0, "module") if self.is_fully_shard(call) else None
                sharded = scope.path(target) if target is not None else None
                if sharded:
                    self.sharded.append(sharded.replace("()", ""))
        self.uses_fully_shard = any(self.is_fully_shard(n) for n in self.calls)

    def qualname(self, node: ast.expr) -> str | None:
        """`dist.barrier` -> torch.distributed.barrier, through any import alias."""
        if isinstance(node, ast.Name):
            if node.id in self.imports:
                return self.imports[node.id]
            # `from torch.distributed import *`: a bare name this file does not define comes from there.
            torch_stars = [m for m in self.star_modules if m.startswith("torch")]
            return f"{torch_stars[0]}.{node.id}" if torch_stars and node.id not in self.defined else None
        if isinstance(node, ast.Attribute):
            inner = self.qualname(node.value)
            return f"{inner}.{node.attr}" if inner else None
        return None

    def call_qualname(self, call: ast.Call) -> str | None:
        return self.qualname(call.func)

    def is_fully_shard(self, call: ast.Call) -> bool:
        qualname = self.call_qualname(call) or ""
        return qualname.startswith("torch.distributed.") and qualname.endswith(".fully_shard")

    def is_sharded(self, path: str | None) -> bool:
        if not path:
            return False
        path = path.replace("()", "")
        return any(_inside(path, root) for root in self.sharded)

    def report(self, node: ast.AST, message: str) -> None:
        """A finding of the rule being checked (check_source runs one rule at a time)."""
        code, fix = self.checking.code, self.checking.fix
        self.findings.append(Finding(self.path, node.lineno, node.col_offset + 1, code, message, fix))


def _optimizer_owners(module: _Module, scope: _Scope, call: ast.Call) -> set[str]:
    """Paths of the models whose .parameters() feed this torch.optim call, through variables too."""
    owners: set[str] = set()
    seen: set[str] = set()

    def visit(node: ast.AST, before: int) -> None:
        for inner in ast.walk(node):
            if isinstance(inner, ast.Call) and _call_name(inner) in ("parameters", "named_parameters"):
                if isinstance(inner.func, ast.Attribute):
                    owner = scope.path(inner.func.value)
                    if owner:
                        owners.add(owner)
            elif isinstance(inner, ast.Name) and inner.id not in seen and inner.id not in module.imports:
                seen.add(inner.id)
                assigned = scope.latest(inner.id, before)
                if assigned is not None and not assigned[1]:
                    visit(assigned[0], before)

    for argument in [*call.args, *(kw.value for kw in call.keywords)]:
        visit(argument, call.lineno)
    return owners


# How deep FSDP001 follows helper functions: main -> setup -> build_optimizer is depth 2.
HELPER_DEPTH = 4
# Whose parameters a helper's effect is on: ("param", name), ("ret", tuple index or None), ("global", name).
_Root = tuple[str, str | int | None]


@dataclass(frozen=True)
class _Event:
    """An optimizer built from `path`'s parameters, or `path` sharded, at `call` (directly or in a helper)."""

    call: ast.Call
    kind: str  # "optimizer" or "shard"
    path: str
    via: str  # "" when `call` is torch.optim / fully_shard itself, else the helper chain: "setup() -> build()"


def _functions(module: _Module) -> dict[str, _Scope]:
    """Module-level functions by name (a name defined twice is left out: which one runs is not sure)."""
    if module.functions is None:
        counts: dict[str, int] = {}
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                counts[node.name] = counts.get(node.name, 0) + 1
        module.functions = {
            scope.node.name: scope
            for scope in module.scopes
            if scope.node in module.tree.body
            and isinstance(scope.node, ast.FunctionDef | ast.AsyncFunctionDef)
            and counts[scope.node.name] == 1
        }
    return module.functions


def _methods(module: _Module, scope: _Scope) -> dict[str, _Scope]:
    """The other methods of the class whose method `scope` is, by name."""
    for owner in module.scopes:
        if isinstance(owner.node, ast.ClassDef) and scope.node in owner.node.body:
            names = {n.name for n in owner.node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            return {s.node.name: s for s in module.scopes if s.node in owner.node.body and s.node.name in names}
    return {}


def _callee(module: _Module, scope: _Scope, call: ast.Call) -> tuple[_Scope, dict[str, ast.expr]] | None:
    """The helper of this file that `call` runs, with its parameters bound to the call's arguments:
    a module-level function `f(...)`, or another method of the same class through `self.f(...)`."""
    func = call.func
    bound: dict[str, ast.expr] = {}
    if isinstance(func, ast.Name) and func.id in _functions(module) and func.id not in _parameters(scope.node):
        callee = _functions(module)[func.id]
        names = _parameters(callee.node)
    elif (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and _parameters(scope.node)[:1] == [func.value.id]
    ):
        callee = _methods(module, scope).get(func.attr)
        if callee is None or not _parameters(callee.node):
            return None
        names = _parameters(callee.node)
        bound[names[0]] = func.value  # self
        names = names[1:]
    else:
        return None
    arguments = callee.node.args
    positional = [a.arg for a in [*arguments.posonlyargs, *arguments.args]][len(bound) :]
    for name, value in zip(positional, call.args, strict=False):
        if isinstance(value, ast.Starred):
            break
        bound[name] = value
    for keyword in call.keywords:
        if keyword.arg in names:
            bound[keyword.arg] = keyword.value
    return callee, bound


def _split_path(path: str) -> tuple[str, str]:
    """model.layers[*] -> (model, .layers[*])."""
    match = re.match(r"[^.\[]+", path)
    head = match.group(0) if match else path
    return head, path[len(head) :]


def _binds(scope: _Scope, name: str) -> bool:
    """`name` is a parameter of this function or assigned in it (so a module-level `name` is hidden)."""
    return name in _parameters(scope.node) or any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in scope.nodes
    )


def _keeps_parameter(module: _Module, scope: _Scope, name: str) -> bool:
    """Parameter `name` still holds the caller's object: never rebound, or only to fully_shard(name) or
    name.to(...) style calls on itself."""
    for _, value, is_loop in scope.assignments.get(name, []):
        if is_loop:
            return False
        if isinstance(value, ast.Call):
            if module.is_fully_shard(value):
                value = _argument(value, 0, "module")
            elif isinstance(value.func, ast.Attribute):
                value = value.func.value
        if not (isinstance(value, ast.Name) and value.id == name):
            return False
    return True


def _returned(scope: _Scope) -> list[tuple[int | None, str]]:
    """(tuple index or None, path) of what the function returns: `return model, opt` -> (0, model), (1, opt)."""
    found: list[tuple[int | None, str]] = []
    for node in scope.nodes:
        if isinstance(node, ast.Return) and node.value is not None:
            values = list(enumerate(node.value.elts)) if isinstance(node.value, ast.Tuple) else [(None, node.value)]
            for index, value in values:
                if isinstance(value, ast.Call) and scope.module.is_fully_shard(value):
                    value = _argument(value, 0, "module")
                path = scope.path(value) if value is not None else None
                if path:
                    found.append((index, path))
    return found


def _effects(module: _Module, scope: _Scope, depth: int) -> list[tuple[str, _Root, str, str]]:
    """What calling the function `scope` does, for FSDP001: (kind, root, suffix, via), where root says
    whose parameters: ("param", name) the caller's argument, ("ret", index) what the caller assigns the
    result to (optimizers only: a model sharded and returned is a new object to the caller), or
    ("global", name) a module-level name."""
    key = (id(scope.node), depth)
    if key in module.effects:
        return module.effects[key]
    if scope in module.following:
        return []  # recursion: a helper does not follow calls to itself (or to a helper that called it)
    module.following.add(scope)
    name = getattr(scope.node, "name", "?")
    effects: list[tuple[str, _Root, str, str]] = []
    for event in _order_events(module, scope, depth):
        head, suffix = _split_path(event.path)
        root: _Root | None = None
        if head in _parameters(scope.node):
            root = ("param", head) if _keeps_parameter(module, scope, head) else None
        elif event.kind == "optimizer" and any(path == head for _, path in _returned(scope)):
            root = ("ret", next(index for index, path in _returned(scope) if path == head))
        elif not _binds(scope, head) and _binds(module.scopes[0], head):
            root = ("global", head)
        if root is not None:
            effects.append((event.kind, root, suffix, f"{name}()" + (f" -> {event.via}" if event.via else "")))
    module.following.discard(scope)
    module.effects[key] = effects
    return effects


def _order_events(module: _Module, scope: _Scope, depth: int = 0) -> list[_Event]:
    """Every optimizer built and every fully_shard in this scope, in the order of the calls that do them,
    following the helpers of this file it calls (HELPER_DEPTH deep)."""
    events: list[_Event] = []
    for call in scope.calls:
        qualname = module.call_qualname(call) or ""
        if qualname.startswith("torch.optim.") and ".lr_scheduler." not in qualname:
            events += [_Event(call, "optimizer", owner, "") for owner in sorted(_optimizer_owners(module, scope, call))]
            continue
        if module.is_fully_shard(call):
            target = _argument(call, 0, "module")
            path = scope.path(target) if target is not None else None
            if path:
                events.append(_Event(call, "shard", path, ""))
            continue
        helper = _callee(module, scope, call) if depth < HELPER_DEPTH else None
        if helper is None:
            continue
        callee, bound = helper
        for kind, (how, which), suffix, via in _effects(module, callee, depth + 1):
            path = None
            if how == "param" and which in bound:
                path = scope.path(bound[which])
            elif how == "ret":
                path = _assigned_result(scope, call, which)
            elif how == "global" and (scope is module.scopes[0] or not _binds(scope, str(which))):
                path = str(which)
            if path:
                events.append(_Event(call, kind, path.replace("()", "") + suffix, via))
    return events


def _assigned_result(scope: _Scope, call: ast.Call, index: int | None) -> str | None:
    """The name `x = call` (index None) or `a, x = call` (index 1) binds the call's result to."""
    statement = scope.parents().get(call)
    if not isinstance(statement, ast.Assign | ast.AnnAssign) or statement.value is not call:
        return None
    target = statement.targets[0] if isinstance(statement, ast.Assign) else statement.target
    if index is not None and isinstance(target, ast.Tuple | ast.List) and index < len(target.elts):
        target = target.elts[index]
    elif index is not None:
        return None
    return target.id if isinstance(target, ast.Name) else None


@rule(
    "FSDP001",
    "optimizer built from a model's parameters before `fully_shard` was applied to that model",
    "create the optimizer after every fully_shard call",
)
def _rule_optimizer_before_shard(module: _Module) -> None:
    for scope in module.scopes:
        events = _order_events(module, scope)
        shards = [event for event in events if event.kind == "shard"]
        reported: set[tuple[int, str]] = set()
        for event in events:
            owner = event.path
            if event.kind != "optimizer" or (id(event.call), owner) in reported:
                continue
            later = [
                shard
                for shard in shards
                if shard.call.lineno > event.call.lineno
                and (_inside(shard.path.replace("()", ""), owner) or _inside(owner, shard.path))
            ]
            if not later:
                continue
            reported.add((id(event.call), owner))
            shard = later[0]
            built = f" (in {event.via})" if event.via else ""
            sharded = f" (in {shard.via})" if shard.via else ""
            module.report(
                event.call,
                f"optimizer built{built} from {owner}.parameters() before fully_shard{sharded} on line "
                f"{shard.call.lineno}: it holds the replaced unsharded parameters and silently updates nothing",
            )


@rule(
    "FSDP002",
    "`fully_shard` applied to the root module before its blocks (bottom-up order violated)",
    "call fully_shard on each block first, then on the root",
)
def _rule_root_before_blocks(module: _Module) -> None:
    for scope in module.scopes:
        # The variables of loops over a plain list (`for block in blocks: fully_shard(block)`, blocks a parameter,
        # say): the list's relation to the root is unknown, but sharding its items after a whole model is the
        # root-first mistake. (A loop over model.layers is related to its model by path, as any other target.)
        loop_variables = {
            name.id
            for loop in scope.nodes
            if isinstance(loop, ast.For) and isinstance(loop.iter, ast.Name)
            for name in ast.walk(loop.target)
            if isinstance(name, ast.Name)
        }
        shards = []
        for call in scope.calls:
            target = _argument(call, 0, "module") if module.is_fully_shard(call) else None
            if target is not None and scope.path(target):
                shards.append((call, target, scope.path(target).replace("()", "")))
        for index, (call, target, root) in enumerate(shards):
            whole = isinstance(target, ast.Name) and target.id not in loop_variables
            children = [
                (c, t)
                for c, t, p in shards[index + 1 :]
                if p != root and (_inside(p, root) or (whole and isinstance(t, ast.Name) and t.id in loop_variables))
            ]
            if children:
                child_call, child = children[0]
                module.report(
                    call,
                    f"fully_shard({ast.unparse(target)}) runs before fully_shard({ast.unparse(child)}) on line "
                    f"{child_call.lineno}: the root must be sharded last, after its blocks",
                )


@rule(
    "FSDP003",
    "`.forward(...)` called directly on a sharded module, skipping FSDP2's all-gather hooks",
    "call the module itself: model(x)",
)
def _rule_forward(module: _Module) -> None:
    for scope in module.scopes:
        for call in scope.calls:
            func = call.func
            if not (isinstance(func, ast.Attribute) and func.attr == "forward"):
                continue
            receiver = func.value
            if isinstance(receiver, ast.Call) and _call_name(receiver) == "super":
                continue
            if module.is_sharded(scope.path(receiver)):
                module.report(
                    call,
                    f"{ast.unparse(receiver)}.forward(...) on a sharded module bypasses FSDP2's hooks, "
                    "so its parameters are never all-gathered",
                )


def _full_state_options(scope: _Scope, options: ast.expr | None, before: int, depth: int = 0) -> bool | None:
    """True/False if `options` visibly asks for full_state_dict=True or not; None when it cannot be told."""
    if options is None:
        return False
    if isinstance(options, ast.Call) and _call_name(options) == "StateDictOptions":
        return _is_true(_argument(options, 0, "full_state_dict"))
    if isinstance(options, ast.Name) and depth < 5:
        assigned = scope.latest(options.id, before)
        if assigned is not None and not assigned[1]:
            return _full_state_options(scope, assigned[0], before, depth + 1)
    return None


def _sharded_state_source(module: _Module, scope: _Scope, node: ast.AST, before: int, depth: int = 0) -> str | None:
    """Describe the sharded state dict inside `node` (directly or via a variable), or None."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Call):
            name = _call_name(inner)
            if name == "state_dict" and isinstance(inner.func, ast.Attribute):
                owner = scope.path(inner.func.value)
                if module.is_sharded(owner):
                    return f"{ast.unparse(inner.func.value)}.state_dict()"
            elif name in STATE_DICT_GETTERS and module.uses_fully_shard:
                qualname = module.call_qualname(inner) or ""
                if (
                    qualname.startswith("torch.distributed.")
                    and _full_state_options(scope, _argument(inner, 99, "options"), inner.lineno) is False
                ):
                    return f"{name}(...) without full_state_dict=True"
        elif isinstance(inner, ast.Name) and depth < 5 and inner.id not in module.imports:
            assigned = scope.latest(inner.id, before)
            if assigned is not None and not assigned[1]:
                found = _sharded_state_source(module, scope, assigned[0], before, depth + 1)
                if found:
                    return found
    return None


@rule(
    "FSDP004",
    "`torch.save` of a sharded model's `state_dict()` (each rank writes only its own DTensor shards)",
    "save with torch.distributed.checkpoint (dcp.save), or get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) and torch.save on rank 0",
)
def _rule_save_sharded(module: _Module) -> None:
    for scope in module.scopes:
        for call in scope.calls:
            if module.call_qualname(call) != "torch.save":
                continue
            saved = _argument(call, 0, "obj")
            source = _sharded_state_source(module, scope, saved, call.lineno) if saved is not None else None
            if source:
                module.report(
                    call,
                    f"torch.save of {source}: on a sharded model each rank writes only its own DTensor shards",
                )


@rule(
    "FSDP005",
    "`no_sync()` on an FSDP2 module (FSDP2 has no no_sync)",
    "call model.set_requires_gradient_sync(False) on accumulation steps and True on the last",
)
def _rule_no_sync(module: _Module) -> None:
    for scope in module.scopes:
        for call in scope.calls:
            if isinstance(call.func, ast.Attribute) and call.func.attr == "no_sync":
                if module.is_sharded(scope.path(call.func.value)):
                    module.report(
                        call,
                        f"{ast.unparse(call.func.value)}.no_sync() on a module sharded with fully_shard: "
                        "FSDP2 has no no_sync()",
                    )


def _is_meta(module: _Module, node: ast.expr | None) -> bool:
    """'meta' or torch.device('meta')."""
    if _is_constant(node, "meta"):
        return True
    return (
        isinstance(node, ast.Call)
        and module.call_qualname(node) == "torch.device"
        and bool(node.args)
        and _is_constant(node.args[0], "meta")
    )


def _meta_models(module: _Module, scope: _Scope) -> list[tuple[ast.AST, ast.Name]]:
    """(where, name) for every variable this scope builds on the meta device."""
    built: list[tuple[ast.AST, ast.Name]] = []
    for node in scope.nodes:
        if isinstance(node, ast.With | ast.AsyncWith):
            meta = any(
                _is_meta(module, item.context_expr)
                or (module.qualname(getattr(item.context_expr, "func", None)) or "").endswith("init_empty_weights")
                for item in node.items
            )
            if meta:
                for statement in ast.walk(node):
                    if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call):
                        built += [(statement, t) for t in statement.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            value = node.value
            # A class built with device="meta" (not a tensor factory), or module.to("meta").
            meta = (_call_name(value)[:1].isupper() and _is_meta(module, _argument(value, 99, "device"))) or (
                _call_name(value) == "to" and bool(value.args) and _is_meta(module, value.args[0])
            )
            if meta:
                built += [(node, t) for t in node.targets if isinstance(t, ast.Name)]
    return built


def _is_init_call(call: ast.Call) -> bool:
    name = _call_name(call)
    return name not in NOT_INIT_CALLS and bool(INIT_CALL.search(name))


def _caller_in_file(module: _Module, scope: _Scope) -> bool:
    """A function's result may be finished by its caller: only judge it when that caller is in this file."""
    return isinstance(scope.node, ast.Module) or getattr(scope.node, "name", None) in module.called_names


def _trained(module: _Module, scope: _Scope, name: str) -> bool:
    """`name` is sharded, called, or handed to an optimizer (through .parameters()) in this file."""
    for call in scope.calls:
        func = call.func
        if isinstance(func, ast.Name) and func.id == name:
            return True
        if isinstance(func, ast.Attribute) and func.attr == "parameters" and scope.path(func.value) == name:
            return True
    return module.is_sharded(name)


def _initialises(scope: _Scope, calls: list[ast.Call], owner: str) -> bool:
    """One of `calls` initialises or loads `owner`: an init-like call on it, or with it among the arguments."""
    for call in calls:
        if not _is_init_call(call):
            continue
        # The receiver, even wrapped (`cast(Model, model).init_weights()`), and the arguments.
        parts = [call.func.value] if isinstance(call.func, ast.Attribute) else []
        parts += [*call.args, *(kw.value for kw in call.keywords)]
        touched = [n for part in parts for n in ast.walk(part) if isinstance(n, ast.Name | ast.Attribute)]
        if any(_inside((scope.path(node) or "").replace("()", ""), owner) for node in touched):
            return True
    return False


def _callers_initialise(module: _Module, function: ast.AST) -> bool:
    """Every caller in this file that keeps the returned model (x = f(...)) initialises it afterwards."""
    name = getattr(function, "name", None)
    for scope in module.scopes:
        for node in scope.nodes:
            is_call = isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            if not (is_call and isinstance(node.value.func, ast.Name) and node.value.func.id == name):
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    later = [c for c in scope.calls if c.lineno > node.lineno]
                    if not _initialises(scope, later, target.id):
                        return False
    return True


@rule(
    "FSDP006",
    "model built on the `meta` device but never `to_empty`-ed, or `to_empty` with no initialisation after it",
    "after fully_shard call model.to_empty(device=...), then initialise every parameter and buffer "
    "(e.g. model.init_weights() or reset_parameters()) or load a checkpoint",
)
def _rule_meta_init(module: _Module) -> None:
    materialised = any(
        _call_name(c) == "to_empty" or (_call_name(c) == "load_state_dict" and _is_true(_argument(c, 99, "assign")))
        for c in module.calls
    )
    for scope in module.scopes:
        if not materialised:
            for where, name in _meta_models(module, scope):
                if not _trained(module, scope, name.id):
                    continue  # meta models that only describe shapes are fine
                if scope.returns(name.id) and not _caller_in_file(module, scope):
                    continue
                module.report(
                    where,
                    f"{name.id} is built on the meta device but nothing calls to_empty(): "
                    "its parameters have no storage",
                )
        for call in scope.calls:
            if _call_name(call) != "to_empty" or not isinstance(call.func, ast.Attribute):
                continue
            owner = (scope.path(call.func.value) or "").replace("()", "")
            later = [c for c in scope.calls if c.lineno > call.lineno or (c.lineno == call.lineno and c is not call)]
            if not owner or _initialises(scope, later, owner):
                continue
            if scope.returns(owner) and (not _caller_in_file(module, scope) or _callers_initialise(module, scope.node)):
                continue  # returned to a caller elsewhere, or to callers here that initialise it
            module.report(
                call,
                f"{ast.unparse(call.func.value)}.to_empty() leaves every parameter and buffer uninitialised "
                "(garbage memory) and nothing initialises them afterwards",
            )


@rule(
    "FSDP007",
    "`init_process_group` on CUDA without pinning the process to its GPU from `LOCAL_RANK`",
    "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group (or pass device_id=)",
)
def _rule_device_before_process_group(module: _Module) -> None:
    pins = [
        (scope, call)
        for scope in module.scopes
        for call in scope.calls
        # torch.cuda.set_device, torch.accelerator.set_device_index, or through a handle (torch.xpu, ...).
        if _call_name(call) in ("set_device", "set_device_index")
    ]
    global_pins = [(scope, pin) for scope, pin in pins if pin.args and _global_rank(module, scope, pin.args[0])]
    for _, pin in global_pins:
        module.report(
            pin,
            f"{ast.unparse(pin)} uses the global rank: on every node after the first it names a GPU "
            "that does not exist",
        )
    cuda_in_file = any("nccl" in s or s.startswith("cuda") for s in module.strings) or any(
        (module.call_qualname(c) or "").startswith("torch.cuda.") or _call_name(c) == "cuda" for c in module.calls
    )
    for scope in module.scopes:
        for call in scope.calls:
            if not _is(module.call_qualname(call), "init_process_group") or len(pins) > len(global_pins):
                continue
            if any(pin_scope is scope for pin_scope, _ in global_pins):
                continue  # reported at the set_device call
            world_size = _argument(call, 99, "world_size")
            if _argument(call, 99, "device_id") is not None or (
                isinstance(world_size, ast.Constant) and world_size.value == 1
            ):
                continue  # pinned, or a single process
            backend = _argument(call, 0, "backend")
            if isinstance(backend, ast.Constant) and isinstance(backend.value, str):
                on_cuda = "nccl" in backend.value
            else:
                # No literal backend: the default (or a variable) means NCCL when the script uses CUDA.
                on_cuda = cuda_in_file
            if on_cuda:
                module.report(
                    call,
                    "init_process_group on CUDA without torch.cuda.set_device(LOCAL_RANK) first: "
                    "ranks can share GPU 0 and NCCL can hang",
                )


def _global_rank(module: _Module, scope: _Scope, node: ast.expr | None, depth: int = 0) -> bool:
    """True if `node` is visibly the global rank (dist.get_rank(), os.environ['RANK'])."""
    if node is None or depth > 5:
        return False
    if isinstance(node, ast.Call):
        if _is(module.call_qualname(node), "get_rank"):
            return True
        if _call_name(node) in ("int", "get", "getenv") and node.args:
            return _global_rank(module, scope, node.args[0], depth + 1)
        return False
    if isinstance(node, ast.Subscript):
        return _is_constant(node.slice, "RANK")
    if isinstance(node, ast.Constant):
        return node.value == "RANK"
    if isinstance(node, ast.Name):
        assigned = scope.latest(node.id, node.lineno)
        return assigned is not None and not assigned[1] and _global_rank(module, scope, assigned[0], depth + 1)
    return False


@rule(
    "FSDP008",
    "`torch.load` without `weights_only=True` (unpickling can run arbitrary code)",
    "pass weights_only=True",
)
def _rule_torch_load(module: _Module) -> None:
    for scope in module.scopes:
        for call in scope.calls:
            if module.call_qualname(call) == "torch.load" and not _is_true(_argument(call, 99, "weights_only")):
                module.report(call, "torch.load without weights_only=True can run arbitrary pickled code")


def _parameters(function: ast.AST) -> list[str]:
    """The parameter names of a function (none for a module or class body)."""
    arguments = getattr(function, "args", None)
    if not isinstance(arguments, ast.arguments):
        return []
    every = [*arguments.posonlyargs, *arguments.args, arguments.vararg, *arguments.kwonlyargs, arguments.kwarg]
    return [a.arg for a in every if a is not None]


def _constant(module: _Module, scope: _Scope, node: ast.expr | None, depth: int = 0) -> ast.expr | None:
    """The expression a name stands for, followed through plain assignments: `low = torch.bfloat16` makes
    `low` torch.bfloat16, in the function or (when the function does not bind it) at module level, and
    `getattr(torch, "bfloat16")` is torch.bfloat16. A name bound more than one way (a loop, a parameter,
    branches assigning different values, `with ... as`) is left as it is: the rules judge only what is sure."""
    if node is None or depth > 10:
        return node
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and module.qualname(node.args[0])
    ):
        return ast.Attribute(value=node.args[0], attr=node.args[1].value, ctx=ast.Load())
    if not isinstance(node, ast.Name) or node.id in module.imports:
        return node
    name = node.id
    stores = [n for n in scope.nodes if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]
    bound_here = bool(stores) or name in _parameters(scope.node)
    if not bound_here and scope is not module.scopes[0]:
        scope = module.scopes[0]  # a module-level name read inside a function: every module-level value counts
        stores = [n for n in scope.nodes if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]
        entries = scope.assignments.get(name, [])
    elif name in _parameters(scope.node):
        return node
    else:
        stores = [n for n in stores if n.lineno < node.lineno]
        entries = [e for e in scope.assignments.get(name, []) if e[0] < node.lineno]
    if not entries or len(entries) != len(stores) or any(is_loop for _, _, is_loop in entries):
        return node
    values = [_constant(module, scope, value, depth + 1) for _, value, _ in entries]
    shown = {ast.dump(value) for value in values}
    return values[-1] if len(shown) == 1 else node


@rule(
    "FSDP009",
    "warning: `MixedPrecisionPolicy` reduces gradients in bf16/fp16 (lossy sum over ranks)",
    "reduce_dtype=torch.float32",
)
def _rule_reduce_dtype(module: _Module) -> None:
    for scope in module.scopes:
        for call in scope.calls:
            if not _is(module.call_qualname(call), "MixedPrecisionPolicy"):
                continue
            reduce_dtype = _argument(call, 1, "reduce_dtype")
            param_dtype = _argument(call, 0, "param_dtype")
            reduce_value = _constant(module, scope, reduce_dtype)
            param_value = _constant(module, scope, param_dtype)
            reduce_name = module.qualname(reduce_value) if reduce_value is not None else None
            param_name = module.qualname(param_value) if param_value is not None else None
            if reduce_name in LOSSY_DTYPES:
                shown = ast.unparse(reduce_dtype)
                dtype = ast.unparse(reduce_value)
                via = f" ({dtype})" if dtype != shown else ""
                module.report(
                    call,
                    f"warning: reduce_dtype={shown}{via} sums every rank's gradients in {dtype}: "
                    "lossy gradient reduction",
                )
            elif param_name in LOSSY_DTYPES and _is_constant_none(reduce_value):
                shown = ast.unparse(param_dtype)
                dtype = ast.unparse(param_value)
                via = f" ({dtype})" if dtype != shown else ""
                module.report(
                    call,
                    f"warning: no reduce_dtype, so gradients are reduced in param_dtype={shown}{via}: "
                    "lossy gradient reduction",
                )


def _is_constant_none(node: ast.expr | None) -> bool:
    """No value given, or a literal None."""
    return node is None or (isinstance(node, ast.Constant) and node.value is None)


RANK_NAME = re.compile(r"(^|_)rank$|^rank_?id$|^process_index$", re.IGNORECASE)
MAIN_RANK_NAME = re.compile(
    r"^(is_)?(local_|global_)?(main|master|leader|chief|rank_?0|rank_?zero)(_process|_rank|_worker)?$", re.IGNORECASE
)


def _last_name(node: ast.expr) -> str:
    """`self.rank` -> rank, `dist.get_rank()` -> get_rank."""
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _is_rank(module: _Module, node: ast.expr, depth: int = 0) -> bool:
    """`node` visibly is this process's rank: dist.get_rank(), int(os.environ["RANK"]), rank, self.local_rank."""
    if depth > 5:
        return False
    if isinstance(node, ast.Call):
        if _call_name(node) in ("get_rank", "get_local_rank", "get_node_local_rank"):
            return True
        return _call_name(node) in ("int", "get", "getenv") and bool(node.args) and _is_rank(module, node.args[0])
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) and "RANK" in node.slice.value
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.endswith("RANK")
    return isinstance(node, ast.Name | ast.Attribute) and bool(RANK_NAME.search(_last_name(node)))


def _rank_condition(module: _Module, test: ast.expr) -> tuple[str, bool] | None:
    """(condition, polarity) when `test` picks ranks: `rank == 0` and `is_main` are ("rank == 0", True),
    `dist.get_rank() != 0` and `rank > 0` ("rank == 0", False); None for any other test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _rank_condition(module, test.operand)
        return (inner[0], not inner[1]) if inner else None
    if isinstance(test, ast.BoolOp):
        picks = any(_rank_condition(module, value) for value in test.values)
        return (ast.unparse(test), True) if picks else None
    if isinstance(test, ast.Name | ast.Attribute | ast.Call) and MAIN_RANK_NAME.match(_last_name(test)):
        return ("rank == 0", True)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if _is_rank(module, right) and not _is_rank(module, left):
        left, right = right, left
        flipped = {ast.Lt: ast.Gt(), ast.Gt: ast.Lt(), ast.LtE: ast.GtE(), ast.GtE: ast.LtE()}
        op = flipped.get(type(op), op)
    if not _is_rank(module, left):
        return None
    shown = "None" if _is_constant_none(right) else ast.unparse(right)
    if isinstance(op, ast.Eq | ast.Is):
        return (f"rank == {shown}", True)
    if isinstance(op, ast.NotEq | ast.IsNot):
        return (f"rank == {shown}", False)
    # rank < 1 and rank <= 0 pick rank 0; rank > 0 and rank >= 1 the others.
    if (_is_constant(right, 1) and isinstance(op, ast.Lt)) or (_is_constant(right, 0) and isinstance(op, ast.LtE)):
        return ("rank == 0", True)
    if (_is_constant(right, 0) and isinstance(op, ast.Gt)) or (_is_constant(right, 1) and isinstance(op, ast.GtE)):
        return ("rank == 0", False)
    return (ast.unparse(test), True)


def _rank_conditions(module: _Module, scope: _Scope, node: ast.AST) -> set[tuple[str, bool]]:
    """The rank tests that decide whether `node` runs: (condition, polarity) of each enclosing `if` branch."""
    parents = scope.parents()
    conditions: set[tuple[str, bool]] = set()
    child, parent = node, parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.If | ast.IfExp) and child is not parent.test:
            condition = _rank_condition(module, parent.test)
            if condition:
                in_body = child in parent.body if isinstance(parent, ast.If) else child is parent.body
                conditions.add((condition[0], condition[1] if in_body else not condition[1]))
        child, parent = parent, parents.get(parent)
    return conditions


@rule(
    "FSDP010",
    "`destroy_process_group()` not preceded by a barrier (a peer may still be in a collective)",
    "call dist.barrier() right before destroy_process_group()",
)
def _rule_destroy_without_barrier(module: _Module) -> None:
    for scope in module.scopes:
        barriers = [c for c in scope.calls if _is(module.call_qualname(c), "barrier", "monitored_barrier")]
        picked = {id(barrier): _rank_conditions(module, scope, barrier) for barrier in barriers}
        every_rank = [
            barrier
            for barrier in barriers
            # Unconditional, or balanced by a barrier on the other ranks (`if rank == 0: ... else: dist.barrier()`
            # around a barrier, or the "main process first" `if rank != 0: barrier()` ... `if rank == 0: barrier()`).
            if not picked[id(barrier)]
            or any(
                (condition, not polarity) in picked[id(other)]
                for condition, polarity in picked[id(barrier)]
                for other in barriers
            )
        ]
        for call in scope.calls:
            if not _is(module.call_qualname(call), "destroy_process_group"):
                continue
            if any(barrier.lineno < call.lineno for barrier in every_rank):
                continue
            some_ranks = [barrier for barrier in barriers if barrier.lineno < call.lineno]
            if some_ranks:
                barrier = some_ranks[-1]
                condition, polarity = sorted(picked[id(barrier)])[0]
                shown = (
                    condition
                    if polarity
                    else condition.replace("==", "!=", 1)
                    if condition.startswith("rank ==")
                    else f"not ({condition})"
                )
                module.report(
                    call,
                    f"the barrier before destroy_process_group() (line {barrier.lineno}) runs only when {shown}: "
                    "the ranks that skip it never meet the ones waiting there, which hang",
                )
            else:
                module.report(
                    call,
                    "destroy_process_group() without a barrier before it: a rank can tear the group down "
                    "while a peer is still in a collective",
                )


def _is_float8_conversion(module: _Module, call: ast.Call) -> bool:
    qualname = module.call_qualname(call) or ""
    return qualname.startswith("torchao.") and qualname.endswith(".convert_to_float8_training")


@rule(
    "FSDP011",
    "torchao `convert_to_float8_training` applied to modules `fully_shard` has already sharded",
    "convert to float8 before fully_shard (and before checkpoint_wrapper / torch.compile)",
)
def _rule_float8_after_shard(module: _Module) -> None:
    # Functions of this file that convert their first argument (a helper such as convert_blocks_to_float8).
    converters = {
        scope.node.name
        for scope in module.scopes
        if isinstance(scope.node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(_is_float8_conversion(module, call) for call in scope.calls)
    }
    for scope in module.scopes:
        shards = [(c, scope.path(_argument(c, 0, "module"))) for c in scope.calls if module.is_fully_shard(c)]
        shards = [(c, p.replace("()", "")) for c, p in shards if p]
        for call in scope.calls:
            direct = _is_float8_conversion(module, call)
            if not direct and not (isinstance(call.func, ast.Name) and call.func.id in converters):
                continue
            target = _argument(call, 0, "module") if direct else (call.args[0] if call.args else None)
            converted = scope.path(target).replace("()", "") if target is not None and scope.path(target) else None
            earlier = [
                c for c, p in shards if c.lineno < call.lineno and (_inside(p, converted) or _inside(converted, p))
            ]
            if earlier:
                module.report(
                    call,
                    f"{_call_name(call)}({ast.unparse(target)}) after fully_shard on line {earlier[0].lineno}: the "
                    "Float8Linear modules it swaps in keep FSDP's sharded weights, which FSDP no longer gathers "
                    "for them (a crash mixing Tensor and DTensor)",
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


def _suppressed(source: str) -> dict[int, set[str] | None]:
    """Line -> codes silenced by `# fsdp2gen: noqa FSDPxxx` (None: every code) on that line."""
    suppressed: dict[int, set[str] | None] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return suppressed
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        match = NOQA.search(token.string)
        if match:
            codes = set(re.findall(r"FSDP\d{3}", match.group("codes").upper()))
            suppressed[token.start[0]] = codes or None
    return suppressed


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """Findings for one file's text, sorted, without the suppressed ones.

    Raises SyntaxError, and CheckInputError for code nested too deeply for Python's parser or for this
    checker (a 100,000-term `1 + 1 + ...` is a RecursionError in ast, a deep `- - - 1` a MemoryError).
    """
    too_deep = f"{path}: code nested too deeply to analyse (Python's %s limit); fix the file or exclude it"
    try:
        tree = ast.parse(source, filename=path)
    except MemoryError:
        # CPython's parser reports its own stack overflow (e.g. 100,000 unary minuses) as MemoryError.
        raise CheckInputError(too_deep % "parser stack") from None
    except RecursionError:
        raise CheckInputError(too_deep % "recursion") from None
    try:
        module = _Module(tree, path)
        for registered in RULES.values():
            module.checking = registered
            registered.check(module)
    except RecursionError:
        raise CheckInputError(too_deep % "recursion") from None
    # Tokenizing is the slowest step: only do it when there is something to suppress.
    suppressed = _suppressed(source) if module.findings and "noqa" in source else {}
    kept = {
        f
        for f in module.findings
        if f.line not in suppressed or (suppressed[f.line] is not None and f.code not in suppressed[f.line])
    }
    return sorted(kept)


def python_files(paths: Iterable[Path]) -> list[Path]:
    """The given files, and every *.py under the given folders (hidden folders and caches skipped)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            for found in sorted(path.rglob("*.py")):
                parts = found.relative_to(path).parts
                if not any(part.startswith(".") or part == "__pycache__" for part in parts):
                    files.append(found)
        elif path.exists():
            files.append(path)
        else:
            raise CheckInputError(f"{path}: no such file or folder; pass Python files or folders")
    return files


def check_paths(paths: Iterable[Path]) -> list[Finding]:
    """Check every file; the first unreadable, unparsable or too deeply nested one raises CheckInputError
    (nothing is reported)."""
    findings: list[Finding] = []
    for file in python_files(paths):
        try:
            # utf-8-sig: a UTF-8 byte order mark (some Windows editors write one) is valid Python source.
            source = file.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as error:
            raise CheckInputError(
                f"{file}: cannot read (not UTF-8 text, byte {error.start}); save it as UTF-8 or exclude it"
            ) from None
        except OSError as error:
            raise CheckInputError(f"{file}: cannot read ({error.strerror}); fix the file or exclude it") from None
        try:
            findings += check_source(source, str(file))
        except SyntaxError as error:
            where = f"{file}:{error.lineno}" if error.lineno else str(file)
            detail = "" if error.msg == "invalid syntax" else f" ({error.msg})"
            raise CheckInputError(f"{where}: invalid syntax{detail}; fix the file or exclude it") from None
    return findings


def format_text(findings: list[Finding]) -> str:
    """`path:line:col: CODE message; fix: hint`, one line each, like ruff."""
    lines = [f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}; fix: {f.fix}" for f in findings]
    if findings:
        files = len({f.path for f in findings})
        lines.append(f"Found {len(findings)} problem{'s' * (len(findings) != 1)} in {files} file{'s' * (files != 1)}.")
    return "\n".join(lines)


def format_json(findings: list[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], indent=2)
