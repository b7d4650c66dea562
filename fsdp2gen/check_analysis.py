"""`fsdp2gen check`'s model of one file, which every rule queries: the rule registry (`RULES`, `@rule`), the
file's imports and scopes (function bodies), the paths names bind, and call order across the helper functions a
function calls. Only Python's `ast`: no torch import, no code executed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rule:
    code: str
    catches: str  # one line for the README table
    fix: str
    check: Callable[[_Module], None] = field(compare=False, repr=False)


# Every rule, in code order: each check in check_rules.py and check_rules_pipeline.py registers itself with @rule,
# its one place.
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


def _parameters(function: ast.AST) -> list[str]:
    """The parameter names of a function (none for a module or class body)."""
    arguments = getattr(function, "args", None)
    if not isinstance(arguments, ast.arguments):
        return []
    every = [*arguments.posonlyargs, *arguments.args, arguments.vararg, *arguments.kwonlyargs, arguments.kwarg]
    return [a.arg for a in every if a is not None]


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
