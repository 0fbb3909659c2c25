"""Every exception the package raises at its users is one of ds_tensorshard.errors' types."""

from __future__ import annotations

import ast
import builtins
import inspect
import os

import ds_tensorshard
from ds_tensorshard import errors

PACKAGE = os.path.dirname(ds_tensorshard.__file__)
# AssertionError marks an internal invariant (code that cannot be reached), never a refusal of user input
BUILTIN_ERRORS = {
    name for name, value in vars(builtins).items() if inspect.isclass(value) and issubclass(value, Exception)
} - {"AssertionError"}
# examples are leaves the library never imports (their own checks are for their own runs)
LEAVES = (os.path.join(PACKAGE, "examples"),)


def raised_builtins() -> list[str]:
    found = []
    for folder, _, files in os.walk(PACKAGE):
        if folder.startswith(LEAVES):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                        func = node.exc.func
                        if isinstance(func, ast.Name) and func.id in BUILTIN_ERRORS:
                            found.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno} raises {func.id}")
    return found


def test_no_builtin_exception_is_raised_at_users():
    assert raised_builtins() == []


def test_every_error_type_is_exported_from_the_package():
    defined = {
        name for name, value in vars(errors).items() if inspect.isclass(value) and value.__module__ == errors.__name__
    }
    assert defined <= set(ds_tensorshard.__all__), defined - set(ds_tensorshard.__all__)
