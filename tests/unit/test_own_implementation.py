"""The plugin is its own DFlash: no module of vllm_dflash/ imports vLLM 0.32's in-tree one.

vLLM's in-tree DFlash is the rival the tests and the bench compare against, never code the
plugin runs. The register (vllm_dflash.patches) names in-tree symbols as strings (what the
profiler wraps on the rival, what drift tests resolve); those are not imports. vLLM itself
imports its in-tree DFlash from its own runner, which no plugin code controls; the plugin's
serving path (proposer, draft model, verifier, adaptive speculation) loads neither module,
nor vLLM's generic base proposer, whose module imports `qwen3_dflash`.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IN_TREE = ("vllm.v1.spec_decode.dflash", "vllm.model_executor.models.qwen3_dflash")


def _imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            yield str(node.args[0].value)


def test_no_plugin_module_imports_the_in_tree_dflash():
    offenders = []
    for path in sorted((ROOT / "vllm_dflash").rglob("*.py")):
        for name in _imported_modules(ast.parse(path.read_text(), str(path))):
            if any(name == m or name.startswith(m + ".") for m in IN_TREE):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == [], f"the plugin must not import vLLM's in-tree DFlash: {offenders}"


def test_the_scan_sees_each_import_form():
    source = ("import vllm.v1.spec_decode.dflash\n"
              "from vllm.model_executor.models import qwen3_dflash\n"
              "importlib.import_module('vllm.v1.spec_decode.dflash')\n")
    found = [n for n in _imported_modules(ast.parse(source))
             if any(n == m or n.startswith(m + ".") for m in IN_TREE)]
    assert found == ["vllm.v1.spec_decode.dflash", "vllm.model_executor.models.qwen3_dflash",
                     "vllm.v1.spec_decode.dflash"]


IMPORTER_PROBE = r"""
import builtins, importlib, json, pkgutil, sys
IN_TREE = ("vllm.v1.spec_decode.dflash", "vllm.model_executor.models.qwen3_dflash")
importers = []
real_import = builtins.__import__

def watching(name, globals=None, locals=None, fromlist=(), level=0):
    module = real_import(name, globals, locals, fromlist, level)
    by = (globals or {}).get("__name__", "?")
    wanted = [name] + [f"{name}.{f}" for f in (fromlist or ())]
    if level:  # relative: resolve against the importer's package
        base = ((globals or {}).get("__package__") or "").rsplit(".", level - 1)[0]
        wanted = [f"{base}.{name}" if name else base] + [f"{base}.{name}.{f}" if name else f"{base}.{f}"
                                                         for f in (fromlist or ())]
    if any(w == m or w.startswith(m + ".") for w in wanted for m in IN_TREE):
        importers.append(by)
    return module

builtins.__import__ = watching
real_import_module = importlib.import_module
def watching_module(name, package=None):
    if any(name == m or name.startswith(m + ".") for m in IN_TREE):
        importers.append(sys._getframe(1).f_globals.get("__name__", "?"))
    return real_import_module(name, package)
importlib.import_module = watching_module

from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_dflash")]
ep.load()()  # the plugin as vLLM loads it
import vllm_dflash
for info in pkgutil.walk_packages(vllm_dflash.__path__, "vllm_dflash."):
    if not info.name.startswith("vllm_dflash.reference"):  # torch-only, no vLLM
        importlib.import_module(info.name)
print(json.dumps(sorted(set(importers))))
"""


def test_at_run_time_only_vllm_imports_its_in_tree_dflash():
    """Loading the plugin and every vllm_dflash module, in a fresh process with the import
    machinery watched: the in-tree DFlash modules are imported, but only by vLLM's own
    modules (its runner), never by a plugin module; this sees
    dynamic imports the source scan above cannot."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", IMPORTER_PROBE], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    importers = json.loads(out.stdout.strip().splitlines()[-1])
    assert importers, "the probe saw no import of the in-tree DFlash at all: it is not watching"
    assert all(name.startswith("vllm.") for name in importers), importers


SERVING_PROBE = r"""
import json, sys
import vllm_dflash.serving.proposer, vllm_dflash.serving.draft_model, vllm_dflash.verifier, vllm_dflash.adaptive
print(json.dumps(sorted(m for m in sys.modules if m.startswith(IN_TREE + ("vllm.v1.spec_decode.llm_base_proposer",)))))
"""


def test_the_serving_path_loads_no_in_tree_dflash():
    """In a fresh process, the plugin's proposer, draft model, verifier and adaptive speculation
    load neither in-tree module, nor vLLM's generic base proposer (which imports qwen3_dflash);
    the probe sees the base proposer when something imports it."""
    import json
    import subprocess
    import sys

    def loaded(source: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", f"IN_TREE = {IN_TREE!r}\n" + source], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert loaded(SERVING_PROBE) == []
    assert loaded("import vllm.v1.spec_decode.llm_base_proposer\n" + SERVING_PROBE) == [
        "vllm.model_executor.models.qwen3_dflash", "vllm.v1.spec_decode.llm_base_proposer"]
