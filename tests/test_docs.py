"""The docs name only files that exist, and the benchmark page reports, it keeps no diary.

Every repo-relative path a page under ``docs/`` names in backticks, a fenced block or a link
target (``engine/block_pool.py``, ``kernels/cpu/decode_layer.cpp``, ``app/routes/*``) must exist,
as must every relative link (``img/bench/tenants.png``, ``admin.md#the-console``) and its anchor.
Only paths that open with one of the repository's top-level folders count, so URL paths
(``/v1/chat/completions``), runtime paths (``.saltserve/models/...``), dotted module names and
test ids (``tests/app/test_cli.py::test_x`` counts as its file) are left alone.

Plain text only: no imports of the project, no torch; the whole file runs in milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TOP_LEVEL = ("app", "engine", "kernels", "tenants", "tests", "benchmarks", "docs", "deploy",
             "scripts", "migrations")

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path opens with a top-level folder and a slash, not inside a longer word or path (so
# ``/admin/tenants`` or ``x/engine/...`` never starts one), and runs over path characters;
# ``::`` (a test id), ``#`` (an anchor), spaces and brackets end it.
_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./*-]*)")
# Diary markers a report must not carry: work periods, tracker numbers, dates of work.
_DIARY = re.compile(r"\bsessions?\s+\d+|\bissues?\s+#?\d+|\b20\d\d-\d\d-\d\d\b",
                    re.IGNORECASE)


def named_paths(markdown: str) -> list[str]:
    """Repo-relative paths named in backticks, fenced blocks and link targets, in order."""
    chunks = [m.group(0) for m in _FENCE.finditer(markdown)]
    prose = _FENCE.sub("", markdown)
    chunks += _SPAN.findall(prose) + _LINK.findall(prose)
    found = []
    for chunk in chunks:
        for path in _PATH.findall(chunk):
            path = path.rstrip(".,;:")
            if path not in found:
                found.append(path)
    return found


def missing_paths(markdown: str, root: Path = ROOT) -> list[str]:
    """The named paths (globs included: at least one match) that do not exist under ``root``."""
    missing = []
    for path in named_paths(markdown):
        exists = any(root.glob(path)) if "*" in path else (root / path).exists()
        if not exists:
            missing.append(path)
    return missing


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, punctuation dropped, spaces to dashes."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor (a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", _FENCE.sub("", markdown),
                         re.MULTILINE):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    """Relative link targets of ``doc`` whose file, or heading anchor, does not exist."""
    text = doc.read_text()
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        known = file.exists() and not (anchor and file.suffix == ".md"
                                       and anchor not in anchors(file.read_text()))
        if not known:
            broken.append(target)
    return broken


def diary_lines(markdown: str) -> list[str]:
    """Lines that read like a build diary: "Session 12", "issue 15", "2026-12-06"."""
    return [line for line in markdown.splitlines() if _DIARY.search(line)]


DOC_FILES = sorted(DOCS.glob("*.md"))


def test_the_docs_folder_has_pages():
    assert (DOCS / "architecture.md") in DOC_FILES and (DOCS / "benchmarks.md") in DOC_FILES


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_every_repo_path_a_doc_names_exists(doc):
    assert missing_paths(doc.read_text()) == [], f"{doc.name} names files that do not exist"


def test_the_architecture_module_map_names_real_modules():
    text = (DOCS / "architecture.md").read_text()
    named = named_paths(text)
    assert len(named) >= 60, "the module map should name the modules one line each"
    for expected in ("engine/block_pool.py", "app/routes/openai.py",
                     "kernels/cpu/decode_layer.cpp", "engine/protocol.py"):
        assert expected in named
    assert missing_paths(text) == []


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(doc):
    assert broken_links(doc) == []


def test_the_benchmark_page_is_a_report_not_a_diary():
    text = (DOCS / "benchmarks.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [h for h in headings if re.search(r"\bsession\s+\d", h, re.IGNORECASE)]
    assert diary_lines(text) == []


REPO = DOCS.parent
# Work periods and tracker numbers have no place anywhere in the project; dates of work are
# checked in the docs only (tests and migrations hold real dates as data).
_HISTORY = re.compile(r"\bsessions?\s+\d+|\bissues?\s+#?\d+|\bthis turn\b", re.IGNORECASE)
SOURCE_DIRS = ("app", "engine", "tenants", "kernels", "tests", "benchmarks", "scripts", "deploy",
               "migrations")


@pytest.mark.parametrize("doc", [*DOC_FILES, REPO / "README.md"], ids=lambda p: p.name)
def test_no_doc_reads_like_a_build_diary(doc):
    assert diary_lines(doc.read_text()) == []


def test_no_source_file_refers_to_the_history_of_its_construction():
    this = Path(__file__).resolve()
    found = []
    for folder in SOURCE_DIRS:
        for path in (REPO / folder).rglob("*"):
            if (path.suffix not in {".py", ".cpp", ".h", ".sh", ".toml", ".cfg", ".html", ".js"}
                    or "vendor" in path.parts or path.resolve() == this):
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if _HISTORY.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}")
    for name in ("pyproject.toml", "Makefile", ".ci/run"):
        for n, line in enumerate((REPO / name).read_text().splitlines(), 1):
            if _HISTORY.search(line):
                found.append(f"{name}:{n}: {line.strip()[:80]}")
    assert found == []


# The checks above can fail: each helper flags a fabricated page.

def test_a_missing_module_is_reported_and_real_ones_are_not():
    page = ("The pool is `engine/block_pool.py`; the map names `engine/no_such_module.py` and\n"
            "`kernels/cpu/missing_kernel.cpp (a kernel)`, links [it](../app/gone.py), and runs\n"
            "```bash\npython benchmarks/bench_nothing.py --flag\n```\n"
            "and `tests/app/test_cli.py::test_something` and `app/routes/*` (a glob).\n")
    assert missing_paths(page) == ["benchmarks/bench_nothing.py", "engine/no_such_module.py",
                                   "kernels/cpu/missing_kernel.cpp"]
    assert "engine/block_pool.py" in named_paths(page)
    assert "tests/app/test_cli.py" in named_paths(page)
    assert missing_paths("`app/routes/*.nothing`") == ["app/routes/*.nothing"]


def test_url_runtime_and_dotted_names_are_not_paths():
    page = ("`POST /v1/chat/completions`, `/admin/tenants/{id}/cache/reset`, "
            "`.saltserve/models/SmolLM2-135M-Instruct`, `~/llama-venv/bin/pip`, "
            "`engine.quantization.DENSE_FROM_TOKENS`, `<data_dir>/usage-journal/`, "
            "`$HOME/app/x.py`, `http://127.0.0.1:8000/app/x.py`, `saltserve tenants create`")
    assert named_paths(page) == []


def test_a_broken_link_or_anchor_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The console\n")
    doc = tmp_path / "page.md"
    doc.write_text("# Page\n\n[ok](other.md#the-console) [own](#page) [web](https://x.org/y)\n"
                   "[gone](missing.md) [bad anchor](other.md#no-such-heading) [own bad](#nope)\n")
    assert broken_links(doc) == ["missing.md", "other.md#no-such-heading", "#nope"]


def test_slugs_follow_github():
    assert slug("Prefix caching: cold against warm TTFT") == "prefix-caching-cold-against-warm-ttft"
    assert slug("Checking prefix caching on your own server: `saltserve bench`") == (
        "checking-prefix-caching-on-your-own-server-saltserve-bench")
    assert anchors("# A\n## A\n") == {"a", "a-1"}


def test_diary_headings_and_markers_are_caught():
    page = ("# Benchmarks\n## Session 12 (2026-12-02): fused layers\n### session 3\n"
            "Against issue 15's targets.\n| 1 stream | 16 sessions |\n")
    assert diary_lines(page) == ["## Session 12 (2026-12-02): fused layers", "### session 3",
                                 "Against issue 15's targets."]
    assert diary_lines("`saltserve token issue --role admin`; console sessions expire") == []


def test_the_history_check_tells_a_work_period_from_an_ordinary_session():
    assert _HISTORY.search("# measured in session 31 on the Xeon")
    assert _HISTORY.search("see issue #15") and _HISTORY.search("done in this turn")
    assert not _HISTORY.search("console sessions expire after 900 s")
    assert not _HISTORY.search("with Session(engine) as session: n = 3")
