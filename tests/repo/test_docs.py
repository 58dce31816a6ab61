"""The user docs stay true: the generated config reference matches the models, the README stays short,
every relative link in README.md and docs/*.md (with its #anchor) points to something that exists, and no
page or module docstring calls a block combination refused that the code runs."""
import ast
import functools
import re
import typing
import unicodedata
from pathlib import Path

import pydantic
import pytest

from sparse_scale import config_reference
from sparse_scale.config import PLUGIN_BLOCKS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose_lines(text: str, keep_code_spans: bool = False) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (links there are not links)."""
    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line if keep_code_spans else re.sub(r"`[^`]*`", "``", line))
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
    from sparse_core.blocks import StrictBlock

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


# --- no page calls a working block combination refused ------------------------------------------------------

BLOCK_NAMES = ("gba", "picasso", "moe_proto", "moe_model")
DOCSTRING_MODULES = [ROOT / "picasso_ops" / "block.py"]  # every module is scanned below; this one by name too
# a block name on its own: not gba_engine, picasso_ops, picasso.cache or a word inside a path
BLOCK_WORD = re.compile(r"(?<![\w./-])(" + "|".join(BLOCK_NAMES) + r")(?![\w/-]|\.\w)")
REFUSAL = re.compile(r"\b(refus\w*|reject\w*|can ?not (?:be )?combin\w*|can't (?:be )?combin\w*|"
                     r"not (?:be )?supported (?:together|with)|can ?not be used (?:together|with)|incompatible|"
                     r"do(?:es)? not work (?:together|with))", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+")


@functools.lru_cache(maxsize=1)
def working_block_pairs() -> frozenset[frozenset[str]]:
    """Pairs of blocks the code runs together: every pair of a shipped config the rec job refuses nothing of
    (``sparse_scale.rec.combinations``) or the MoE LM job reads, and each bare pair the rules let through."""
    import itertools
    import json as json_module
    import tempfile

    from sparse_scale.rec.combinations import refusals
    from sparse_scale.rec.config import RecJobConfig

    def rec_ok(path: Path) -> bool:
        return not refusals(RecJobConfig(config=str(path)))

    def lm_ok(path: Path) -> bool:
        from sparse_scale.config import ConfigError
        from sparse_scale.lm.model import model_args_from_config

        try:
            model_args_from_config(str(path))
        except ConfigError:  # no moe_model block, or one the LM refuses
            return False
        return True

    pairs: set[frozenset[str]] = set()
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        blocks = [b for b in BLOCK_NAMES if b in json_module.loads(path.read_text())]
        if len(blocks) >= 2 and (rec_ok(path) or lm_ok(path)):
            pairs |= {frozenset(p) for p in itertools.combinations(blocks, 2)}
    bare = {"gba": {}, "picasso": {}, "moe_proto": {"num_experts": 4}}  # each block at its defaults
    base = json_module.loads((ROOT / "ds_configs" / "demo_cpu.json").read_text())
    with tempfile.TemporaryDirectory() as folder:
        for a, b in itertools.combinations(bare, 2):
            path = Path(folder) / f"{a}+{b}.json"
            path.write_text(json_module.dumps({**base, a: bare[a], b: bare[b]}))
            if rec_ok(path):
                pairs.add(frozenset((a, b)))
    return frozenset(pairs)


def _blank_code(text: str) -> str:
    """Inline code as its words only when it is a bare block name (`gba`); other code spans become CODE."""
    return CODE_SPAN.sub(lambda m: m.group(2) if m.group(2).strip() in BLOCK_NAMES else "CODE", text)


def _paragraphs(lines: list[str]) -> list[tuple[bool, str]]:
    """(is a list item, its text on one line) per paragraph and list item of prose lines."""
    out: list[tuple[bool, str]] = []
    current: list[str] | None = None
    for line in lines:
        if not line.strip() or re.match(r"^\s*(#|\||```)", line):
            current = None
            if line.strip():
                out.append((False, line.strip()))
            continue
        if LIST_ITEM.match(line) or current is None:
            current = [LIST_ITEM.sub("", line).strip()]
            out.append((bool(LIST_ITEM.match(line)), ""))
        else:
            current.append(line.strip())
        out[-1] = (out[-1][0], " ".join(current))
    return out


def false_refusals(text: str, working: typing.AbstractSet[frozenset[str]], where: str = "") -> list[str]:
    """Clauses of prose ``text`` that call a working pair of blocks refused (or that a refusal list names)."""
    found = []
    lead_in = False  # the paragraph before a list says that what the list names is refused
    for is_item, para in _paragraphs(_prose_lines_raw(text)):
        if not is_item:
            last = re.split(r"(?<=[.;])\s+", para.rstrip())[-1]
            lead_in = para.rstrip().endswith(":") and bool(REFUSAL.search(last))
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*])", _blank_code(para))
        for i, sentence in enumerate(sentences):
            for j, clause in enumerate(re.split(r";|:\s", sentence)):
                if not REFUSAL.search(clause):
                    if not (is_item and lead_in and i == j == 0):
                        continue
                    # a list under a refusing lead-in refuses what each item opens with, not its remarks
                    clause = re.sub(r"\([^)]*(\)|$)", "", clause)
                named = set(BLOCK_WORD.findall(clause))
                if any(pair <= named for pair in working):
                    found.append(f"{where}{clause.strip()}")
    return found


def _prose_lines_raw(text: str) -> list[str]:
    """The lines outside fenced code blocks, code spans kept (they may name a block)."""
    return _prose_lines(text, keep_code_spans=True)


def test_the_working_block_pairs_come_from_the_code():
    working = working_block_pairs()
    # the system config the suite trains has all three blocks of the rec job
    assert {frozenset(("gba", "picasso")), frozenset(("gba", "moe_proto")), frozenset(("picasso", "moe_proto"))} \
        <= working, working
    assert frozenset(("moe_proto", "moe_model")) in working  # the MoE LM's two blocks


OLD_WORDING = [  # what the pages said before issue 26, each on a working pair
    "a refused combination is an error that gives its reason:\n- `gba` and `picasso` blocks together (the parameter "
    "servers hold the dense parameters; packed tables\n  update on the workers);\n- `--eval-every` with `gba.mode`\n",
    "`\"store\": \"ps\"` is refused in the rec job too, because the parameter servers exist only with a `gba`\n"
    "  block, which the rec job cannot combine with `picasso` yet (the cache over the servers exists as a\n",
    "The rec job refuses some combinations of blocks and flags with the reason\n([rec_job.md](rec_job.md#flags)), "
    "for example `gba` with `picasso`.\n",
    "* ``cache``: ``\"ps\"`` (rows on gba_engine's parameter servers) is refused: those servers\n  exist only with a "
    "``gba`` block, which train_rec cannot combine with\n  ``picasso`` yet. The cache serves data-parallel tables.\n",
    "The `moe_proto` and `gba` blocks are not supported together.\n",
]
TRUE_WORDING = [  # refusals of a sub-option, and pairs said to work
    "- **Refused with gba** (each with its reason, `sparse_scale/rec/combinations.py`): `picasso.sharding:\n"
    "  \"row_wise\"` (the servers already spread the rows), `interleave.micro_batches > 1`.\n",
    "- `gba` and `picasso` blocks together (issue 13): packed tables on the servers; refused with their\n"
    "  reasons: `picasso.sharding: row_wise`, `interleave.micro_batches > 1`\n",
    "`moe_proto.ep_size > 1` with a `gba` block is refused before step 1.\n",
    "A refused combination is an error that gives its reason:\n- with a `gba` block: `picasso.sharding: "
    "\"row_wise\"`, a `picasso.cache.store` other than `\"ps\"`;\n- `--rejoin-as` without a `gba` block (the "
    "`picasso` block works with it);\n",
    "gba_engine refuses picasso_ops tables that run collectives; the gba block and the picasso block work.\n",
]


@pytest.mark.parametrize("text", OLD_WORDING)
def test_false_refusals_finds_a_working_pair_called_refused(text):
    assert false_refusals(text, working_block_pairs()), text


@pytest.mark.parametrize("text", TRUE_WORDING)
def test_false_refusals_leaves_refusals_of_sub_options_alone(text):
    assert not false_refusals(text, working_block_pairs()), text


def _module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


@pytest.mark.parametrize("page", [*PAGES, *DOCSTRING_MODULES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_calls_a_working_block_combination_refused(page):
    text = _module_docstring(page) if page.suffix == ".py" else page.read_text()
    found = false_refusals(text, working_block_pairs(), where=f"{page.relative_to(ROOT)}: ")
    assert not found, ("these blocks work together (ds_configs, sparse_scale/rec/combinations.py), but the page "
                       "says they are refused:\n" + "\n".join(found))


def test_no_module_docstring_calls_a_working_block_combination_refused():
    found = []
    for package in ("picasso_ops", "gba_engine", "moe_proto", "sparse_scale"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found += false_refusals(_module_docstring(path), working_block_pairs(), where=f"{path.relative_to(ROOT)}: ")
    assert not found, "these blocks work together, but the module docstring says they are refused:\n" + "\n".join(found)


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippet_lines_not_in(page: Path, sources: list[Path]) -> list[str]:
    """The code lines of ``page``'s python blocks that are no line of any of ``sources`` (stripped)."""
    known = {line.strip() for src in sources for line in src.read_text().splitlines()}
    missing = []
    for block in PYTHON_BLOCK.findall(page.read_text()):
        missing += [line.strip() for line in block.splitlines() if line.strip() and line.strip() not in known]
    return missing


def test_own_script_page_shows_only_lines_of_the_examples_that_run_in_the_suite():
    examples = sorted((ROOT / "examples").glob("*.py"))
    page = DOCS / "own_script.md"
    assert PYTHON_BLOCK.findall(page.read_text()), "docs/own_script.md has no python block"
    assert snippet_lines_not_in(page, examples) == []


def test_snippet_check_finds_a_line_that_drifted(tmp_path):
    page = tmp_path / "page.md"
    page.write_text((DOCS / "own_script.md").read_text().replace("engine.step()", "engine.step(sparse=True)", 1))
    assert snippet_lines_not_in(page, sorted((ROOT / "examples").glob("*.py"))) == ["engine.step(sparse=True)"]
