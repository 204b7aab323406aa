"""Every vLLM internal in the register (vllm_dflash.patches) is still where,
and shaped how, the plugin expects; register() installs the patches once.
No engine is started.

Per entry: the symbol resolves; an override, an implemented protocol method,
a patched name or a wrapped method takes exactly the recorded parameters (and
ours takes vLLM's); a called function still accepts the arguments we pass;
vLLM's code still calls an override, protocol method or patched name
(`used_by` / `usage`), so ours cannot silently stop being called; a mirrored rule's source still states it; read
attributes are still set by vLLM.

`._private` accesses found by grep (`grep -rnE "\\._[a-z]" vllm_dflash`)
and left out of the register on purpose: none on vLLM objects in
vllm_dflash/ (each one is an entry: the sampler's
_get_logprobs_tensors; the runner's _model_forward; the patched
_validate_spec_decode and _get_v2_model_runner_unsupported_features; the
mirrored _get_attn_isa). Not vLLM's: `torch.cpu._is_amx_tile_supported` and
`torch._C._dispatch_has_kernel_for_dispatch_key` (torch), `config._attn_implementation`
(transformers, zoo), `drafter._draft_tokens` (ours). In tests only, not in
the plugin: tests/ops/test_kv_layout_vllm.py calls vLLM's CPU kernel with
the layer attributes it reads (`_k_scale`, `_k_scale_float`, `_get_attn_isa`),
and tests/serving/test_serving_e2e.py counts preemptions through
`scheduler._preempt_request`; both tests fail on their own when these move
(no kernel output / `preemptions > 0` fails).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys

import pytest
from limits import HANG_GUARD_S

import vllm_dflash
from vllm_dflash import envs, patches
from vllm_dflash.patches.internal import MARK, VLLM_VERSION, resolve

EXACT_PARAMS = ("patch", "override", "implement", "wrap")


def _params(obj) -> tuple[str, ...]:
    if isinstance(obj, type):
        obj = obj.__init__
    return tuple(inspect.signature(inspect.unwrap(obj)).parameters)


def _sets_attribute(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    pattern = re.compile(rf"self\.{re.escape(name)}\b\s*(:[^=\n]*)?=[^=]|register_buffer\(\s*[\"']{re.escape(name)}[\"']")
    for klass in cls.__mro__:
        if klass.__module__.startswith("vllm.") and pattern.search(inspect.getsource(klass)):
            return True
    return False


def _source_object(obj):
    """What holds the source: on CPU vLLM's triton dispatcher replaces some Triton
    kernels by a KernelOverride routing to a native implementation (once the
    platform registers it, so it depends on what ran before); the restated rule
    is then read in the kernel's module, whose name the override keeps."""
    obj = inspect.unwrap(obj)
    if type(obj).__name__ == "KernelOverride":
        import importlib

        return importlib.import_module(obj.__module__)
    return obj


def test_vllm_version_is_the_one_the_register_describes():
    import vllm

    assert vllm.__version__.startswith(VLLM_VERSION), (
        f"the register was written against vLLM {VLLM_VERSION}, found {vllm.__version__}: "
        "re-check every entry of vllm_dflash.patches.REGISTER"
    )


def check_entry(entry) -> None:
    """AssertionError (or ImportError / AttributeError) when vLLM drifted from the entry."""
    assert entry.why and entry.how and entry.remove_when and entry.vllm_version == VLLM_VERSION
    if entry.kind == "read":
        owner = resolve(entry.symbol)
        assert entry.names and isinstance(owner, type)
        missing = [n for n in entry.names if not _sets_attribute(owner, n)]
        assert not missing, f"{entry.symbol} no longer has {missing}"
    obj = resolve(entry.original or entry.symbol)  # ImportError / AttributeError: it moved
    if entry.params is not None:
        params = _params(obj)
        if entry.kind in EXACT_PARAMS:
            assert params == entry.params, f"{entry.symbol} changed shape: {params}"
        else:
            missing = [p for p in entry.params if p not in params]
            assert not missing, f"{entry.symbol} no longer takes {missing}: {params}"
    if entry.returns is not None:
        assert obj() == entry.returns
    if entry.used_by is not None:
        source = inspect.getsource(resolve(entry.used_by))
        for usage in entry.usage or (f"{entry.qualname.rsplit('.', 1)[-1]}(",):
            assert usage in source, f"{entry.used_by} no longer does {usage!r}"
    if entry.source_has:
        source = inspect.getsource(_source_object(obj))
        for text in entry.source_has:
            assert text in source, f"{entry.symbol} no longer says {text!r}"
    if entry.ours is not None:
        ours = resolve(entry.ours)
        if entry.kind in ("override", "implement") or entry.original is not None:
            assert _params(ours) == entry.params, f"{entry.ours} takes {_params(ours)}, vLLM's {entry.params}"
            if entry.kind in ("override", "implement"):
                owner = resolve(entry.ours.rsplit(".", 1)[0])
                assert entry.qualname.rsplit(".", 1)[-1] in vars(owner), f"{entry.ours} no longer overrides it"


@pytest.mark.parametrize("entry", patches.REGISTER, ids=lambda e: f"{e.kind}:{e.symbol}")
def test_register_entry_matches_vllm(entry):
    check_entry(entry)


def _entry(symbol: str):
    return next(e for e in patches.REGISTER if e.symbol == symbol)


BASE = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"


@pytest.mark.parametrize("change, message", [
    # vLLM renamed the protocol method: ours would never be called again.
    (dict(symbol=f"{BASE}.initialise_attn_backend"), "initialise_attn_backend"),
    # vLLM's runner stopped calling it that way.
    (dict(usage=("self.drafter.initialize_attn_backend(kv_cache_config)",)), "no longer does"),
    # vLLM added a parameter.
    (dict(params=("self", "kv_cache_config", "kernel_block_sizes", "prefix")), "changed shape"),
    # ours takes other parameters (a typo in our class).
    (dict(ours="vllm_dflash.serving.drafter_base:DrafterBase.load_model"), "takes"),
])
def test_check_catches_drift(change, message):
    entry = dataclasses.replace(_entry(f"{BASE}.initialize_attn_backend"), **change)
    with pytest.raises((AssertionError, AttributeError), match=message):
        check_entry(entry)


def test_check_catches_a_changed_mirror_and_a_lost_attribute():
    mirror = _entry("vllm.v1.attention.backends.cpu_attn:_get_attn_isa")
    with pytest.raises(AssertionError, match="no longer says"):
        check_entry(dataclasses.replace(mirror, source_has=('return "amx512"',)))
    read = _entry("vllm.config.speculative:SpeculativeConfig")
    with pytest.raises(AssertionError, match="no longer has"):
        check_entry(dataclasses.replace(read, names=("disable_padded_drafter_batches",)))


def test_register_entries_are_unique_and_complete():
    keys = [(e.symbol, e.kind) for e in patches.REGISTER]
    assert len(keys) == len(set(keys))
    assert {e.kind for e in patches.REGISTER} == set(patches.KINDS)
    assert all(e.install is not None for e in patches.PATCHES)


def test_runner_subclass_is_covered_by_the_runner_patches():
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert issubclass(CPUModelRunner, runner_module.GPUModelRunner)  # one patch covers both


def test_register_is_idempotent_and_installs_the_plugin():
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm import ModelRegistry
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dflash.serving.draft_model import DFlashDraftForCausalLM
    from vllm_dflash.serving.proposer import DFlashProposer

    if not envs.use_plugin_impl():
        pytest.skip("VLLM_DFLASH_IMPL=vllm in this environment")
    vllm_dflash.register()
    first = patches.applied()
    wrapped = (EngineArgs.create_speculative_config, VllmConfig._get_v2_model_runner_unsupported_features,
               runner_module.build_logitsprocs)
    vllm_dflash.register()
    patches.apply_all()  # even a direct second call changes nothing
    assert patches.applied() == first == patches.PATCHES
    assert (EngineArgs.create_speculative_config, VllmConfig._get_v2_model_runner_unsupported_features,
            runner_module.build_logitsprocs) == wrapped
    for fn in wrapped:  # wrapped exactly once
        assert getattr(fn, MARK)
        assert not getattr(fn.__wrapped__, MARK, False)
    assert runner_module.DFlashProposer is DFlashProposer
    assert ModelRegistry._try_load_model_cls("DFlashDraftModel") is DFlashDraftForCausalLM


def test_model_runner_of_needs_an_vllm_engine():
    assert patches.model_runner_of(object()) is None


def test_register_prints_as_a_table():
    proc = subprocess.run([sys.executable, "-m", "vllm_dflash.patches"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| `")]
    assert len(rows) == len(patches.REGISTER)


def _run_register(impl: str) -> subprocess.CompletedProcess:
    code = (
        "import vllm_dflash, vllm.v1.worker.gpu_model_runner as r\n"
        "from vllm_dflash import patches\n"
        "vllm_dflash.register()\n"
        "print(r.DFlashProposer.__module__, len(patches.applied()))\n"
    )
    import os

    env = dict(os.environ, VLLM_DFLASH_IMPL=impl)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_impl_vllm_keeps_the_in_tree_dflash():
    proc = _run_register("vllm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, num_applied = proc.stdout.split()[-2:]
    assert module == "vllm.v1.spec_decode.dflash"
    assert int(num_applied) == sum(not p.plugin_only for p in patches.PATCHES)


def test_bad_impl_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH_IMPL", "fast")
    with pytest.raises(ValueError, match="VLLM_DFLASH_IMPL='fast' is not valid; use 'plugin'"):
        envs.use_plugin_impl()


def test_vllm_fixes_say_where_why_upstream_and_when_to_go():
    """The vLLM bug fixes act in the worker with or without DFlash, and each names
    its upstream reference and the test that tells when it can go."""
    from vllm_dflash.patches import vllm_fixes

    patches = [e for e in vllm_fixes.ENTRIES if e.kind == "patch"]
    assert patches
    for patch in patches:
        assert patch.process == ("worker",) and not patch.plugin_only, patch.symbol
        assert "vllm-project/vllm" in patch.upstream and "test_vllm_still_rewinds_by_offset" in patch.remove_when


def test_mirror_check_reads_a_kernel_vllm_replaced_for_this_platform(monkeypatch):
    """On CPU vLLM swaps some Triton kernels for a KernelOverride once an engine has
    started in the process; the mirror check must still find the rule it restates."""
    import vllm.v1.spec_decode.utils as spec_utils
    from vllm.triton_utils.dispatcher import KernelOverride

    entry = _entry("vllm.v1.spec_decode.utils:eagle_prepare_inputs_padded_kernel")
    kernel = spec_utils.eagle_prepare_inputs_padded_kernel
    if type(kernel).__name__ != "KernelOverride":
        monkeypatch.setattr(spec_utils, "eagle_prepare_inputs_padded_kernel",
                            KernelOverride(kernel, lambda *args, **kwargs: None))
    check_entry(entry)
    with pytest.raises(AssertionError, match="no longer says"):
        check_entry(dataclasses.replace(entry, source_has=("num_rejected_tokens = valid_count",)))
