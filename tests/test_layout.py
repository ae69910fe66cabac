"""The layout ARCHITECTURE.md promises: imports run one way, private torch APIs only in _torch_compat.py,
one module behind each public name."""

import ast
import importlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardnorm"

# lower layers never import higher ones; the package root (the public door) sits above everything
LAYERS = [
    ("shardnorm._torch_compat", 0), ("shardnorm.settings", 0),
    ("shardnorm.kernels", 1), ("shardnorm.reference", 1),
    ("shardnorm.ops", 2), ("shardnorm.compile_fusion", 2),
    ("shardnorm.functional", 3), ("shardnorm.modules", 3), ("shardnorm.convert", 3), ("shardnorm.norm_families", 3),
    ("shardnorm.distributed", 4), ("shardnorm.fsdp", 4),
    ("shardnorm.deepspeed", 5),
    # adapters are clients of the public API: they may import the package root, which never imports them
    ("shardnorm.integrations", 6),
    ("shardnorm", 6),
]
# (importer, imported): the explicit exceptions ARCHITECTURE.md names
ALLOWED_UPWARD = {("shardnorm.functional", "shardnorm.distributed.dtensor")}

TORCH_INTERNALS = {"_current_graph_task_id", "_execution_engine", "_get_fsdp_state", "_fsdp_param_groups",
                   "_fsdp_param_group", "unsharded_accumulated_grad", "_unsharded_param", "_param_fqn",
                   "_run_policy", "_module_classes", "_module_classes_to_ignore", "pre_grad_custom_pass",
                   "post_grad_custom_post_pass", "custom_graph_pass"}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = ("shardnorm",) + path.relative_to(SRC).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), is_package, ast.parse(path.read_text())


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


def test_private_torch_apis_only_in_torch_compat():
    found = []
    for module, _, tree in _modules():
        if module == "shardnorm._torch_compat":
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
                chain = node
                while isinstance(chain, ast.Attribute):
                    chain = chain.value
                if isinstance(chain, ast.Name) and chain.id == "torch" and node.attr.startswith("_") \
                        and not node.attr.startswith("__"):
                    names.append(f"torch...{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg:
                names.append(node.arg)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names += [node.module] if any(p.startswith("_") for p in node.module.split(".")) else []
                names += [a.name for a in node.names if a.name.startswith("_")]
            found += [f"{module}: {n}" for n in names
                      if n in TORCH_INTERNALS or n.startswith("torch...") or n.startswith("torch.")
                      or (n.startswith("_") and isinstance(node, ast.ImportFrom))]
    assert not found, f"private torch APIs outside shardnorm/_torch_compat.py: {found}"


def test_one_module_behind_each_public_name():
    import shardnorm

    real = importlib.import_module("shardnorm.distributed.fsdp")
    assert shardnorm.fsdp is real and importlib.import_module("shardnorm.fsdp") is real
    for name in ("shard_model", "no_sync", "save", "load", "auto_wrap_policy", "pending_grads"):
        assert getattr(shardnorm.fsdp, name) is getattr(real, name), name
    assert shardnorm.accumulate is shardnorm.distributed.accumulate
    assert shardnorm.finalize_grads is shardnorm.distributed.finalize_grads
