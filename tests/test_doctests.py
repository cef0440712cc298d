"""The worked examples in the package's docstrings are run: a contract written down with an
example (``>>>``) must stay true. ``# doctest: +SKIP`` marks the ones that need a model."""

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import logprobe

SRC = Path(logprobe.__file__).parent


def modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(SRC)], prefix="logprobe."):
        rel = info.name.removeprefix("logprobe.").replace(".", "/")
        path = SRC / (rel + "/__init__.py" if info.ispkg else rel + ".py")
        if path.is_file() and ">>>" in path.read_text(encoding="utf-8"):
            names.append(info.name)
    return names


MODULES = modules_with_examples()


def test_examples_are_found():
    assert len(MODULES) >= 20 and "logprobe.io.parquet" in MODULES and "logprobe.jobs.logprobs" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"
