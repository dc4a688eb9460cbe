"""The README is a newcomer's page (issue 30): at most 200 lines, the two commands CI relies on
(``.ci/run`` runs the README's test command), and every relative link in it and in docs/*.md
resolves to a file of the repository and, for ``file.md#anchor``, to a heading of that file."""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces → hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(path: str) -> list[str]:
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    return LINK.findall(text)


def test_readme_is_short_and_keeps_the_two_commands():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, len(lines)
    text = "\n".join(lines)
    assert re.search(r"^make demo\b", text, re.M) and re.search(r"^make test\b", text, re.M)
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert re.search(r"^make test$", f.read(), re.M)  # CI runs exactly the README's test command


def test_relative_links_resolve():
    pages = [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [
        os.path.join(REPO, "bench", "RESULTS.md")]
    bad = []
    for page in pages:
        for target in _links(page):
            if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not full.startswith(REPO + os.sep) and full != REPO:
                bad.append(f"{os.path.relpath(page, REPO)}: {target} leaves the repository")
            elif not os.path.exists(full):
                bad.append(f"{os.path.relpath(page, REPO)}: {target} does not exist")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                bad.append(f"{os.path.relpath(page, REPO)}: no heading #{anchor} in {os.path.relpath(full, REPO)}")
    assert bad == []


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {os.path.normpath(os.path.join(REPO, t.partition("#")[0])) for t in _links(README)}
    for page in glob.glob(os.path.join(REPO, "docs", "*.md")):
        assert page in linked, f"{os.path.relpath(page, REPO)} is not linked from README.md"


def test_readme_states_the_host_memory_of_replication():
    """The README says what replication and a restore cost in host memory (issue 29 case E.7),
    with the numbers the code uses: the receive buffers per transfer and the default chunk."""
    from tierckpt.config import TierConfig
    from tierckpt.transport.receive import RECV_BUFFERS

    with open(README) as f:
        text = " ".join(f.read().split())
    chunk_mib = TierConfig.__dataclass_fields__["transfer_chunk_bytes"].default >> 20
    assert f"holds {RECV_BUFFERS} × `transfer_chunk_bytes`" in text, "README: receive buffers per transfer"
    assert f"({RECV_BUFFERS * chunk_mib} MiB at the {chunk_mib} MiB default)" in text
    assert "released when each batch of transfers ends" in text
    assert "a restore stays within `restore_memory_bytes`" in text
