"""Where the code breaks the size rules of docs/ARCHITECTURE.md: modules over 500 lines, classes
over 300 lines or 8 constructor arguments, functions over 80 lines (an AST walk).

    python scripts/sizes.py            # guard/, trainer/, dashboards/
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOTS = ("guard", "trainer", "dashboards")
MODULE_LINES, CLASS_LINES, CTOR_ARGS, FUNC_LINES = 500, 300, 8, 80


def offenders(repo: Path) -> list[str]:
    out = []
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(repo)
            if (n := len(text.splitlines())) > MODULE_LINES:
                out.append(f"module   {rel}: {n} lines")
            for node in ast.walk(ast.parse(text)):
                span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef):
                    if span > CLASS_LINES:
                        out.append(f"class    {rel}:{node.name}: {span} lines")
                    for f in node.body:
                        if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                            n_args = len(f.args.args) - 1 + len(f.args.kwonlyargs)
                            if n_args > CTOR_ARGS:
                                out.append(f"ctor     {rel}:{node.name}: {n_args} arguments")
                elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and span > FUNC_LINES:
                    out.append(f"function {rel}:{node.name}: {span} lines")
    return out


if __name__ == "__main__":
    found = offenders(Path(__file__).resolve().parent.parent)
    print("\n".join(found) if found else "no offenders")
    sys.exit(0)
