"""vllm_dflash.envs is the only reader of VLLM_DFLASH_* variables; each one
reads its default, its valid values, and fails on a bad value naming the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_dflash import envs

ROOT = Path(__file__).resolve().parents[2]
# Names that are CMake cache variables or preprocessor macros, not environment variables.
NOT_ENV = {"VLLM_DFLASH_WITH_CUDA", "VLLM_DFLASH_OUTPUT_DIR", "VLLM_DFLASH_EXT_SUFFIX"}
READ = re.compile(r"""(environ\.get|getenv|environ\.setdefault)\(\s*["']VLLM_DFLASH_|environ\[["']VLLM_DFLASH_\w+["']\](?!\s*=)""")


def _sources():
    for pattern in ("vllm_dflash/**/*.py", "scripts/*.py", "scripts/*.sh", "tests/**/*.py", "setup.py"):
        yield from ROOT.glob(pattern)


def test_no_other_module_reads_a_vllm_dflash_variable():
    readers = [str(p.relative_to(ROOT)) for p in _sources()
               if p.name != "envs.py" and READ.search(p.read_text())]
    assert readers == [], f"read VLLM_DFLASH_* through vllm_dflash.envs instead: {readers}"


def test_every_variable_named_in_the_project_is_declared():
    named = set()
    for path in [*_sources(), ROOT / "README.md", ROOT / "Makefile"]:
        named |= set(re.findall(r"_?VLLM_DFLASH_[A-Z_]*[A-Z]", path.read_text()))
    undeclared = named - set(envs.environment_variables) - NOT_ENV
    assert not undeclared, f"declare {sorted(undeclared)} in vllm_dflash.envs.environment_variables"
    assert set(dir(envs)) == set(envs.environment_variables)


@pytest.mark.parametrize("name", sorted(envs.environment_variables))
def test_unset_gives_the_default(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    defaults = {"VLLM_DFLASH_IMPL": "plugin", "VLLM_DFLASH_NATIVE_OPS": True, "VLLM_DFLASH_CUDA": True,
                "VLLM_DFLASH_GEMM_ROWS": True,
                "VLLM_DFLASH_JIT_VERIFIER": False, "VLLM_DFLASH_SKIP_NVCC": False}
    assert getattr(envs, name) == defaults.get(name)


def test_values_are_read_at_access(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_IMPL", " VLLM ")
    assert envs.VLLM_DFLASH_IMPL == "vllm" and not envs.use_plugin_impl()
    monkeypatch.setenv("VLLM_DFLASH_NATIVE_OPS", "0")
    assert envs.VLLM_DFLASH_NATIVE_OPS is False
    monkeypatch.setenv("VLLM_DFLASH_PROFILE_FILE", "/tmp/p.json")
    assert envs.VLLM_DFLASH_PROFILE_FILE == "/tmp/p.json"
    monkeypatch.setenv("VLLM_DFLASH_VERIFIER", "dflash")
    assert envs.VLLM_DFLASH_VERIFIER == "dflash"


@pytest.mark.parametrize("name, value, message", [
    ("VLLM_DFLASH_IMPL", "fast", "VLLM_DFLASH_IMPL='fast' is not valid; use 'plugin' (default) or 'vllm'"),
    ("VLLM_DFLASH_VERIFIER", "mine", "VLLM_DFLASH_VERIFIER='mine' is not valid; use one of ('dflash', 'vllm')"),
    ("VLLM_DFLASH_NATIVE_OPS", "no", "VLLM_DFLASH_NATIVE_OPS='no' is not valid; use 1 or 0 (default 1)"),
    ("VLLM_DFLASH_BUILD_BACKEND", "make", "VLLM_DFLASH_BUILD_BACKEND='make': use 'cmake' or 'torch'"),
    ("VLLM_DFLASH_ADAPTIVE_SCHEDULE", "pause:3", "VLLM_DFLASH_ADAPTIVE_SCHEDULE='pause:3' is not valid; use 'jump' or"),
])
def test_bad_values_name_the_variable_and_the_fix(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(envs, name)


def test_unknown_name_is_an_attribute_error():
    name = "VLLM_DFLASH_" + "NO_SUCH_SWITCH"  # spelled in two parts: the scan above must not see it
    with pytest.raises(AttributeError, match=name):
        getattr(envs, name)
