"""bench/RESULTS.md opens with the current standing; the dated entries live in bench/history/,
where the bench scripts' ``--record`` appends (issue 30)."""

from __future__ import annotations

import os
import re
import time

from bench import bench_engine, bench_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "RESULTS.md")
HISTORY = os.path.join(REPO, "bench", "history")


def test_record_appends_to_the_months_history_file():
    month = time.strftime("%Y-%m", time.gmtime())
    want = os.path.join(HISTORY, f"{month}.md")
    assert bench_engine.RESULTS_MD == want  # also what bench_control, bench_reshard, bench_peers import
    assert bench_schedule.RESULTS_MD == want
    assert bench_engine.history_md(0.0) == os.path.join(HISTORY, "1970-01.md")


def test_results_opens_with_the_current_standing_and_links_every_history_file():
    with open(RESULTS) as f:
        text = f.read()
    headings = re.findall(r"^#+ .*$", text, re.M)
    assert headings[1] == "## Current standing"
    # one table per benchmark, each with the command that produced it
    sections = re.split(r"^### ", text, flags=re.M)[1:]
    assert len(sections) >= 8
    for sec in sections:
        assert "Command" in sec or "command" in sec, sec.splitlines()[0]
        assert "\n|---" in sec, sec.splitlines()[0]
    entries = sorted(os.listdir(HISTORY))
    files = [f for f in entries if re.fullmatch(r"\d{4}-\d{2}\.md", f)]
    # besides the months: the plots bench_goodput's --record embeds, each linked from its month
    plots = [f for f in entries if re.fullmatch(r"goodput-(\d{4})(\d{2})\d{2}-\d{4}\.png", f)]
    assert files and sorted(files + plots) == entries
    for png in plots:
        month = f"{png[8:12]}-{png[12:14]}.md"
        with open(os.path.join(HISTORY, month)) as f:
            assert f"]({png})" in f.read(), png
    # the notebook folder is linked; so is every month moved out of RESULTS.md (a month a later
    # --record starts is reachable through the folder until someone links it)
    assert "(history/)" in text
    for f in ("2026-11.md", "2026-12.md"):
        assert f in files and f"(history/{f})" in text
    # no dated run entry is left in RESULTS.md itself: they are history
    assert not re.search(r"^## (Run|bench-peers) \d{4}-", text, re.M)
