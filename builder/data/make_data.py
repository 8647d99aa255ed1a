"""Regenerate the shipped calibration and held-out evaluation texts (builder/data/) from Debian
packages, and their provenance file PROVENANCE.json. Not imported by the builder; run by hand:

    mkdir -p /tmp/src && cd /tmp/src
    apt-get download python3.11-doc libpython3.11-stdlib dict-devil   # Debian bookworm
    for f in *.deb; do dpkg-deb -x "$f" root; done
    python builder/data/make_data.py --root /tmp/src/root --kjv /work/data/heldout_prose_kjv_1samuel.txt \
        --kjv-copyright /work/data/kjv_copyright.txt

Every output is a deterministic function of the package files (sorted inputs, fixed caps), so a
rerun on the same package versions reproduces the recorded sha256 values.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = "usr/share/doc/python3.11/html/_sources"
STDLIB = "usr/lib/python3.11"
DEVIL = "usr/share/dictd/devil.dict.dz"

PROSE_FILES = ("tutorial/appetite", "tutorial/interpreter", "tutorial/controlflow", "tutorial/modules",
               "tutorial/errors", "tutorial/classes", "tutorial/floatingpoint", "tutorial/venv",
               "howto/sorting", "howto/unicode", "howto/functional", "howto/logging", "howto/sockets",
               "howto/descriptor")
PROSE_CAP_PER_FILE = 4500
FAQ_FILES = ("faq/general", "faq/programming", "faq/design", "faq/library", "faq/extending", "faq/gui",
             "faq/installed", "faq/windows")
FAQ_ANSWER_CAP = 900
FAQ_TOTAL_CAP = 56000
CODE_FILES = ("colorsys.py", "graphlib.py", "sched.py", "queue.py", "shlex.py", "cmd.py", "fileinput.py",
              "netrc.py", "secrets.py", "tabnanny.py")
CODE_CAP_PER_FILE = 4000
DEVIL_CAP = 60000


def rst_to_text(src: str, keep_literal: bool) -> str:
    """Plain text of reStructuredText: headings, directives and markup dropped; literal blocks
    kept (as indented text) only with keep_literal."""
    out, skip_indent, literal = [], None, False
    lines = src.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped and indent <= skip_indent:
                skip_indent = None
            else:
                if literal and keep_literal:
                    out.append(line)
                continue
        if stripped.startswith(".."):  # directive, comment, target: drop it and its body
            skip_indent, literal = indent, False
            continue
        if re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", stripped):  # heading under/overline
            if out and out[-1].strip() and not re.fullmatch(r"([=\-~^*#+\"'`])\1{2,}", out[-1].strip()):
                out.pop()  # the heading text itself
            continue
        if stripped.startswith(">>>") or stripped.startswith("..."):
            continue
        if stripped.endswith("::"):
            line = line.rstrip()[:-1] if not stripped == "::" else ""
            skip_indent, literal = indent, True
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r":[a-z:]+:`~?!?([^`<]*?)\s*(<[^>]*>)?`", r"\1", text)  # :func:`x <y>` -> x
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", text)              # `text <url>`_ -> text
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`]+)`_?", r"\1", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def cap_paragraphs(text: str, cap: int) -> str:
    """The leading whole paragraphs of text, at most cap characters (at least one paragraph)."""
    out, n = [], 0
    for para in text.split("\n\n"):
        if out and n + len(para) + 2 > cap:
            break
        out.append(para)
        n += len(para) + 2
    return "\n\n".join(out).strip() + "\n"


def read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def make_prose(root: str) -> str:
    parts = [cap_paragraphs(rst_to_text(read(root, f"{DOC}/{name}.rst.txt"), keep_literal=False),
                            PROSE_CAP_PER_FILE) for name in PROSE_FILES]
    return "\n".join(parts)


def faq_pairs(src: str):
    """(question, answer) pairs of an FAQ page: a heading ending in '?' and the text up to the
    next heading."""
    lines = src.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and re.fullmatch(r"([=\-~^])\1{2,}", lines[i + 1].strip())]
    for j, i in enumerate(heads):
        q = lines[i].strip()
        if not q.endswith("?"):
            continue
        end = heads[j + 1] if j + 1 < len(heads) else len(lines)
        a = cap_paragraphs(rst_to_text("\n".join(lines[i + 2:end]), keep_literal=True), FAQ_ANSWER_CAP).strip()
        q = re.sub(r"``([^`]+)``", r"\1", q)
        if len(a) > 40:
            yield q, a


def make_dialogue(root: str) -> str:
    rows, n = [], 0
    for name in FAQ_FILES:
        for q, a in faq_pairs(read(root, f"{DOC}/{name}.rst.txt")):
            row = json.dumps({"messages": [{"role": "user", "content": q},
                                           {"role": "assistant", "content": a}]}, ensure_ascii=False)
            if n + len(row) > FAQ_TOTAL_CAP:
                return "\n".join(rows) + "\n"
            rows.append(row)
            n += len(row) + 1
    return "\n".join(rows) + "\n"


def make_code(root: str) -> str:
    parts = []
    for name in CODE_FILES:
        src = read(root, f"{STDLIB}/{name}")
        # whole top-level blocks up to the cap (cut before a line starting a new def/class)
        lines, out, n = src.splitlines(), [], 0
        for line in lines:
            if n > CODE_CAP_PER_FILE and re.match(r"(def |class |@)", line):
                break
            out.append(line)
            n += len(line) + 1
        parts.append(f"# file: Lib/{name}\n" + "\n".join(out).rstrip() + "\n")
    return "\n\n".join(parts)


def make_devil(root: str) -> str:
    with gzip.open(os.path.join(root, DEVIL), "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    body = text[text.index("ABASEMENT, n."):]
    return cap_paragraphs(body.replace("\r", ""), DEVIL_CAP)


PSF = {"name": "PSF-2.0", "text": "licenses/PSF-LICENSE.txt",
       "note": "Python Software Foundation License Version 2 (the documentation's code examples are also "
               "under the Zero-Clause BSD license, see the docs' license page); text copied from the "
               "package's usr/lib/python3.11/LICENSE.txt"}
SOURCES = {
    "calibration/prose.txt": {
        "domain": "prose", "role": "calibration",
        "package": "python3.11-doc", "version": "3.11.2-6+deb12u8", "distribution": "Debian bookworm",
        "from": [f"{DOC}/{n}.rst.txt" for n in PROSE_FILES],
        "extraction": f"reStructuredText to plain text (directives, code blocks, headings and markup "
                      f"dropped), first whole paragraphs up to {PROSE_CAP_PER_FILE} characters per page",
        "license": PSF},
    "calibration/dialogue.jsonl": {
        "domain": "dialogue", "role": "calibration",
        "package": "python3.11-doc", "version": "3.11.2-6+deb12u8", "distribution": "Debian bookworm",
        "from": [f"{DOC}/{n}.rst.txt" for n in FAQ_FILES],
        "extraction": f"each FAQ heading ending in '?' as the user turn, the text up to the next heading "
                      f"(plain text, code blocks kept) as the assistant turn, capped at {FAQ_ANSWER_CAP} "
                      f"characters of whole paragraphs; one JSON {{messages}} per line, up to "
                      f"{FAQ_TOTAL_CAP} characters",
        "license": PSF},
    "calibration/code.py.txt": {
        "domain": "code", "role": "calibration",
        "package": "libpython3.11-stdlib", "version": "3.11.2-6+deb12u8", "distribution": "Debian bookworm",
        "from": [f"{STDLIB}/{n}" for n in CODE_FILES],
        "extraction": f"each module's source from its start, cut before the first top-level def/class/"
                      f"decorator after {CODE_CAP_PER_FILE} characters",
        "license": PSF},
    "eval/kjv_1samuel.txt": {
        "domain": "kjv", "role": "held-out evaluation (never calibrated on)",
        "package": "bible-kjv-text", "version": "4.38", "distribution": "Debian bookworm",
        "from": ["bible -l1000 \"1samuel1:1-31:13\" (the package's own program)"],
        "extraction": "the text printed by the bible-kjv package's `bible` program for 1 Samuel 1:1-31:13, "
                      "verse numbers dropped, one paragraph per chapter; copied unchanged (--kjv)",
        "license": {"name": "public domain", "text": "licenses/KJV-COPYRIGHT.txt",
                    "note": "the 1611 King James Version's copyright has expired; the package's "
                            "copyright file is copied as is"}},
    "eval/devil.txt": {
        "domain": "devil", "role": "held-out evaluation (never calibrated on)",
        "package": "dict-devil", "version": "1.0-13.1", "distribution": "Debian bookworm",
        "from": [DEVIL],
        "extraction": f"the dictionary body from 'ABASEMENT, n.' on (preface dropped), whole paragraphs "
                      f"up to {DEVIL_CAP} characters",
        "license": {"name": "public domain", "text": "licenses/DEVIL-COPYRIGHT.txt",
                    "note": "Ambrose Bierce, The Devil's Dictionary, 1911: 'A Public Domain Text, "
                            "Copyright Expired'; the package's copyright file is copied as is"}},
}
COMMAND = ("apt-get download python3.11-doc libpython3.11-stdlib dict-devil && for f in *.deb; do "
           "dpkg-deb -x $f root; done && python builder/data/make_data.py --root root "
           "--kjv /work/data/heldout_prose_kjv_1samuel.txt --kjv-copyright /work/data/kjv_copyright.txt")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="folder the .deb files were extracted into")
    ap.add_argument("--kjv", required=True, help="heldout_prose_kjv_1samuel.txt (from bible-kjv-text)")
    ap.add_argument("--kjv-copyright", required=True, help="bible-kjv-text's copyright file")
    args = ap.parse_args()
    os.makedirs(os.path.join(HERE, "calibration"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "eval"), exist_ok=True)
    os.makedirs(os.path.join(HERE, "licenses"), exist_ok=True)
    shutil.copyfile(os.path.join(args.root, STDLIB, "LICENSE.txt"), os.path.join(HERE, PSF["text"]))
    shutil.copyfile(args.kjv_copyright, os.path.join(HERE, "licenses/KJV-COPYRIGHT.txt"))
    shutil.copyfile(os.path.join(args.root, "usr/share/doc/dict-devil/copyright"),
                    os.path.join(HERE, "licenses/DEVIL-COPYRIGHT.txt"))
    outputs = {"calibration/prose.txt": make_prose(args.root),
               "calibration/dialogue.jsonl": make_dialogue(args.root),
               "calibration/code.py.txt": make_code(args.root),
               "eval/devil.txt": make_devil(args.root)}
    for rel, text in outputs.items():
        with open(os.path.join(HERE, rel), "w", encoding="utf-8") as f:
            f.write(text)
    shutil.copyfile(args.kjv, os.path.join(HERE, "eval/kjv_1samuel.txt"))
    files = {}
    for rel, src in SOURCES.items():
        path = os.path.join(HERE, rel)
        files[rel] = {**src, "bytes": os.path.getsize(path), "sha256": sha256(path)}
        print(f"{rel}: {files[rel]['bytes']} bytes, sha256 {files[rel]['sha256']}")
    licenses = {p: sha256(os.path.join(HERE, p)) for p in sorted({s["license"]["text"] for s in SOURCES.values()})}
    with open(os.path.join(HERE, "PROVENANCE.json"), "w", encoding="utf-8") as f:
        json.dump({"command": COMMAND, "files": files, "license_files": licenses}, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
