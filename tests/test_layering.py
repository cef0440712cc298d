"""The folders of ``src/logprobe`` are floors: a module imports only from its own floor or floors
below it (``docs/architecture.md`` gives the order and says what each floor holds).

Every import is scanned, function-local ones included. A function-local import is allowed only
for a third-party package that is optional or slow to import (``ALLOWED_DEFERRED``); the
project's own modules are imported at the top of the file, so no import can hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "logprobe"

# Lowest first. Modules at the package root are named by file ("config", "scorer", ...).
FLOORS: list[tuple[str, ...]] = [
    ("errors", "config", "io"),
    ("parallel",),
    ("kernels",),
    ("layers",),
    ("models",),
    ("loading", "tokenizer"),
    ("engine",),
    ("executor",),
    ("interp", "scoring"),
    ("jobs",),
    ("scorer", "report"),
    ("__init__", "integrations", "ray"),
    ("cli", "server"),
]

# Third-party packages that may be imported inside a function: optional extras, GPU-only
# packages and heavy imports kept off ``import logprobe``'s path.
ALLOWED_DEFERRED = {
    "triton", "pyarrow", "ray", "datasets", "lm_eval", "trl", "verl", "openrlhf", "torchrl",
    "transformers", "gguf", "huggingface_hub", "safetensors", "tokenizers", "compressed_tensors",
    "fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "numpy", "tqdm",
    "liger_kernel", "flash_attn", "fla", "jinja2", "pandas", "requests", "multiprocessing",
    "torch", "uvloop", "playwright", "openai", "tensordict", "PIL",
}


def floor_of(unit: str) -> int:
    for i, names in enumerate(FLOORS):
        if unit in names:
            return i
    raise AssertionError(f"{unit!r} is on no floor: add it to FLOORS and to docs/architecture.md")


def unit_of(parts: list[str]) -> str:
    """The floor unit of a module path relative to the package: its folder, or its file stem
    (a name imported from the package root that is no module is the root's ``__init__``)."""
    if (SRC / parts[0]).is_dir() or (SRC / f"{parts[0]}.py").exists():
        return parts[0]
    return "__init__"


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported logprobe unit or third-party top-level name prefixed '!', inside a function)."""
    rel = path.relative_to(SRC).with_suffix("").parts
    pkg = list(rel[:-1]) if rel[-1] != "__init__" else list(rel[:-1])
    tree = ast.parse(path.read_text())
    local_lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if isinstance(n, (ast.Import, ast.ImportFrom)):
                    local_lines.add(id(n))
    out = []
    for n in ast.walk(tree):
        local = id(n) in local_lines
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg[: len(pkg) - (n.level - 1)]
                target = base + (n.module.split(".") if n.module else [])
                if not target:  # "from . import x" at the package root
                    target = [n.names[0].name]
                out.append((n.lineno, unit_of(target), local))
            elif n.module and n.module.split(".")[0] == "logprobe":
                parts = n.module.split(".")[1:] or [n.names[0].name]
                out.append((n.lineno, unit_of(parts), local))
            elif n.module:
                out.append((n.lineno, "!" + n.module.split(".")[0], local))
        elif isinstance(n, ast.Import):
            for a in n.names:
                parts = a.name.split(".")
                if parts[0] == "logprobe":
                    out.append((n.lineno, unit_of(parts[1:] or ["__init__"]), local))
                else:
                    out.append((n.lineno, "!" + parts[0], local))
    return out


def test_every_module_imports_only_its_floor_or_below():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("").parts
        me = floor_of(unit_of(list(rel)))
        for line, unit, local in imports(path):
            if unit.startswith("!"):
                if local and unit[1:] not in ALLOWED_DEFERRED:
                    wrong.append(f"{path.relative_to(SRC)}:{line} imports {unit[1:]} inside a function")
                continue
            if local:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {unit} inside a function: import it at "
                             "the top (a deferred import of the project's own code only hides a cycle)")
            if floor_of(unit) > me:
                wrong.append(f"{path.relative_to(SRC)}:{line} imports {unit} (floor {floor_of(unit)}) "
                             f"from floor {me}")
    assert not wrong, "\n".join(wrong)


def test_the_scanner_sees_upward_and_deferred_imports(tmp_path):
    """The scan itself: a function-local upward import is found, a relative one resolved."""
    pkg = tmp_path / "layers"
    for d in ("layers", "kernels", "scoring"):
        (tmp_path / d).mkdir()
    f = pkg / "x.py"
    f.write_text("from ..kernels import a\n\ndef g():\n    from ..scoring.sequences import b\n    import ray\n")
    global SRC
    old, SRC = SRC, tmp_path
    try:
        got = imports(f)
    finally:
        SRC = old
    assert got == [(1, "kernels", False), (4, "scoring", True), (5, "!ray", True)]


def test_docs_architecture_lists_every_floor():
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    for names in FLOORS:
        for name in names:
            if name != "__init__":
                assert f"`{name}" in text, f"docs/architecture.md does not name {name}"
