"""MkDocs hook: links from a page to files of the repository outside docs/.

The pages are also read on GitHub-like viewers, where ``[tables](../benchmarks/README.md)``
is a fine link; the site has no such file, and ``mkdocs build --strict`` would refuse it.
This hook checks that the target exists in the repository (a broken one still fails the
build) and writes it as the file's path in code, ``benchmarks/README.md``, after the link
text.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_LINK_RE = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"]).resolve()
    repository = docs_dir.parent
    page_dir = (docs_dir / page.file.src_path).parent

    def rewrite(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs_dir):
            return match.group(0)  # a page of the site: MkDocs checks it
        if not path.is_relative_to(repository) or not path.exists():
            raise PluginError(
                f"{page.file.src_path}: link to {target}, which is not in the repository"
            )
        return f"{text} (`{path.relative_to(repository)}` in the repository)"

    return _LINK_RE.sub(rewrite, markdown)
