"""Reading a pattern's configuration file: YAML or JSON, a map of settings at the top.

``tensorfleet sweep CONFIG`` and ``tensorfleet pbt CONFIG`` read their files the same way:
YAML by the ``.yaml``/``.yml`` suffix (PyYAML, imported only then), JSON otherwise, and a
file that cannot be read, does not parse or does not hold a map is refused naming the file
and what to do. What the settings mean is each pattern's own (``sweep_config.py``,
``pbt_config.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_settings(
    path: Path, error: type[Exception], what: str, yaml_install: str
) -> dict[str, Any]:
    """The map of settings in ``path``; ``error`` (naming the file) when it cannot be read or
    parsed or holds something else. ``what`` names the file in the message (e.g. ``"sweep
    config"``); ``yaml_install`` is the command that installs PyYAML for it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise error(
                f"{path} is YAML, which needs PyYAML: {yaml_install} (or write the config as JSON)"
            ) from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise error(f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a map of settings, got {type(raw).__name__}")
    return raw
