"""`fsdp2gen check`'s rules FSDP001-011: sharding order, state dicts, meta-device init, process groups, dtypes,
float8. Each is one function registered with `@rule` (code, what it catches, the fix); check.py runs them.
"""

from __future__ import annotations

import ast
import re

from fsdp2gen.check_analysis import (
    _argument,
    _call_name,
    _inside,
    _is,
    _is_constant,
    _is_true,
    _Module,
    _order_events,
    _parameters,
    _Scope,
    rule,
)

LOSSY_DTYPES = {"torch.bfloat16", "torch.float16", "torch.half"}
STATE_DICT_GETTERS = {"get_model_state_dict", "get_state_dict"}
# Names of calls that initialise (or load) parameters after to_empty.
INIT_CALL = re.compile(
    r"init|reset_parameters|load|set_.*state_dict|apply|fill_|normal_|uniform_|zero_|copy_|constant_|ones_"
)
NOT_INIT_CALLS = {"init_process_group", "init_device_mesh", "__init__"}


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
