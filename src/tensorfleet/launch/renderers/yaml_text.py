"""Plain data (dicts, lists, strings, numbers, booleans) as YAML text, without PyYAML.

Manifests are read by people as well as by ``kubectl``, so ``tensorfleet k8s render``
writes YAML rather than JSON; this emitter keeps the package free of a YAML dependency. It
writes block style for mappings and lists of mappings, flow style (``[1, 2]``) for lists of
scalars, and every string as a JSON string: JSON's escapes are a subset of YAML's
double-quoted scalars, so the text reads back as exactly the same strings (``"no"``, ``"1"``
or ``"on"`` stay strings), whatever they hold.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfleet.errors import ConfigTypeError

#: Keys written bare: what Kubernetes field names and label keys look like.
_PLAIN_KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*")
#: Bare keys that YAML 1.1 readers would take for booleans or null.
_RESERVED = {"y", "yes", "n", "no", "true", "false", "on", "off", "null"}


def dump_documents(documents: Sequence[Mapping[str, Any]]) -> str:
    """The documents as one YAML stream, each starting with ``---``."""
    return "".join("---\n" + _block(document, 0) for document in documents)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise ConfigTypeError(f"cannot write {type(value).__name__} {value!r} as YAML")


def _key(key: str) -> str:
    if _PLAIN_KEY_RE.fullmatch(key) and key.lower() not in _RESERVED:
        return key
    return json.dumps(key)


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, (Mapping, list, tuple))


def _block(value: Mapping[str, Any], indent: int) -> str:
    """A mapping in block style, each line indented by ``indent`` spaces."""
    pad = " " * indent
    if not value:
        return pad + "{}\n"
    out = []
    for key, item in value.items():
        out.append(pad + _key(key) + ":" + _after_key(item, indent))
    return "".join(out)


def _after_key(item: Any, indent: int) -> str:
    """What follows ``key:``: a scalar on the same line, or a nested block."""
    if _is_scalar(item):
        return " " + _scalar(item) + "\n"
    if isinstance(item, Mapping):
        return " {}\n" if not item else "\n" + _block(item, indent + 2)
    if all(_is_scalar(element) for element in item):
        return " [" + ", ".join(_scalar(element) for element in item) + "]\n"
    return "\n" + _sequence(item, indent + 2)


def _sequence(items: Sequence[Any], indent: int) -> str:
    """A list in block style: one ``- `` item per element."""
    pad = " " * indent
    out = []
    for element in items:
        if isinstance(element, Mapping) and element:
            text = _block(element, indent + 2)
            out.append(pad + "- " + text[indent + 2 :])
        elif isinstance(element, Mapping):
            out.append(pad + "- {}\n")
        elif _is_scalar(element):
            out.append(pad + "- " + _scalar(element) + "\n")
        elif all(_is_scalar(inner) for inner in element):
            out.append(pad + "- [" + ", ".join(_scalar(inner) for inner in element) + "]\n")
        else:
            raise ConfigTypeError(
                "lists of lists of mappings are not written (manifests have none)"
            )
    return "".join(out)
