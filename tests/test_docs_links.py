"""Every relative link of README.md and docs/ (and every `docs/X.md#anchor` the code cites) points
at a file that exists and, with an #anchor, at a heading of that file, slugged as GitHub slugs
headings (lower case; punctuation other than `-` and `_` dropped; each space a `-`; a repeated
heading gets `-1`, `-2`, ...)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"\b(docs/[\w./-]+\.md)#([\w-]+)")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set:
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", md.read_text()), re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def doc_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def check(target: Path, anchor: str, where: str, cache: dict) -> list:
    if not target.exists():
        return [f"{where}: {target.relative_to(ROOT)} does not exist"]
    if anchor and target.suffix == ".md":
        if target not in cache:
            cache[target] = anchors(target)
        if anchor not in cache[target]:
            return [f"{where}: no heading #{anchor} in {target.relative_to(ROOT)}"]
    return []


def test_slug_matches_github_rules():
    assert slug("Integer-dot W8A8 / W4A8") == "integer-dot-w8a8--w4a8"
    assert slug("`tritium eval`") == "tritium-eval"
    assert slug("Quality budget: `--quantization auto`") == "quality-budget---quantization-auto"
    assert slug("Native decode step (in-process)") == "native-decode-step-in-process"


def test_markdown_links_resolve():
    bad, cache = [], {}
    for md in doc_files():
        text = FENCE.sub("", md.read_text())
        for m in LINK.finditer(text):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (md.parent / path).resolve() if path else md
            bad += check(target, anchor, str(md.relative_to(ROOT)), cache)
    assert not bad, "\n".join(bad)


def test_code_doc_anchors_resolve():
    bad, cache, seen = [], {}, 0
    for folder in ("backend", "kernels", "builder", "client", "tests"):
        for py in (ROOT / folder).rglob("*.py"):
            if py.name == Path(__file__).name:
                continue
            for m in CODE_REF.finditer(py.read_text()):
                seen += 1
                bad += check(ROOT / m.group(1), m.group(2), str(py.relative_to(ROOT)), cache)
    assert seen > 0, "no docs/X.md#anchor reference found in the code: the pattern is broken"
    assert not bad, "\n".join(bad)
