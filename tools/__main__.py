"""`python -m tools`: the command lines, one line each (the first line of each tool's docstring; nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commands() -> list[tuple[str, str]]:
    """(module, first docstring line) of every tool with a ``main()``, sorted by name."""
    out = []
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if path.stem.startswith("_") or not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        out.append((f"tools.{path.stem}", doc[0] if doc else ""))
    return out


def main() -> None:
    found = commands()
    width = max(len(name) for name, _ in found)
    print("python -m tools.NAME --help for the details of one:")
    for name, line in found:
        print(f"  python -m {name:<{width}}  {line}")


if __name__ == "__main__":
    main()
