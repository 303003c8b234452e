"""The code's shape, checked from its syntax trees: the rules that keep every concern with one owner.

* no import circle among offload's modules, counting imports inside functions (a circle held together by
  function-level imports is still a circle: neither side can be read, tested or moved alone); imports under
  ``if TYPE_CHECKING:`` are annotations only and do not count;
* no file in offload/ or nvme_swapper/ over 750 lines, no class over 450;
* offload uses nvme_swapper through what its ``__init__`` exports, never its private modules;
* one place in offload/ constructs a ``SwapEngine`` (the NVMe owner every NVMe user is an instance of);
* persistence reads and writes an engine only through the state contract (``offload/_state.py``).

Each rule is a function of a source tree, so the tests below also show each one catching a violation.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_CLASS_LINES = 750, 450


def _modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every runtime import in ``tree``, relative ones resolved."""
    skipped = _type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [alias.name for alias in node.names]))
    return found


def import_graph(root: pathlib.Path, package: str = "offload") -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import sub`` names the submodule when one exists;
    a parent package is not counted as imported by its submodules' imports)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for target, names in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            deps.update(subs)
            if target in modules and len(subs) < len(names) or target in modules and not names:
                deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def oversized(root: pathlib.Path, packages: tuple[str, ...] = ("offload", "nvme_swapper")) -> list[str]:
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            rel = path.relative_to(root)
            if lines > MAX_FILE_LINES:
                out.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES})")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if length > MAX_CLASS_LINES:
                        out.append(f"{rel}:{node.lineno}: class {node.name} is {length} lines "
                                   f"(at most {MAX_CLASS_LINES})")
    return out


def private_swapper_imports(root: pathlib.Path) -> list[str]:
    out = []
    for name, path in _modules(root, "offload").items():
        for target, names in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            parts = target.split(".")
            private = [n for n in names if n.startswith("_")] if target == "nvme_swapper" else []
            if parts[0] == "nvme_swapper" and (any(p.startswith("_") for p in parts[1:]) or private):
                out.append(f"{path.relative_to(root)}: imports {target}{'.' + private[0] if private else ''}")
    return out


def swap_engine_constructions(root: pathlib.Path) -> list[str]:
    out = []
    for path in sorted((root / "offload").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id == "SwapEngine" or \
                        isinstance(f, ast.Attribute) and f.attr == "SwapEngine":
                    out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def contract_members(root: pathlib.Path) -> set[str]:
    tree = ast.parse((root / "offload" / "_state.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineState")
    members = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
    return members


def outside_contract(root: pathlib.Path) -> list[str]:
    """``engine.X`` in persistence (and ``gathered``) where X is not a member of ``EngineState``."""
    allowed = contract_members(root)
    files = sorted((root / "offload" / "persist").rglob("*.py")) + [root / "offload" / "engine" / "_gathered.py"]
    out = []
    for path in files:
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in ("engine", "target") and node.attr not in allowed and \
                    not node.attr.startswith("__"):
                if node.value.id == "target":
                    continue  # (a module or an engine: load_state_dict's target is checked by is_engine first)
                out.append(f"{path.relative_to(root)}:{node.lineno}: engine.{node.attr}")
    return out


# the rules on this tree -------------------------------------------------------------------------------------------


def test_no_import_circle_among_offload_modules():
    found = circles(import_graph(ROOT))
    assert not found, "import circles (imports inside functions count):\n" + "\n".join(
        " -> ".join(c) for c in found)


def test_no_file_or_class_over_its_size():
    assert not oversized(ROOT), "\n".join(oversized(ROOT))


def test_offload_imports_nvme_swapper_through_its_package_only():
    assert not private_swapper_imports(ROOT), "\n".join(private_swapper_imports(ROOT))


def test_one_place_in_offload_constructs_a_swap_engine():
    sites = swap_engine_constructions(ROOT)
    assert len(sites) == 1, f"SwapEngine constructed at {sites}: every NVMe user goes through the one owner"


def test_persistence_uses_the_engine_through_its_state_contract_only():
    assert (ROOT / "offload" / "persist").is_dir()
    assert not outside_contract(ROOT), "\n".join(outside_contract(ROOT))


def test_no_temporary_modules_are_left():
    left = [str(p.relative_to(ROOT)) for p in (ROOT / "offload").rglob("*.py") if "TEMPORARY" in p.read_text()]
    assert not left, left


# each rule catches what it is for --------------------------------------------------------------------------------


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    root = _tree(tmp_path, {
        "offload/__init__.py": "",
        "offload/a.py": "from . import b\n",
        "offload/b.py": "def f():\n    from .sub._c import x\n",
        "offload/sub/__init__.py": "",
        "offload/sub/_c.py": "from ..a import y\n",
    })
    assert circles(import_graph(root)) == [["offload.a", "offload.b", "offload.sub._c"]]


def test_imports_for_type_checking_only_make_no_circle(tmp_path):
    root = _tree(tmp_path, {
        "offload/__init__.py": "",
        "offload/a.py": "from .b import x\n",
        "offload/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n",
    })
    assert circles(import_graph(root)) == []


def test_sizes_private_imports_and_swap_engines_are_found(tmp_path):
    big_class = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    root = _tree(tmp_path, {
        "offload/__init__.py": "",
        "offload/a.py": "import nvme_swapper._engine\nfrom nvme_swapper import SwapEngine\n"
                        "s = SwapEngine(1)\nt = nvme_swapper.SwapEngine(2)\n",
        "offload/b.py": big_class,
        "nvme_swapper/__init__.py": "x = 1\n" * (MAX_FILE_LINES + 1),
    })
    assert private_swapper_imports(root) == ["offload/a.py: imports nvme_swapper._engine"]
    assert swap_engine_constructions(root) == ["offload/a.py:3", "offload/a.py:4"]
    assert [line.split(":")[0] for line in oversized(root)] == ["offload/b.py", "nvme_swapper/__init__.py"]


@pytest.mark.parametrize("use, found", [("engine.layout", []), ("engine._plan", ["engine._plan"])])
def test_persistence_reaching_past_the_contract_is_found(tmp_path, use, found):
    root = _tree(tmp_path, {
        "offload/_state.py": "class EngineState:\n    layout: int\n",
        "offload/persist/__init__.py": "",
        "offload/persist/_save.py": f"def save(engine):\n    return {use}\n",
    })
    assert [line.split(": ")[1] for line in outside_contract(root)] == found
