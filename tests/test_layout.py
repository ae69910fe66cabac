"""The layout docs/architecture.md promises: imports run one way, private torch APIs only in _torch_compat.py,
one module behind each public name."""

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardnorm"

# lower layers never import higher ones; the package root (the public door) sits above everything
LAYERS = [
    ("shardnorm._torch_compat", 0), ("shardnorm.settings", 0),
    ("shardnorm.kernels", 1), ("shardnorm.reference", 1), ("shardnorm.rows", 1), ("shardnorm.output_checks", 1),
    ("shardnorm.ops", 2),
    ("shardnorm.functional", 3), ("shardnorm.modules", 3), ("shardnorm.conversion", 3),
    ("shardnorm.norm_families", 3), ("shardnorm.output_recompute", 3),
    ("shardnorm.distributed", 4), ("shardnorm.fsdp", 4),
    # adapters are clients of the public API: they may import the package root, which never imports them
    ("shardnorm.integrations", 6),
    ("shardnorm", 6),
]
# (importer, imported): the explicit exceptions docs/architecture.md names
ALLOWED_UPWARD = {("shardnorm.functional", "shardnorm.distributed.dtensor")}

TORCH_INTERNALS = {"_current_graph_task_id", "_execution_engine", "_get_fsdp_state", "_fsdp_param_groups",
                   "_fsdp_param_group", "unsharded_accumulated_grad", "_unsharded_param", "_param_fqn",
                   "_run_policy", "_module_classes", "_module_classes_to_ignore",
                   "split_factor"}  # _StridedShard's


# private torch names read outside _torch_compat.py, and why each is there: (file under src/shardnorm, name)
JUSTIFIED_PRIVATE = {
    # the norm's forward reads its registered params from the dict: nn.Module.__getattr__ costs 1.5-3 us a call
    ("modules.py", "_parameters"),
    # "is there a registered Parameter / buffer" (attribute lookup would also answer for a property)
    ("norm_families.py", "_parameters"), ("norm_families.py", "_buffers"),
}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = ("shardnorm",) + path.relative_to(SRC).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), is_package, ast.parse(path.read_text())


def _torch_private_names() -> set[str]:
    """Private attribute names (one leading underscore) of the torch objects shardnorm touches: modules,
    tensors, parameters, meshes, DTensors, parallel styles, FSDP, autograd Functions, process groups."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    objects = (nn.Module, nn.Module(), nn.LayerNorm(2), torch.Tensor, torch.zeros(1), nn.Parameter(torch.zeros(1)),
               DeviceMesh, DTensor, ParallelStyle, FSDPModule, FullyShardedDataParallel, MixedPrecision,
               ModuleWrapPolicy, torch.autograd.Function, torch.autograd.Variable, dist.ProcessGroup,
               torch.optim.Optimizer)
    names = set()
    for obj in objects:
        names |= {n for n in (*dir(obj), *getattr(obj, "__dict__", {})) if n.startswith("_") and not n.startswith("__")}
    return names


def _defined_in(tree: ast.AST) -> set[str]:
    """Names a file defines itself (functions, and attributes it assigns on self): its own, not torch's."""
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            own.add(node.attr)
    return own


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _layer_of(module: str) -> int:
    for prefix, layer in LAYERS:  # most specific first: the root package only when nothing else matches
        if prefix != "shardnorm" and (module == prefix or module.startswith(prefix + ".")):
            return layer
    return 6


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def _imports(module: str, is_package: bool, tree: ast.AST):
    """The shardnorm modules `module` imports, anywhere in it (lazy imports too)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "shardnorm")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "shardnorm":
                continue
            for a in node.names:  # `from shardnorm import ops` imports the module shardnorm.ops
                yield f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base


def test_imports_run_one_way():
    upward = []
    for module, is_package, tree in _modules():
        if module == "shardnorm":
            continue
        for target in _imports(module, is_package, tree):
            if _layer_of(target) > _layer_of(module) and (module, target) not in ALLOWED_UPWARD:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against kernels -> ops -> modules/functional -> distributed -> integrations: " \
        + "; ".join(upward)


def _outside_torch_compat():
    """(path relative to SRC, parsed module) of every source file the torch-access scans read."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel != "_torch_compat.py":
            yield rel, ast.parse(path.read_text())


def _findings_in(source: str, scan, tmp_path, monkeypatch) -> str:
    """What `scan` (a test above) reports for a tree holding one file, bad.py, of `source`; fails if it passes."""
    bad = tmp_path / "shardnorm"
    bad.mkdir()
    (bad / "bad.py").write_text(source)
    monkeypatch.setitem(globals(), "SRC", bad)
    try:
        scan()
    except AssertionError as e:
        return str(e)
    raise AssertionError(f"{scan.__name__} found nothing in:\n{source}")


def test_private_torch_apis_only_in_torch_compat():
    """Outside _torch_compat.py, src/ reaches no `torch._*` / `._C` / private torch module, no known torch
    internal, and no private attribute of a torch object (by attribute or by name in a string), save the
    justified few; each finding names file:line."""
    private_names = _torch_private_names()
    found = []
    for rel, tree in _outside_torch_compat():
        own = _defined_in(tree)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                chain, parts = node, []
                while isinstance(chain, ast.Attribute):
                    parts.append(chain.attr)
                    chain = chain.value
                if isinstance(chain, ast.Name) and chain.id == "torch":
                    dotted = ".".join(["torch", *reversed(parts)])
                    if any(_is_private(p) for p in parts):
                        names.append(dotted)
                if node.attr == "_C":
                    names.append("._C")
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if node.attr in TORCH_INTERNALS or node.attr in private_names and not (on_self and node.attr in own):
                    names.append(f".{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    (node.value in private_names or node.value in TORCH_INTERNALS):
                names.append(repr(node.value))  # getattr(obj, "_private")
            elif isinstance(node, ast.keyword) and node.arg in TORCH_INTERNALS:
                names.append(f"{node.arg}=")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names += [node.module] if any(_is_private(p) for p in node.module.split(".")) else []
                names += [f"{node.module}.{a.name}" for a in node.names if _is_private(a.name)]
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names
                          if a.name.split(".")[0] == "torch" and any(_is_private(p) for p in a.name.split("."))]
            found += [f"{rel}:{node.lineno}: {n}" for n in dict.fromkeys(names)
                      if (rel, n.strip(".'\"")) not in JUSTIFIED_PRIVATE]
    assert not found, "private torch APIs outside shardnorm/_torch_compat.py:\n" + "\n".join(found)


def test_the_scan_sees_private_torch_access(tmp_path, monkeypatch):
    """The scan above flags each kind of access it looks for (a scan that sees nothing would always pass)."""
    message = _findings_in("import torch\n"
                           "a = torch._C._current_graph_task_id()\n"
                           "b = module._backward_hooks\n"
                           "c = getattr(param, '_post_accumulate_grad_hooks', None)\n"
                           "d = mesh._flatten('dp')\n"
                           "e = getattr(placement, 'split_factor', 1)\n"
                           "from torch.utils._python_dispatch import TorchDispatchMode\n",
                           test_private_torch_apis_only_in_torch_compat, tmp_path, monkeypatch)
    for expected in ("bad.py:2: torch._C._current_graph_task_id", "bad.py:2: ._C", "bad.py:3: ._backward_hooks",
                     "bad.py:4: '_post_accumulate_grad_hooks'", "bad.py:5: ._flatten",
                     "bad.py:6: 'split_factor'", "bad.py:7: torch.utils._python_dispatch"):
        assert expected in message, (expected, message)


def _name_checks(tree: ast.AST):
    """(line, compared with) of every `<expr>.__name__ ==` / `!=` / `in` / `not in` comparison in `tree`: a type
    told by its name (`type(t).__name__ == "DTensor"`) rather than by `_torch_compat`'s predicates."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = [o for o in operands if isinstance(o, ast.Attribute) and o.attr == "__name__"]
        if named and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            others = [o for o in operands if o not in named]
            yield node.lineno, ", ".join(ast.unparse(o) for o in others)


def test_type_name_checks_only_in_torch_compat():
    """DTensors, pending collectives and placements are told apart by `_torch_compat`'s predicates (is_dtensor,
    is_pending_collective, is_block_shard), not by comparing a class's name elsewhere; each finding names
    file:line."""
    found = [f"{rel}:{line}: __name__ compared with {what}"
             for rel, tree in _outside_torch_compat() for line, what in _name_checks(tree)]
    assert not found, "type checks by class name outside shardnorm/_torch_compat.py:\n" + "\n".join(found)


def test_the_scan_sees_type_name_checks(tmp_path, monkeypatch):
    message = _findings_in("PENDING = 'AsyncCollectiveTensor'\n"
                           "a = type(t).__name__ == 'DTensor'\n"
                           "b = type(t).__name__ != PENDING\n"
                           "c = any(k.__name__ == 'DTensor' for k in type(p).__mro__)\n"
                           "d = type(t).__name__ in ('DTensor', 'Tensor')\n"
                           "ok = 'norm' in type(m).__name__.lower() or f(type(m).__name__)\n",
                           test_type_name_checks_only_in_torch_compat, tmp_path, monkeypatch)
    for expected in ("bad.py:2: __name__ compared with 'DTensor'", "bad.py:3: __name__ compared with PENDING",
                     "bad.py:4: __name__ compared with 'DTensor'", "bad.py:5: __name__ compared with ('DTensor', "):
        assert expected in message, (expected, message)
    assert "bad.py:6" not in message  # a name read for a message or a heuristic on the user's classes


def test_one_module_behind_each_public_name():
    """One path per public name: `shardnorm.fsdp` (nothing under distributed/), `shardnorm.convert` the
    function with its module at `shardnorm.conversion`, one accumulation context, the DeepSpeed adapter
    beside the other integrations; no package exports a name that is also one of its modules."""
    import shardnorm
    from shardnorm.distributed import accumulation

    fsdp = importlib.import_module("shardnorm.fsdp")
    assert shardnorm.fsdp is fsdp
    for name in ("shard_model", "save", "load", "auto_wrap_policy", "pending_grads", "install_norm_grad_reducer"):
        assert callable(getattr(fsdp, name)), name
    assert not _is_module("shardnorm.distributed.fsdp") and not _is_module("shardnorm.deepspeed")
    assert not hasattr(fsdp, "no_sync")
    conversion = importlib.import_module("shardnorm.conversion")
    assert shardnorm.convert is conversion.convert and shardnorm.conversion is conversion
    assert shardnorm.conversion.wrappers_of is conversion.wrappers_of
    assert shardnorm.accumulate is accumulation.accumulate and shardnorm.finalize_grads is accumulation.finalize_grads
    assert not hasattr(shardnorm.distributed, "accumulate") and not hasattr(shardnorm.distributed, "finalize_grads")
    deepspeed = importlib.import_module("shardnorm.integrations.deepspeed")
    assert callable(deepspeed.initialize) and callable(deepspeed.apply)
    for package in ("shardnorm", "shardnorm.distributed", "shardnorm.integrations"):
        module = importlib.import_module(package)
        shadowed = [n for n in getattr(module, "__all__", ()) if _is_module(f"{package}.{n}")]
        assert not shadowed, f"{package} exports {shadowed}, which are also its modules' names"
