"""The layers of docs/architecture.md import one way, downward; and nothing unpickles or evaluates data.

launch > patterns > session > parallel > worker > ps > wire > cluster. ``parallel``
(in-graph replicas, pipelines) drives a worker's devices; sessions plug it in. ``patterns`` (sweeps, ensembles,
cross-validation, broadcast, actor/learner) composes sessions and the wire, and sits below
``launch`` so that the launcher's CLI can register ``tensorfleet sweep``; a sweep whose trials
are clusters runs the ``tensorfleet launch`` command as a child process, not launch's code. Modules at the package top (errors,
environment, version, preemption_event, silence_clock, task_markers, task_memory, process_forks, and the facades __init__ / optim / __main__) are shared by all layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tensorfleet"
LAYERS = ["cluster", "wire", "ps", "worker", "parallel", "session", "patterns", "launch"]
SHARED = {
    "errors",
    "environment",
    "version",
    "preemption_event",
    "silence_clock",
    "task_markers",
    "task_memory",
    "process_forks",
}
#: Side packages that only the top layers may use (data for examples, not the runtime).
SIDE = {"datasets": 0}
#: Leaf packages that import nothing of tensorfleet but SHARED, each usable by the layers from
#: the one named upward (summaries: written by a session hook, plotted by the launch CLI).
LEAVES = {"summaries": "session"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "tensorfleet" and node.level == 0:
            names.extend(f"tensorfleet.{alias.name}" for alias in node.names)  # submodules
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n == "tensorfleet" or n.startswith("tensorfleet.")]


def _modules_in(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS + list(SIDE) + list(LEAVES))
def test_layer_imports_only_lower_layers(layer: str) -> None:
    allowed = set(LAYERS[: LAYERS.index(layer) + 1]) if layer in LAYERS else {layer}
    if layer in LAYERS:
        allowed |= {
            leaf for leaf, lowest in LEAVES.items() if LAYERS.index(layer) >= LAYERS.index(lowest)
        }
    offenders = []
    for path in _modules_in(layer):
        for name in _imports(path):
            parts = name.split(".")
            if len(parts) == 1:
                offenders.append(
                    f"{path.name}: imports the facade 'tensorfleet' (import from the module instead)"
                )
                continue
            target = parts[1]
            if target in SHARED or target in allowed:
                continue
            offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "imports against the layering of docs/architecture.md:\n" + "\n".join(
        offenders
    )


def test_every_module_belongs_to_a_layer() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= SHARED | {"__init__", "__main__", "optim"}, (
        f"unexpected top-level modules: {sorted(top - SHARED)}"
    )
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert packages == set(LAYERS) | set(SIDE) | set(LEAVES)


FORBIDDEN_CALLS = {"eval", "exec"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}


def test_no_code_from_data() -> None:
    """No pickle, marshal, eval or exec anywhere in the package; torch.load only with weights_only=True."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(
                a.name.split(".")[0] in FORBIDDEN_MODULES for a in node.names
            ):
                offenders.append(f"{path.name}:{node.lineno} imports a pickle-like module")
            elif (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] in FORBIDDEN_MODULES
            ):
                offenders.append(f"{path.name}:{node.lineno} imports a pickle-like module")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                    offenders.append(f"{path.name}:{node.lineno} calls {func.id}()")
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr == "load"
                    and getattr(func.value, "id", "") == "torch"
                ):
                    safe = any(
                        k.arg == "weights_only" and getattr(k.value, "value", None) is True
                        for k in node.keywords
                    )
                    if not safe:
                        offenders.append(
                            f"{path.name}:{node.lineno} calls torch.load without weights_only=True"
                        )
    assert not offenders, "\n".join(offenders)
