"""Every error tensorfleet raises on purpose derives from ``TensorfleetError`` (and, where one
fits, the matching built-in), so that one ``except tfl.TensorfleetError`` catches whatever a
user can cause: this test fails on any ``raise ValueError(...)`` (or TypeError,
RuntimeError, Exception) in the package's source.

Scope: the whole package (``NOT_YET`` names packages exempted while they are converted: none).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tensorfleet.errors as errors

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tensorfleet"
BARE = {"ValueError", "TypeError", "RuntimeError", "Exception", "KeyError", "OSError"}
NOT_YET: set[str] = set()


def _checked_modules() -> list[Path]:
    return sorted(
        path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in NOT_YET
    )


def _bare_raises(path: Path, root: Path = PACKAGE) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and target.id in BARE:
            found.append(f"{path.relative_to(root)}:{node.lineno}: raise {target.id}")
    return found


def test_the_scan_finds_a_bare_raise(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x):\n    if x:\n        raise ValueError('x')\n    raise TypeError\n")
    assert sorted(_bare_raises(sample, tmp_path)) == [
        "sample.py:3: raise ValueError",
        "sample.py:4: raise TypeError",
    ]


def test_no_module_raises_a_bare_builtin_error() -> None:
    modules = _checked_modules()
    assert len(modules) > 30, "the scan found too few modules: is PACKAGE right?"
    offenders = [hit for path in modules for hit in _bare_raises(path)]
    assert not offenders, (
        "raise a tensorfleet.errors class (ConfigError for a bad value, ConfigTypeError for a "
        "wrong type, UsageError for a call out of order, ...) instead of:\n" + "\n".join(offenders)
    )


def test_every_error_class_derives_from_tensorfleet_error() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    # The one exit that is not an error: a preempted task ends its process with status 143
    # (a SystemExit, so that a broad `except Exception` in a training loop cannot swallow it).
    exits = [cls for cls in classes if issubclass(cls, SystemExit)]
    assert exits == [errors.Preempted], exits
    errors_proper = [cls for cls in classes if cls not in exits]
    assert all(issubclass(cls, errors.TensorfleetError) for cls in errors_proper), classes
    for cls, builtin in (
        (errors.ConfigError, ValueError),
        (errors.ConfigTypeError, TypeError),
        (errors.UsageError, RuntimeError),
        (errors.ClusterConfigError, ValueError),
        (errors.CheckpointMismatch, ValueError),
        (errors.DeadlineExceeded, TimeoutError),
    ):
        assert issubclass(cls, builtin), (cls, builtin)
