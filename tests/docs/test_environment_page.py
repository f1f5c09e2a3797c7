"""docs/environment.md names every environment variable the package reads: each
``TENSORFLEET_*`` name in the package's source and each variable ``tensorfleet.environment``
defines (``*_VAR``), so that a new one cannot be added without its line on the page."""

from __future__ import annotations

import re
from pathlib import Path

from tensorfleet import environment

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environment.md"
#: Defined in tensorfleet.environment but not a setting: the user's home directory.
NOT_SETTINGS = {"HOME"}


def test_every_variable_the_package_reads_is_on_the_page() -> None:
    page = PAGE.read_text()
    in_source = {
        name
        for path in (ROOT / "src" / "tensorfleet").rglob("*.py")
        for name in re.findall(r"TENSORFLEET_[A-Z_]+[A-Z]", path.read_text())
    }
    defined = {
        value
        for name, value in vars(environment).items()
        if name.endswith("_VAR") and isinstance(value, str)
    } - NOT_SETTINGS
    missing = sorted(name for name in in_source | defined if f"`{name}`" not in page)
    assert not missing, f"docs/environment.md does not name {missing}"
    assert len(in_source) > 20  # the scan found the package's variables
