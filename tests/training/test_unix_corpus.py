"""The second toy corpus (`--corpus unix`): Perl subs, man pages and list tasks, none like the first's."""

import re

import pytest

from vllm_dflash.zoo import CATEGORIES, list_problems
from vllm_dflash.zoo import corpus as corpus_mod
from vllm_dflash.zoo import unix_corpus

ROFF = r""".TH DEMO 1
.SH NAME
demo \- show \fBthings\fR
.SH DESCRIPTION
.B demo
prints the \fIfiles\fP it is given,
one per line.
.PP
Options:
.TP
\fB\-a\fR, \fB\-\-all\fR
do not ignore entries starting with .
.nf
  demo \-a file
.fi
.SH SEE ALSO
ls(1)
"""


def test_roff_becomes_filled_text():
    sections = unix_corpus._sections(ROFF.splitlines())
    assert unix_corpus.roff_to_text(sections["NAME"]) == "demo - show things"
    assert unix_corpus.roff_to_text(sections["DESCRIPTION"]) == (
        "demo prints the files it is given, one per line.\n\nOptions:\n\n-a, --all\n\n"
        "do not ignore entries starting with .\n\n  demo -a file")


def test_man_page_example(tmp_path):
    import gzip

    path = tmp_path / "demo.1.gz"
    with gzip.open(path, "wt") as f:
        f.write(ROFF.replace("one per line.", "one per line, " + "and so on " * 20))
    ex = unix_corpus.man_page(str(path))
    assert ex.category == "prose" and ex.prompt == "Describe the `demo` command." and ex.source == "demo"
    assert ex.response.startswith("demo - show things\n\ndemo prints the files")
    with gzip.open(path, "wt") as f:
        f.write(".so man1/other.1\n")
    assert unix_corpus.man_page(str(path)) is None          # a redirect page has no text of its own


def test_perl_subs_end_at_the_closing_brace(tmp_path):
    pm = tmp_path / "Demo.pm"
    pm.write_text("package Demo;\nsub one {\n    my $x = shift;\n    return $x + 1;\n}\n\n"
                  "sub two { 1 }\nsub three {\n  if (1) {\n  }\n}\n1;\n")
    subs = unix_corpus.perl_subs("Demo", str(pm))
    assert [s.prompt for s in subs] == ["Write the Perl subroutine `one` from module `Demo`.",
                                        "Write the Perl subroutine `three` from module `Demo`."]
    assert subs[0].response == "sub one {\n    my $x = shift;\n    return $x + 1;\n}"


def test_list_tasks_are_right():
    for q, a in list_problems.problems(seed=1, stream="train", count=300):
        answer = a.splitlines()[-1].removeprefix(list_problems.ANSWER_PREFIX)
        numbers = [int(n) for n in re.findall(r"\d+", q.split(":")[-1] if "Reverse" in q else q)]
        if q.startswith("Sort"):
            assert [int(x) for x in answer.split(", ")] == sorted(numbers, reverse="descending" in q)
        elif q.startswith("Add up"):
            assert int(answer) == sum(numbers)
        elif q.startswith("What are the largest"):
            assert answer == f"{max(numbers)} and {min(numbers)}"
        elif q.startswith("How many times"):
            word, items = re.match(r"How many times does '(\w+)' appear in: (.*)\?", q).groups()
            assert int(answer) == items.split().count(word)
        else:
            items = q.removeprefix("Reverse the list: ").rstrip(".").split(", ")
            assert answer == ", ".join(reversed(items))


@pytest.mark.skipif(not unix_corpus.perl_modules() or not unix_corpus.man_paths(),
                    reason="this machine ships no Perl modules or man pages")
def test_unix_corpus_is_deterministic_split_and_unlike_stdlib():
    unix_corpus.unix_examples.cache_clear()
    a = corpus_mod.build_corpus(seed=0, math_train=100, math_heldout=32, max_modules=300, kind="unix")
    unix_corpus.unix_examples.cache_clear()
    b = corpus_mod.build_corpus(seed=0, math_train=100, math_heldout=32, max_modules=300, kind="unix")
    assert a.train == b.train and a.heldout == b.heldout
    assert sorted(a.by_category("train")) == sorted(CATEGORIES)
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.heldout}
    assert all(corpus_mod.is_heldout(e.source) for e in a.heldout if e.category != "math")
    stdlib = corpus_mod.build_corpus(seed=0, math_train=100, math_heldout=32, max_modules=60)
    assert not {e.prompt for e in stdlib.train} & {e.prompt for e in a.train}
    with pytest.raises(ValueError, match="corpus='latin': choose one of stdlib, unix"):
        corpus_mod.build_corpus(kind="latin")
