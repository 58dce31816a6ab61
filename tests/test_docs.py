"""The user docs stay true: the generated config reference matches the models, the README stays short,
and every relative link in README.md and docs/*.md (with its #anchor) points to something that exists."""
import ast
import re
import unicodedata
from pathlib import Path

import pydantic
import pytest

from sparse_scale import config_reference
from sparse_scale.config import PLUGIN_BLOCKS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links there are not links)."""
    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip()).lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, numbered as GitHub numbers repeats (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match and not in_fence:
            slug = github_anchor(match.group(1))
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("GBA (issue 5 item 8, 2026-11-29 17:47-18:45)") == "gba-issue-5-item-8-2026-11-29-1747-1845"
    assert github_anchor("`moe_proto`") == "moe_proto"
    assert github_anchor("Data prefetch in train_rec (issue 4 item 6)") == "data-prefetch-in-train_rec-issue-4-item-6"


def test_config_reference_is_up_to_date():
    diff = config_reference.check_config_reference(DOCS / "config.md")
    hint = "docs/config.md drifted from the models; run python -m sparse_scale.config_reference\n"
    assert not diff, hint + "\n".join(diff[:40])


def test_config_reference_names_every_field_of_every_block():
    text = (DOCS / "config.md").read_text()

    def keys(prefix, model):
        for name, info in model.model_fields.items():
            yield f"{prefix}.{name}"
            sub = config_reference._submodel(info.annotation)
            if sub is not None:
                yield from keys(f"{prefix}.{name}", sub)

    for block, spec in PLUGIN_BLOCKS.items():
        model = config_reference.model_class(spec)
        assert f"## `{block}`" in text
        for key in keys(block, model):
            assert f"| `{key}` |" in text, key


def test_config_reference_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text(config_reference.render_config_reference().replace("| `gba.mode` |", "| `gba.mood` |"))
    assert config_reference.main(["--check", "--output", str(stale)]) == 1
    assert config_reference.main(["--output", str(stale)]) == 0
    assert config_reference.main(["--check", "--output", str(stale)]) == 0


def test_config_reference_renders_a_new_field():
    from sparse_scale.base.blocks import StrictBlock

    class Inner(StrictBlock):
        """Inner settings."""

        depth: int = pydantic.Field(3, ge=1, le=9, description="how deep")

    class Outer(StrictBlock):
        """Outer block."""

        inner: Inner = Inner()
        # the name of it
        name: str | None = None

    rows = {row.key: row for row in config_reference.field_rows("outer", Outer)}
    assert rows["outer.inner.depth"] == config_reference.FieldRow("outer.inner.depth", "integer", "3", ">= 1, <= 9",
                                                                 "how deep")
    assert rows["outer.name"].type == "string | null" and rows["outer.name"].description == "the name of it"
    assert rows["outer.inner"].description == "Inner settings."


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move detail to docs/"
    head = [line for line in lines[:8] if line.strip()]
    assert head[0].startswith("# ")
    assert head[1].startswith("```")
    assert head[2].startswith("make demo") and head[3].startswith("make test"), head[:4]


def broken_links(page: Path) -> list[str]:
    """Relative links of a Markdown page whose file, or whose ``#heading`` in a .md file, does not exist."""
    broken = []
    for line in _prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                broken.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def test_broken_links_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading (v2)\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md) [ok](other.md#a-code-heading-v2) [ok](#page) [web](https://x.y/z)\n"
                    "[gone](missing.md) [bad](other.md#nope) `[in code](missing2.md)`\n"
                    "```\n[in a fence](missing3.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_docs_has_one_page_per_concept():
    expected = {"config", "rec_job", "picasso", "gba", "moe", "launchers", "troubleshooting", "status", "architecture"}
    assert expected <= {p.stem for p in DOCS.glob("*.md")}
    readme = README.read_text()
    for stem in sorted(expected):
        assert f"docs/{stem}.md" in readme, f"README.md does not link docs/{stem}.md"


def _cli_flags(path: Path) -> list[str]:
    """The ``--flags`` a CLI module declares with ``add_argument`` (hidden ones, help=SUPPRESS, left out)."""
    flags = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--"):
            hidden = any(k.arg == "help" and "SUPPRESS" in ast.unparse(k.value) for k in node.keywords)
            if not hidden:
                flags.append(node.args[0].value)
    return flags


@pytest.mark.parametrize("cli, page", [("sparse_scale/rec/cli.py", "rec_job.md"), ("sparse_scale/lm/cli.py", "moe.md")])
def test_every_job_flag_is_documented(cli, page):
    flags = _cli_flags(ROOT / cli)
    assert flags, f"no flags found in {cli}"
    text = (DOCS / page).read_text()
    missing = [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", text)]
    assert not missing, f"docs/{page} does not document {missing} of {cli}"
