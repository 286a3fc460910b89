"""The README and the guides in docs/ hold together: the README stays short, every relative link
and anchor in README.md and docs/*.md resolves, every guide is linked from the README, and the
configuration guide names every run config key (tests/test_config_keys.py's frozen list).

Anchors are GitHub's: a heading's text, lowercased, links reduced to their text, every character
that is not a letter, digit, '_', '-' or space dropped, spaces made '-', and '-1', '-2' ... added
to repeats. Does not check what the text says, nor links to the web."""

import os
import re
from typing import Dict, List, Set, Tuple

from tests.test_config_keys import KEYS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 300  # issue 49: a README a newcomer reads in ten minutes

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def markdown_files() -> List[str]:
    return [README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))


def prose_lines(path: str) -> List[Tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if _FENCE.match(line):
                fenced = not fenced
            elif not fenced:
                lines.append((number, line.rstrip("\n")))
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> Set[str]:
    seen: Dict[str, int] = {}
    for _, line in prose_lines(path):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                seen.setdefault(f"{base}-{count}", 1)
    return set(seen)


def links(path: str) -> List[Tuple[int, str]]:
    """(line number, target) of each relative link or image in `path`'s prose."""
    found = []
    for number, line in prose_lines(path):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            target = match.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                found.append((number, target))
    return found


def broken_links(paths: List[str]) -> List[str]:
    """Each relative link in `paths` whose file is missing, or whose anchor no heading there makes."""
    broken = []
    for path in paths:
        for number, target in links(path):
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            where = f"{os.path.relpath(path, ROOT)}:{number}: {target}"
            if not os.path.exists(resolved):
                broken.append(f"{where} (no file {os.path.relpath(resolved, ROOT)})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading makes #{anchor} in {os.path.relpath(resolved, ROOT)})")
    return broken


def test_slug_is_github_s():
    assert slug("Will it fit? The memory plan") == "will-it-fit-the-memory-plan"
    assert slug("Evaluating a checkpoint: `scripts/evaluate.py`") == \
        "evaluating-a-checkpoint-scriptsevaluatepy"
    assert slug("GPU check (scripts/gpu_check.sh), 2026-11-26") == "gpu-check-scriptsgpu_checksh-2026-11-26"
    assert slug("`algo` and [its guide](algorithms.md)") == "algo-and-its-guide"


def test_a_missing_file_or_anchor_is_named(tmp_path):
    (tmp_path / "b.md").write_text("# Title\n\n## Part\n\n## Part\n```\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#part-1) [ok](b.md#title) [gone](c.md) [no anchor](b.md#not-a-heading)\n"
                    "`[in code](c.md)` [self](#here)\n\n## Here\n\n```\n[fenced](c.md)\n```\n"
                    "[web](https://example.com/x.md)\n")
    broken = broken_links([str(page)])
    assert len(broken) == 2, broken
    assert "c.md (no file" in broken[0] and "#not-a-heading (no heading" in broken[1]


def test_the_readme_is_short():
    with open(README) as f:
        count = sum(1 for _ in f)
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines, over {README_MAX_LINES}: move the detail into a guide in docs/ "
        "and link it")


def test_every_relative_link_and_anchor_resolves():
    broken = broken_links(markdown_files())
    assert not broken, ("broken links (fix the path, or the anchor after a renamed heading):\n"
                        + "\n".join(broken))


def test_every_guide_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, target.partition("#")[0])) for _, target in links(README)}
    unlinked = [os.path.relpath(path, ROOT) for path in markdown_files()[1:] if path not in linked]
    assert not unlinked, f"guides the README does not link: {unlinked}; add each to its Guides table"


def test_the_configuration_guide_names_every_config_key():
    with open(os.path.join(DOCS, "configuration.md")) as f:
        named = set(re.findall(r"`([a-z_][\w.]*)`", f.read()))
    missing = [key for key in KEYS if key not in named]
    assert not missing, (f"docs/configuration.md does not name {missing}: add each to its section's table "
                         "(key, default, what it does)")
