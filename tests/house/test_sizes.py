"""Every kvlib file within 300 lines of code and every function within 60 lines: a newcomer reads one module, one
function, at a time. Lines of code: non-blank lines that are not comments; a function's lines: from its `def` to its
last line, as `ast` counts them (its docstring and nested functions included)."""

import ast
from pathlib import Path

import kvlib

MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60

ROOT = Path(kvlib.__file__).parent


def lines_of_code(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def function_lengths(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method, nested ones included."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def sources() -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT.parent)), path.read_text()) for path in sorted(ROOT.rglob("*.py"))]


def test_the_counts_are_the_rule():
    text = '"""doc"""\n\n# a comment\nimport os\n\n\ndef f():\n    # why\n    return os.sep\n'
    assert lines_of_code(text) == 4  # the docstring, the import, the def, the return
    assert function_lengths(text) == [("f", 7, 3)]


def test_every_file_within_300_lines_of_code():
    over = [f"{name}: {lines_of_code(text)} lines of code" for name, text in sources()
            if lines_of_code(text) > MAX_FILE_LINES]
    assert not over, f"over {MAX_FILE_LINES} lines of code:\n" + "\n".join(over)


def test_every_function_within_60_lines():
    over = [f"{name}:{line} {function}: {length} lines" for name, text in sources()
            for function, line, length in function_lengths(text) if length > MAX_FUNCTION_LINES]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)
