"""The plugin is its own DFlash: no module of vllm_dflash/ imports vLLM 0.32's in-tree one.

vLLM's in-tree DFlash is the rival the tests and the bench compare against, never code the
plugin runs. The register (vllm_dflash.patches) names in-tree symbols as strings (what the
profiler wraps on the rival, what drift tests resolve); those are not imports. vLLM itself
imports `qwen3_dflash` from its own base proposer and runner, which no plugin code controls.
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
