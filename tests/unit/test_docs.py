"""The documentation agrees with the code: the README's config-keys table is the ``"tensorshard"`` block's
fields (keys, defaults, and each meaning the field's docstring), every relative link in README.md and
docs/ leads to a file, and to a heading of it, that exist, and docs/layout.md names every module. In-process, no
processes started."""

from __future__ import annotations

import json
import os
import re

import pytest

from ds_tensorshard.config import TensorShardConfig
from tests.helpers import ROOT

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
TABLE_HEADING = "### Config keys"


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_files() -> list[str]:
    return sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def config_keys_table() -> dict[str, tuple[str, str]]:
    """The README's config-keys table: key -> (default cell, meaning cell), backticks around key and default
    removed."""
    lines = read(README).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(TABLE_HEADING)]
    assert len(starts) == 1, f"README.md needs exactly one '{TABLE_HEADING}' heading, found {len(starts)}"
    i = starts[0] + 1
    while i < len(lines) and not lines[i].startswith("|"):
        i += 1
    table = []
    while i < len(lines) and lines[i].startswith("|"):
        table.append(lines[i])
        i += 1
    assert len(table) > 2, f"no table under '{TABLE_HEADING}' in README.md"
    header = [cell.strip() for cell in table[0].strip().strip("|").split("|")]
    assert header == ["key", "default", "meaning"], f"config-keys table header is {header}"
    rows: dict[str, tuple[str, str]] = {}
    for line in table[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"config-keys row does not have 3 cells: {line!r}"
        key, default, meaning = cells
        key = key.strip("`")
        assert key not in rows, f"key {key!r} appears twice in the README's config-keys table"
        rows[key] = (default.strip("`"), meaning)
    return rows


def json_spelling(value: object) -> str:
    """How the README spells a default: JSON, with a whole float written as an integer (1800, not 1800.0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return json.dumps(value)


def as_markdown(docstring: str) -> str:
    """A field docstring as a table cell: whitespace collapsed, ``double backticks`` written `single`."""
    return " ".join(docstring.split()).replace("``", "`")


def test_config_keys_table_has_exactly_the_config_fields():
    assert set(config_keys_table()) == set(TensorShardConfig.model_fields)


@pytest.mark.parametrize("key", sorted(TensorShardConfig.model_fields))
def test_config_keys_table_default_is_the_field_default(key):
    rows = config_keys_table()
    assert key in rows, f"README.md's config-keys table has no row for '{key}'"
    field = TensorShardConfig.model_fields[key]
    assert not field.is_required(), f"'tensorshard.{key}' has no default to document"
    assert rows[key][0] == json_spelling(field.default), (
        f"README.md gives '{key}' the default {rows[key][0]}; TensorShardConfig has {json_spelling(field.default)}"
    )


@pytest.mark.parametrize("key", sorted(TensorShardConfig.model_fields))
def test_config_keys_table_meaning_is_the_field_docstring(key):
    rows = config_keys_table()
    assert key in rows, f"README.md's config-keys table has no row for '{key}'"
    docstring = TensorShardConfig.model_fields[key].description
    assert docstring, (
        f"TensorShardConfig.{key} has no docstring (model_config needs use_attribute_docstrings=True, and the "
        "field a docstring right below it)"
    )
    assert rows[key][1] == as_markdown(docstring), (
        f"README.md's meaning of '{key}' differs from TensorShardConfig.{key}'s docstring; change both together\n"
        f"README:    {rows[key][1]}\ndocstring: {as_markdown(docstring)}"
    )


FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^()\s]+)\)")


def prose(text: str) -> str:
    """Markdown without its code blocks and code spans (where brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives a file's headings (code spans' text included): lower case, punctuation
    dropped, spaces as hyphens, a repeated heading numbered."""
    found: set[str] = set()
    for line in FENCE.sub("", read(path)).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            n = 0
            while (slug if n == 0 else f"{slug}-{n}") in found:
                n += 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def markdown_files() -> list[str]:
    return [README, *doc_files()]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_lead_to_existing_files_and_headings(path):
    broken = []
    for target in LINK.findall(prose(read(path))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(linked):
            broken.append(f"{target} (no file {os.path.relpath(linked, ROOT)})")
        elif anchor and linked.endswith(".md") and anchor not in anchors(linked):
            broken.append(f"{target} (no heading '#{anchor}' in {os.path.relpath(linked, ROOT)})")
    assert not broken, f"{os.path.relpath(path, ROOT)} has broken links: " + "; ".join(broken)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_each_docs_page_has_one_title_first(path):
    lines = prose(read(path)).splitlines()
    assert lines and lines[0].startswith("# "), f"{os.path.relpath(path, ROOT)} does not start with '# Title'"
    titles = [line for line in lines if line.startswith("# ")]
    assert len(titles) == 1, f"{os.path.relpath(path, ROOT)} has {len(titles)} '# ' titles"


def test_layout_page_names_every_module():
    """docs/layout.md's table names each module of the package (bench/ and examples/ as folders): a module
    added without a row fails here. A row naming several modules lists the later ones by file name."""
    layout = read(os.path.join(DOCS, "layout.md"))
    package = os.path.join(ROOT, "ds_tensorshard")
    missing = []
    for folder, _, files in os.walk(package):
        relative = os.path.relpath(folder, package)
        if relative.split(os.sep)[0] in ("bench", "examples", "__pycache__"):
            continue
        for name in files:
            if name.endswith(".py") and name != "__init__.py" and f"{name}`" not in layout:
                missing.append(os.path.normpath(os.path.join(relative, name)))
    assert not missing, f"docs/layout.md's table has no row for: {', '.join(sorted(missing))}"
