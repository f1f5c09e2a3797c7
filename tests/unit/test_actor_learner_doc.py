"""docs/patterns.md, Actor/learner: the signatures it gives are the classes' own (keyword-only
parameters after ``*``, with their defaults), and its example runs as written."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfleet.patterns.actor_learner import ActorClient, SampleQueueServer, TensorSpec

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def section() -> str:
    """The text of the Actor/learner section, up to the next ``## `` heading."""
    text = (ROOT / "docs" / "patterns.md").read_text()
    start = text.index("\n## Actor/learner\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def plain_signature(cls: type) -> str:
    """``Name(a, b, *, c=4)``: the constructor's parameters without their annotations."""
    signature = inspect.signature(cls)
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]  # fmt: skip
    plain = signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)
    return f"{cls.__name__}{plain}"


@pytest.mark.parametrize("cls", [SampleQueueServer, ActorClient, TensorSpec])
def test_the_doc_gives_the_real_signature(cls):
    documented = re.findall(rf"`({cls.__name__}\([^`]*\))`", section())
    assert plain_signature(cls) in documented, (plain_signature(cls), documented)


def test_the_docs_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", section(), flags=re.DOTALL)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "actor-0 0 16\n"
