"""The operator's guide's YAML is valid configuration; the docs' links point at what exists."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from prefixrouter.gateway.config import config_from_dict

ROOT = Path(__file__).parents[2]
GUIDE = ROOT / "docs" / "operators-guide.md"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# README sections other branches of this session add (issue 17's live dashboard,
# issue 16's Kubernetes section); the guide links them ahead of the merge.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```yaml\n(.*?)^ *```", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            title = m.group(1).strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_yaml_block_of_the_guide_is_a_valid_configuration() -> None:
    blocks = yaml_blocks(GUIDE.read_text(encoding="utf-8"))
    assert len(blocks) >= 4
    for block in blocks:
        data = yaml.safe_load(textwrap.dedent(block))
        config_from_dict(data, "docs/operators-guide.md")  # raises, naming the field


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: no heading #{anchor}"
