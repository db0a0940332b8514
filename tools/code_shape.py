"""The shape of flowrl's code at a git revision: how long the training loops are and where the large functions sit.

A refactor that claims to make the house cheaper to extend should show it in numbers a reader can rerun. For the
working tree or any revision this prints

- the lines and the conditionals (``if``, ``elif``, conditional expressions, ``while``, boolean operators) of each
  recipe's ``train``;
- the largest functions of ``flowrl/`` by lines;
- the line count of every module under ``flowrl/recipes/``.

    python -m tools.code_shape                      # the working tree
    python -m tools.code_shape --rev 7457f03^       # a revision (read with git show, nothing checked out)
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path


def sources(rev: str | None) -> dict[str, str]:
    """``{path: text}`` of every ``flowrl/**/*.py`` at ``rev`` (None: the working tree)."""
    if rev is None:
        return {str(p): p.read_text() for p in sorted(Path("flowrl").rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "flowrl"], check=True, capture_output=True,
                           text=True).stdout.split()
    return {name: subprocess.run(["git", "show", f"{rev}:{name}"], check=True, capture_output=True,
                                 text=True).stdout for name in names if name.endswith(".py")}


def conditionals(node: ast.AST) -> int:
    """Branch points inside ``node``: if/elif, conditional expressions, while loops and each boolean operator."""
    return sum(isinstance(n, (ast.If, ast.IfExp, ast.While)) + (len(n.values) - 1 if isinstance(n, ast.BoolOp) else 0)
               for n in ast.walk(node))


def functions(texts: dict[str, str]) -> list[tuple[int, int, str]]:
    """(lines, conditionals, 'path:qualified name') of every function and method."""
    out = []
    for path, text in texts.items():
        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    out.append((child.end_lineno - child.lineno + 1, conditionals(child), f"{path}:{name}"))
                    visit(child, name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
        visit(ast.parse(text), "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", help="a git revision (default: the working tree)")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest functions")
    args = parser.parse_args()
    texts = sources(args.rev)
    found = functions(texts)
    print(f"## {args.rev or 'working tree'}\n\n| recipe loop | lines | conditionals |\n|---|---|---|")
    for lines, branches, name in found:
        if name.startswith("flowrl/recipes/") and name.endswith(":train"):
            print(f"| {name} | {lines} | {branches} |")
    print(f"\n| the {args.top} largest functions | lines | conditionals |\n|---|---|---|")
    for lines, branches, name in sorted(found, reverse=True)[:args.top]:
        print(f"| {name} | {lines} | {branches} |")
    print("\n| flowrl/recipes module | lines |\n|---|---|")
    for path, text in texts.items():
        if path.startswith("flowrl/recipes/") and not path.endswith("__init__.py"):
            print(f"| {path} | {len(text.splitlines())} |")


if __name__ == "__main__":
    main()
