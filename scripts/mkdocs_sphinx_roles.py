"""MkDocs hook: Sphinx cross-reference roles in docstrings, rendered as code.

The package's docstrings name other objects the way Sphinx does, ``:class:`~tensorfleet.errors.Preempted```,
and mkdocstrings (which reads them as Markdown) printed the role as text before the code:
``:class:Preempted`` with the full dotted path, 96 times on the API reference. This hook
rewrites each such role in a page's HTML as the code alone, with Sphinx's meaning of ``~``
(the last component only: ``Preempted``), linked to the object's entry when the same page
documents it: under that path, or under the facade's name for it (``tensorfleet.Preempted``
for ``tensorfleet.errors.Preempted``: the names ``tensorfleet/__init__.py`` exports, read
from its ``_EXPORTS`` table without importing the package). Why a hook on the HTML and not a rewrite of the docstrings
into mkdocstrings' cross-references (``[Preempted][tensorfleet.errors.Preempted]``): most
of the objects named are internal and not on the site, and an unresolved cross-reference
fails the strict build, where Sphinx's roles read well in the source and in ``help()``.
"""

from __future__ import annotations

import ast
import html
import re
from functools import cache
from pathlib import Path

#: A role as mkdocstrings renders it: ``:class:<code>~a.b.C</code>``.
_ROLE_RE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>([^<]+)</code>"
)


@cache
def facade_exports() -> dict[str, str]:
    """The facade's ``name -> module`` table (``_EXPORTS`` in ``src/tensorfleet/__init__.py``)."""
    source = Path(__file__).resolve().parents[1] / "src" / "tensorfleet" / "__init__.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(node.value)
    return {}


def anchors_for(path: str) -> list[str]:
    """Where ``path`` (``a.b.C.member``) may be documented: itself, then the facade's name
    for it when the facade exports ``C`` from module ``a.b``."""
    parts = path.split(".")
    found = [path]
    for index in range(1, len(parts)):
        if facade_exports().get(parts[index]) == ".".join(parts[:index]):
            found.append(".".join(["tensorfleet", *parts[index:]]))
    return found


def short_name(target: str) -> tuple[str, str]:
    """``(path, shown)`` for a role's target as Sphinx reads it: ``~a.b.C`` shows ``C``, a
    leading ``.`` or ``!`` is dropped, ``a.b.C()`` keeps its parentheses when shown."""
    shown_short = target.startswith("~")
    path = target.lstrip("~.!")
    if shown_short:
        return path, path.rstrip("()").rpartition(".")[2] + ("()" if path.endswith("()") else "")
    return path, path


def on_page_content(content, page, config, files):
    def rewrite(match: re.Match[str]) -> str:
        path, shown = short_name(html.unescape(match.group(1)))
        code = f"<code>{html.escape(shown)}</code>"
        for anchor in anchors_for(path.rstrip("()")):
            if f'id="{anchor}"' in content:
                return f'<a href="#{html.escape(anchor)}">{code}</a>'
        return code

    return _ROLE_RE.sub(rewrite, content)
