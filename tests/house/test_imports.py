"""kvlib's imports flow one way: from the command line down to the engine's leaves, never up, never in a cycle.

Every module has a layer; a module may import only modules of its own layer or below, and no two modules import each
other, directly or through others. Every import counts: one hidden in a function is still a dependency, and so is one
for type checkers only (under `if TYPE_CHECKING:`): a type named from a layer above is an arrow back up, and one
that closes a cycle is a circle a reader must hold in mind. A new module needs a layer here: the test fails until it
has one.
"""

import ast
from pathlib import Path

import kvlib

# lowest first; a module's layer is the entry of its longest matching prefix (a package: every module inside it)
LAYERS = [
    ["kvlib.errors", "kvlib.paths", "kvlib.settings"],          # leaves: errors, where things live, settings
    ["kvlib.hardware"],                                         # machines' specs as data, each figure with its source
    ["kvlib.memory"],                                           # the ledger, the block pool, the timers, work counts
    ["kvlib.kernels"],                                          # attention paths and the C kernels
    ["kvlib.models"],                                           # loading, kvlib's forward, random weights, prompts,
                                                                # what a pass carries (models.passes: Step, a
                                                                # recorded pass), read by policies and the engine
    ["kvlib.policies"],                                         # KV-cache policies (one file each)
    ["kvlib.engine"],                                           # the engine, its scheduler, run results, capacity
    ["kvlib.backends", "kvlib.evaluation"],                     # outside engines; lm-eval and retention on the engine
    ["kvlib.projection"],                                       # bounds and GPU estimates from counted work, of
                                                                # every runner (an outside engine's among them)
    ["kvlib.report"],                                           # tables, findings, figures, the chooser: pure
                                                                # functions of results frames, below the study
    ["kvlib.study"],                                            # profiles, points, executors, results, the book build
    ["kvlib.commands"],                                         # the subcommands, one module each: arguments, action
    ["kvlib.cli", "kvlib.__main__", "kvlib"],                   # the command line (and the package itself)
]


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} has no layer in tests/house/test_imports.py: give it one"
    return best[1]


def kvlib_imports() -> dict[str, set[str]]:
    root = Path(kvlib.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        modules[name] = found
    # keep only imports of kvlib modules (from x import y: y when it is a module, else x)
    return {m: {i for i in imports if i in modules and i != m} for m, imports in modules.items()}


def test_no_module_imports_upward():
    upward = [f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)})"
              for m, imports in kvlib_imports().items() for i in imports
              if layer_of(i) > layer_of(m) and i != "kvlib"]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = kvlib_imports()
    for package in [m for m in graph if (Path(kvlib.__file__).parent.parent / m.replace(".", "/")).is_dir()]:
        graph[package] = set()  # a package's __init__ re-exporting its modules is not a cycle with them
    state: dict[str, int] = {}
    cycles = []

    def visit(module, path):
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{module} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_top_level_holds_only_the_command_line_settings_errors_and_paths():
    root = Path(kvlib.__file__).parent
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py", "errors.py",
                                                         "paths.py", "settings.py"]
