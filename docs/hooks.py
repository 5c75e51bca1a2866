"""mkdocs hook: docs/config.md's reference tables, generated from the config classes at build time
(fedtune.config_reference), so the reference cannot drift from the code."""

from __future__ import annotations

MARK = "<!-- config-reference: generated at build time by docs/hooks.py -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - mkdocs' hook signature
    """Replace the mark in ``config.md`` with the generated reference."""
    if MARK not in markdown:
        return markdown
    from fedtune.config_reference import markdown as reference

    return markdown.replace(MARK, reference())
