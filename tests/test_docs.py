"""Docs that are cited exist: code citations of docs/design.md and README sections, Markdown
links between the docs (anchors included), and design.md's contents line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"""docs/design\.md,\s+(?:#\s*)?(?:"([^"]+)"|'([^']+)')""")
README_CITATION = re.compile(r"""README(?:\.md)?,?\s+"([^"]+)\"""")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _headings(path: Path, levels: str = "1,6") -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no '#' comments in code
    return [m.group(1).strip() for m in re.finditer(rf"^#{{{levels}}} (.+)$", text, re.M)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _code_citations(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    cited: dict[str, list[str]] = {}
    for folder in ("src", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for groups in pattern.findall(path.read_text()):
                name = next(g for g in (groups if isinstance(groups, tuple) else (groups,)) if g)
                cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return cited


def test_design_citations_name_sections() -> None:
    sections = {s.lower() for s in _headings(ROOT / "docs" / "design.md")}
    cited = _code_citations(CITATION)
    assert cited, "no citations found: has the citation style changed?"
    missing = {name: files for name, files in cited.items() if name.lower() not in sections}
    assert not missing, f"docs/design.md has no section named: {missing}"


def test_readme_citations_name_sections() -> None:
    sections = {s.lower() for s in _headings(ROOT / "README.md")}
    cited = _code_citations(README_CITATION)
    assert cited, "no README citations found: has the citation style changed?"
    missing = {name: files for name, files in cited.items() if name.lower() not in sections}
    assert not missing, f"README.md has no section named: {missing}"


def test_links_between_docs_resolve() -> None:
    """Every relative link names a file that exists, and its anchor a heading of that file."""
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not ours to check
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in map(_slug, _headings(path)):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_design_contents_list_every_section() -> None:
    design = ROOT / "docs" / "design.md"
    contents = next(line for line in design.read_text().split("\n\n") if "Contents:" in line)
    listed = set(re.findall(r"\(#([^)]+)\)", contents))
    sections = {_slug(h) for h in _headings(design, "2,3")}
    assert sections <= listed, f"design.md's contents miss: {sorted(sections - listed)}"
