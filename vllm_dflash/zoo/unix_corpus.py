"""A second toy corpus, unlike the stdlib one: Perl source, man pages and list tasks.

For a second toy target that shares nothing with the first but the categories'
names (so prompt files, eval sets and reports work unchanged):
- code: subroutines of the Perl modules the system ships (/usr/share/perl*);
- prose: the NAME line and DESCRIPTION section of section-1 and -8 man pages;
- math: seeded list tasks (sorting, extremes, running sums; `list_problems`).

A Perl module or a man page is held out when a hash of its name says so, as in
`corpus`. The text comes from the machine's own files, so another distribution
gives another corpus.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import re
import textwrap
from functools import lru_cache

from vllm_dflash.zoo.corpus import MAX_CODE_CHARS, MAX_DOC_CHARS, Example, is_heldout

PERL_ROOTS = ("/usr/share/perl", "/usr/share/perl5")
MAN_DIRS = ("/usr/share/man/man1", "/usr/share/man/man8")
MIN_MAN_CHARS = 120
GENERATED_FAMILY = 1000   # a family of man pages this large is generated, not written
GENERATED_KEEP = 8

_SUB = re.compile(r"^sub ([A-Za-z_]\w*)\b")
# roff escapes: fonts, spacing and hyphenation marks vanish; a few glyphs keep a plain form.
_GLYPHS = {"aq": "'", "dq": '"', "em": "--", "en": "-", "bu": "*", "lq": '"', "rq": '"', "oq": "'",
           "cq": "'", "co": "(c)", "mu": "x", "ti": "~", "ha": "^", "rs": "\\", "at": "@", "sh": "#"}
_ESCAPES = re.compile(r"\\(f\[[^\]]*\]|f\(..|f.|s[+-]?\d|\*\(..|\*\[[^\]]*\]|\*.|\(..|\[[^\]]*\]|.)")
_FONT_MACROS = {".B", ".I", ".SM", ".SB"}
_ALTERNATING = {".BR", ".RB", ".IR", ".RI", ".BI", ".IB"}
_BREAKS = {".PP", ".P", ".LP", ".sp", ".IP", ".TP", ".HP", ".SS", ".br"}


def perl_modules() -> list[tuple[str, str]]:
    """(module name, path) of every Perl module file, sorted by path."""
    out = []
    for root in PERL_ROOTS:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.pm"), recursive=True)):
            rel = os.path.relpath(path, root)[:-3].split(os.sep)
            if re.fullmatch(r"\d+(\.\d+)*", rel[0]):   # /usr/share/perl/5.36.0/...
                rel = rel[1:]
            out.append(("::".join(rel), path))
    return sorted(out, key=lambda m: m[1])


def perl_subs(module: str, path: str) -> list[Example]:
    """Top-level `sub name { ... }` definitions (closing brace in column 0), source order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, OSError):
        return []
    out, i = [], 0
    while i < len(lines):
        m = _SUB.match(lines[i])
        if m is None:
            i += 1
            continue
        if lines[i].count("{") <= lines[i].count("}"):   # a one-line sub (or a forward declaration)
            i += 1
            continue
        end = next((j for j in range(i + 1, min(len(lines), i + 200))
                    if lines[j].startswith("}") or _SUB.match(lines[j])), None)
        if end is None or not lines[end].startswith("}"):
            i = end or i + 1
            continue
        src = "\n".join(lines[i:end + 1])
        if end > i + 1 and len(src) <= MAX_CODE_CHARS:
            out.append(Example("code", f"Write the Perl subroutine `{m.group(1)}` from module `{module}`.",
                               src, module))
        i = end + 1
    return out


def _unescape(text: str) -> str:
    def glyph(m: re.Match) -> str:
        e = m.group(1)
        if e == "-" or e == "e":
            return "-" if e == "-" else "\\"
        if e in (" ", "~", "0"):
            return " "
        if e.startswith("(") and len(e) == 3:
            return _GLYPHS.get(e[1:], "")
        if e.startswith("[") and e.endswith("]"):
            return _GLYPHS.get(e[1:-1], "")
        return ""

    return _ESCAPES.sub(glyph, text)


def _macro_args(rest: str) -> list[str]:
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]


def roff_to_text(lines: list[str]) -> str:
    """Plain text of man-page source lines, filled the way `man` fills it.

    Text lines and font macros add words to the current paragraph; paragraph macros
    end it; `.nf`/`.EX` blocks keep their lines; a `.TP` tag gets a line of its own.
    """
    paragraphs: list[str] = []
    words: list[str] = []
    nofill = tag = False

    def flush() -> None:
        if words:
            paragraphs.append(textwrap.fill(" ".join(words), 78))
            words.clear()

    for line in lines:
        if line.startswith((".\\\"", "'\\\"", "\\\"")):
            continue
        if line.startswith((".", "'")):
            name, _, rest = line.partition(" ")
            if name in (".nf", ".EX") or name in (".fi", ".EE"):
                flush()
                nofill = name in (".nf", ".EX")
            elif name in _BREAKS:
                flush()
                tag = name == ".TP"
                if name in (".SS", ".IP") and rest.strip():
                    paragraphs.append(_unescape(" ".join(_macro_args(rest))))
            elif name in _FONT_MACROS | _ALTERNATING and rest.strip():
                joiner = "" if name in _ALTERNATING else " "
                words.append(_unescape(joiner.join(_macro_args(rest))))
            continue
        text = _unescape(line).strip()
        if nofill:
            paragraphs.append(_unescape(line).rstrip())
        elif text:
            words.append(text)
        if tag:
            flush()
            tag = False
    flush()
    return "\n\n".join(p for p in paragraphs if p.strip()).strip()


def _sections(lines: list[str]) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(".SH"):
            current = " ".join(_macro_args(line[3:])).upper()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    return sections


def man_page(path: str) -> Example | None:
    """A prose example from one man page: its NAME line, then its DESCRIPTION."""
    name = os.path.basename(path).split(".")[0]
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, OSError, EOFError):
        return None
    if not lines or lines[0].startswith(".so"):
        return None
    sections = _sections(lines)
    summary = roff_to_text(sections.get("NAME", [])).replace("\n", " ")
    description = roff_to_text(sections.get("DESCRIPTION", []))
    if not summary or len(description) < MIN_MAN_CHARS:
        return None
    text = summary + "\n\n" + description
    if len(text) > MAX_DOC_CHARS:   # cut at the last paragraph that fits
        cut = text.rfind("\n\n", 0, MAX_DOC_CHARS)
        text = text[:cut] if cut > len(summary) else text[:MAX_DOC_CHARS].rsplit(" ", 1)[0]
    return Example("prose", f"Describe the `{name}` command.", text, name)


def man_paths() -> list[str]:
    """Man page files, sorted; generated families (thousands of near-identical pages of one
    tool, e.g. gcloud's) are thinned to one page in GENERATED_KEEP so they do not drown the rest."""
    paths = sorted(p for d in MAN_DIRS for p in glob.glob(os.path.join(d, "*.gz")))
    families: dict[str, int] = {}
    for p in paths:
        family = re.split(r"[_.-]", os.path.basename(p))[0]
        families[family] = families.get(family, 0) + 1
    return [p for p in paths if families[re.split(r"[_.-]", os.path.basename(p))[0]] < GENERATED_FAMILY
            or int(hashlib.sha1(os.path.basename(p).encode()).hexdigest(), 16) % GENERATED_KEEP == 0]


@lru_cache(maxsize=8)
def unix_examples(max_files: int | None = None) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(training, held-out) code and prose examples, deduplicated by prompt."""
    modules, pages = perl_modules(), man_paths()
    if not modules or not pages:
        raise ValueError(f"corpus 'unix' needs Perl modules under {' or '.join(PERL_ROOTS)} and man pages "
                         f"under {' or '.join(MAN_DIRS)}; this machine has {len(modules)} modules and "
                         f"{len(pages)} pages: use --corpus stdlib")
    if max_files is not None:
        modules, pages = modules[:max_files], pages[:max_files]
    examples = [ex for module, path in modules for ex in perl_subs(module, path)]
    examples += [ex for ex in map(man_page, pages) if ex is not None]
    train, heldout, seen = [], [], set()
    for ex in examples:
        if ex.prompt in seen:
            continue
        seen.add(ex.prompt)
        (heldout if is_heldout(ex.source) else train).append(ex)
    return tuple(train), tuple(heldout)

