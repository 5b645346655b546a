"""The snippets of the README and of every docs page (docs/*.md) run as written (in a scratch
folder, from a fresh interpreter), and their relative links lead somewhere.

Python blocks run one by one, each distinct block once (a recipe shown on two pages costs one run).
A Python block whose first line is `# NAME.py` is also a file its page's shell recipes use: it is
written to the scratch folder as NAME.py. A ```bash block right after the line
`<!-- runs as written: tests/test_readme_snippets.py -->` runs in that folder with this
interpreter's bin first on $PATH (its `python` and `moeguard`); a recipe that says what it prints
when it catches something (`|| echo "... caught"`) must print it. Other shell blocks are
illustrative (they need a run of yours, a GPU or minutes of CPU): they are not run, and a page
that has any says so. The torchtitan recipe (the one block with `-m guard.integrations.torchtitan`)
runs from its own test, with the checkout on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNS_MARK = "<!-- runs as written: tests/test_readme_snippets.py -->"
# Pages other engineers are writing (issues #38 and #39) that the README already links: a link to one
# of them passes while it is missing; once it exists its own snippets and links are checked too.
PENDING: set[str] = set()


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(REPO))


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def shell_recipes(page: Path) -> list[str]:
    return re.findall(
        "^" + re.escape(RUNS_MARK) + r"\n```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M
    )


def named_files(page: Path) -> dict[str, str]:
    """NAME.py -> code, for the page's Python blocks that start with `# NAME.py`."""
    out = {}
    for code in python_blocks(page):
        m = re.match(r"# ([\w.-]+\.py)\n", code)
        if m:
            out[m.group(1)] = code
    return out


def distinct(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(page, code) with each code once, at the first page that shows it."""
    seen: set[str] = set()
    out = []
    for page, code in pairs:
        if code not in seen:
            seen.add(code)
            out.append((page, code))
    return out


PYTHON = distinct([(name(p), c) for p in pages() for c in python_blocks(p)])
SHELL = distinct([(name(p), c) for p in pages() for c in shell_recipes(p)])


def shell_params() -> list[object]:
    """SHELL as test cases; a recipe that runs `moeguard canary` is `serial` (scripts/test runs it
    in the pinned phase, after the parallel one): its "caught" and its clean exit are ratios of
    --script runs, divided by the yardstick GuardedStep times beside their steps."""
    return [
        pytest.param(p, c, marks=[pytest.mark.serial(cost=60)], id=f"{p}-{i}")
        if "moeguard canary" in c
        else pytest.param(p, c, id=f"{p}-{i}")
        for i, (p, c) in enumerate(SHELL)
    ]


def test_readme_has_the_three_recipes() -> None:
    readme = REPO / "README.md"
    codes = python_blocks(readme)
    assert any("MoEGuardCallback" in c for c in codes), "the README lost its Trainer recipe"
    assert any("GuardedStep(" in c for c in codes), "the README lost its GuardedStep recipe"
    assert "-m guard.integrations.torchtitan" in torchtitan_recipe()
    assert any(shell_recipes(p) for p in pages()), "no page has a marked shell recipe any more"


def test_readme_is_short() -> None:
    """Issue #41: the front door is read in five minutes; the rest lives on docs/ pages by topic."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size:,} bytes (the limit is 12,000): move detail to docs/"


def test_pages_with_illustrative_shell_blocks_say_so() -> None:
    for page in pages():
        text = page.read_text()
        blocks = len(re.findall(r"^```(?:bash|sh|shell)\n", text, flags=re.M))
        marked = len(shell_recipes(page)) + (1 if "-m guard.integrations.torchtitan" in text else 0)
        if blocks > marked:
            assert "illustrative" in text, (
                f"{name(page)}: unmarked shell blocks, and it does not say they are illustrative"
            )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        a, n = base, 0
        while a in out:
            n += 1
            a = f"{base}-{n}"
        out.add(a)
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The page's relative links (outside code blocks) whose file, or whose #anchor in a Markdown
    file, does not exist; a missing page named in PENDING passes."""
    bad = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        shown = str(dest.relative_to(root)) if dest.is_relative_to(root) else str(dest)
        if not dest.exists():
            if shown not in PENDING:
                bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def test_relative_links_lead_to_a_file_and_heading() -> None:
    bad = [b for page in pages() for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Two words, (and #30)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#two-words-and-30) [ok](#top) [web](https://x.org/y)\n"
        "[gone](docs/b.md) [typo](docs/a.md#two-word)\n\n# Top\n```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#two-word (no such heading)",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("page,code", PYTHON, ids=[f"{p}-{i}" for i, (p, _) in enumerate(PYTHON)])
def test_snippet_runs_as_written(page: str, code: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, (page, r.stderr[-3000:])
    if "run_dir=" in code:  # the snippet wrote a run store a user can read
        assert any((tmp_path / "runs").glob("*/steps/*.parquet"))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("page,recipe", shell_params())
def test_shell_recipe_runs_as_written(page: str, recipe: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    for file, code in named_files(REPO / page).items():
        (tmp_path / file).write_text(code)
    env = {**os.environ, "PATH": os.pathsep.join((os.path.dirname(sys.executable), os.environ["PATH"]))}
    r = subprocess.run(
        ["bash", "-e", "-c", recipe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, (page, r.stdout[-2000:], r.stderr[-3000:])
    for said in re.findall(r'\|\| echo "([^"]*caught)"', recipe):
        assert said in r.stdout, r.stderr[-3000:]


def torchtitan_recipe() -> str:
    found = [
        b
        for p in pages()
        for b in re.findall(r"^```bash\n(.*?)^```", p.read_text(), flags=re.S | re.M)
        if "-m guard.integrations.torchtitan" in b
    ]
    assert len(found) == 1, f"the torchtitan recipe must be one block on one page, found {len(found)}"
    return found[0]


@pytest.mark.slow
@pytest.mark.integration
def test_readme_torchtitan_recipe_runs_as_written(tmp_path: Path) -> None:
    """The recipe as a shell script: a collector, two torchtitan ranks streaming to it. Run in a
    scratch folder with the checkout on PYTHONPATH (the README runs it from the repository root)."""
    import json

    pytest.importorskip("torchtitan")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MOEGUARD_COLLECTOR", None)
    script = "set -e\n" + torchtitan_recipe().replace("kill %1", "kill %1; wait || true")
    r = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    meta = json.loads((tmp_path / "runs" / "tt-demo" / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["final_step"] == 40 and meta["world_size"] == 2
    assert meta["config"]["guard"]["collapse"]["warmup"] == 20  # the recipe's guard file was used
    assert any((tmp_path / "collector-runs" / "tt-demo" / "steps").glob("*.parquet"))  # it streamed
    assert "run tt-demo: 40 steps" in r.stderr  # the end-of-run summary
