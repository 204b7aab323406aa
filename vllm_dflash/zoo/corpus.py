"""Training and held-out text for the toy target, from files every machine has.

Three categories, like the DFlash paper's benchmarks:
- code: functions and methods of the Python standard library's own source files;
- math: seeded synthetic word problems with worked answers (`math_problems`);
- prose: stdlib docstrings, less predictable than code or math.

Each example is a chat turn (user prompt -> assistant response). A module is held
out (for eval prompts and eval loss) when a hash of its name says so, so held-out
functions and docstrings never reach training; math holds out a separate stream.
Everything is ordered deterministically (sorted paths, AST order, seeded RNGs).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sysconfig
import textwrap
import warnings
from dataclasses import dataclass
from functools import lru_cache

from vllm_dflash.zoo import math_problems

# Not useful text, or not source a user would ask for.
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
             "__pycache__", "ensurepip", "encodings", "pydoc_data", "venv", "__phello__"}
MAX_CODE_CHARS = 1500   # about 450 tokens: prompt + response fit a 512-token row
MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 1500
HELDOUT_MODULUS = 12    # about 1 module in 12 is held out


@dataclass(frozen=True)
class Example:
    category: str   # "code" | "math" | "prose"
    prompt: str     # raw user message (the chat template is applied later)
    response: str   # assistant message
    source: str     # module name or math stream, for the held-out split


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_modules(root: str | None = None) -> list[tuple[str, str]]:
    """(module name, path) of every stdlib source file, in sorted path order."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), root)[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and not any(p.startswith("_test") or p.startswith("test_") for p in parts):
                out.append((".".join(parts), os.path.join(dirpath, fn)))
    return sorted(out, key=lambda m: m[1])


def is_heldout(module: str) -> bool:
    """Stable across runs and machines (not Python's salted hash)."""
    return int(hashlib.sha1(module.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def _clean_doc(doc: str | None) -> str | None:
    if not doc:
        return None
    doc = inspect.cleandoc(doc).strip()
    if not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS:
        return None
    return doc


def module_examples(module: str, path: str) -> list[Example]:
    """Code and prose examples of one source file, in AST order."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    doc = _clean_doc(ast.get_docstring(tree, clean=False))
    if doc:
        out.append(Example("prose", f"Describe the Python module `{module}`.", doc, module))

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{owner}.{child.name}" if owner else child.name
                src = textwrap.dedent("".join(lines[child.lineno - 1:child.end_lineno])).rstrip()
                if MAX_CODE_CHARS >= len(src) and src.count("\n") >= 1:
                    kind = "method" if owner else "function"
                    out.append(Example("code", f"Write the Python {kind} `{qual}` from module `{module}`.",
                                       src, module))
                doc = _clean_doc(ast.get_docstring(child, clean=False))
                if doc:
                    out.append(Example("prose", f"Explain what `{module}.{qual}` does.", doc, module))
            elif isinstance(child, ast.ClassDef) and owner is None:
                doc = _clean_doc(ast.get_docstring(child, clean=False))
                if doc:
                    out.append(Example("prose", f"Explain what the class `{module}.{child.name}` is for.",
                                       doc, module))
                visit(child, child.name)

    visit(tree, None)
    return out


@lru_cache(maxsize=8)
def stdlib_examples(max_modules: int | None = None) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(training, held-out) code and prose examples, deduplicated by prompt."""
    train, heldout, seen = [], [], set()
    modules = stdlib_modules()
    if max_modules is not None:
        modules = modules[:max_modules]
    for module, path in modules:
        for ex in module_examples(module, path):
            if ex.prompt in seen:
                continue
            seen.add(ex.prompt)
            (heldout if is_heldout(module) else train).append(ex)
    return tuple(train), tuple(heldout)


def math_examples(seed: int, n_train: int, n_heldout: int, generator=math_problems
                  ) -> tuple[list[Example], list[Example]]:
    """The `math` category from a seeded problem generator (a module with `problems`)."""
    held = generator.problems(seed, "heldout", n_heldout)
    train = generator.problems(seed, "train", n_train, exclude={q for q, _ in held})
    return ([Example("math", q, a, "train") for q, a in train],
            [Example("math", q, a, "heldout") for q, a in held])


@dataclass
class Corpus:
    train: list[Example]
    heldout: list[Example]

    def by_category(self, split: str) -> dict[str, list[Example]]:
        out: dict[str, list[Example]] = {}
        for ex in getattr(self, split):
            out.setdefault(ex.category, []).append(ex)
        return out


CORPORA = ("stdlib", "unix")


def build_corpus(seed: int = 0, math_train: int = 40000, math_heldout: int = 400,
                 max_modules: int | None = None, kind: str = "stdlib") -> Corpus:
    """The whole corpus; `max_modules` cuts the source walk short for smoke builds.

    kind: `stdlib` (Python source, docstrings, word problems; the bundled target's)
    or `unix` (Perl source, man pages, list tasks; see `unix_corpus`).
    """
    if kind not in CORPORA:
        raise ValueError(f"corpus={kind!r}: choose one of {', '.join(CORPORA)}")
    if math_train < 1 or math_heldout < 32:
        raise ValueError(f"math_train={math_train}, math_heldout={math_heldout}: need math_train >= 1 "
                         "and math_heldout >= 32 (the eval prompt sets hold 32 per category)")
    if kind == "unix":
        from vllm_dflash.zoo import list_problems
        from vllm_dflash.zoo.unix_corpus import unix_examples

        src_train, src_held = unix_examples(max_modules)
        m_train, m_held = math_examples(seed, math_train, math_heldout, list_problems)
    else:
        src_train, src_held = stdlib_examples(max_modules)
        m_train, m_held = math_examples(seed, math_train, math_heldout)
    return Corpus(train=list(src_train) + m_train, heldout=list(src_held) + m_held)
