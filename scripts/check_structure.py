"""The structure rules `make test` enforces on `src/tandem` (issue 60), by walking the source's AST.

- No import cycle among `tandem` modules. Every import statement counts: module level, inside
  `if TYPE_CHECKING:` and inside functions alike (a lazy import hides a cycle, it does not remove it).
- No module over ``MAX_MODULE_LINES`` lines and no function over ``MAX_FUNCTION_LINES`` lines.
- ``typing.Any`` in at most ``MAX_ANY_SIGNATURES`` function signatures (parameters or return).

Usage: ``python scripts/check_structure.py [--report]``; exits 1 and names every breach.
``--report`` prints the figures (modules, functions, signatures with ``Any``) even when clean.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "tandem"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_ANY_SIGNATURES = 95  # half of the 191 counted when the rule was set (issue 60)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    num_lines: int
    imports: set[str] = field(default_factory=set)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def load_modules() -> dict[str, Module]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        source = path.read_text()
        name = module_name(path)
        modules[name] = Module(name, path, ast.parse(source, str(path)), len(source.splitlines()))
    return modules


def resolve_imports(module: Module, known: set[str]) -> set[str]:
    """The `tandem` modules one module's import statements name (a submodule where one is named)."""
    is_package = module.path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.name.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {target for target in targets if target in known and target != module.name}


def find_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for target in sorted(modules[name].imports):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return cycles


def long_functions(module: Module) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            num_lines = (node.end_lineno or node.lineno) - start + 1
            if num_lines > MAX_FUNCTION_LINES:
                found.append((f"{module.path.relative_to(ROOT.parent)}:{node.lineno} {node.name}", num_lines))
    return found


def signatures(module: Module) -> tuple[int, list[str]]:
    """(number of function signatures, those whose annotations mention `Any`)."""
    num_signatures = 0
    with_any = []
    for node in ast.walk(module.tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        num_signatures += 1
        arguments = node.args
        annotations = [
            argument.annotation
            for argument in (
                arguments.posonlyargs
                + arguments.args
                + arguments.kwonlyargs
                + [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
            )
        ] + [node.returns]
        for annotation in annotations:
            if annotation is None:
                continue
            names = {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)}
            text = ast.unparse(annotation)
            if "Any" in names or "Any" in text.replace("'", " ").replace('"', " ").split():
                with_any.append(f"{module.path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
                break
            if isinstance(annotation, ast.Constant) and "Any" in str(annotation.value):
                with_any.append(f"{module.path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
                break
    return num_signatures, with_any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the figures even when clean")
    args = parser.parse_args()
    modules = load_modules()
    known = set(modules)
    for module in modules.values():
        module.imports = resolve_imports(module, known)
    problems = []
    for cycle in find_cycles(modules):
        problems.append("import cycle: " + " <-> ".join(cycle))
    for module in modules.values():
        if module.num_lines > MAX_MODULE_LINES:
            problems.append(
                f"module over {MAX_MODULE_LINES} lines: {module.path.relative_to(ROOT.parent)} ({module.num_lines})"
            )
    for module in modules.values():
        for where, num_lines in long_functions(module):
            problems.append(f"function over {MAX_FUNCTION_LINES} lines: {where} ({num_lines})")
    num_signatures = 0
    with_any: list[str] = []
    for module in modules.values():
        count, found = signatures(module)
        num_signatures += count
        with_any += found
    if len(with_any) > MAX_ANY_SIGNATURES:
        problems.append(f"`Any` in {len(with_any)} signatures (at most {MAX_ANY_SIGNATURES})")
    if args.report:
        print(f"{len(modules)} modules, {num_signatures} signatures, `Any` in {len(with_any)}")
        for where in with_any:
            print("  Any:", where)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
