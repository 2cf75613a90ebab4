"""Code that cites docs/design.md names a section that exists there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"""docs/design\.md,\s+(?:#\s*)?(?:"([^"]+)"|'([^']+)')""")


def _headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no '#' comments in code
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_design_citations_name_sections() -> None:
    sections = {s.lower() for s in _headings(ROOT / "docs" / "design.md")}
    cited: dict[str, list[str]] = {}
    for folder in ("src", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for double, single in CITATION.findall(path.read_text()):
                cited.setdefault(double or single, []).append(str(path.relative_to(ROOT)))
    assert cited, "no citations found: has the citation style changed?"
    missing = {name: files for name, files in cited.items() if name.lower() not in sections}
    assert not missing, f"docs/design.md has no section named: {missing}"
