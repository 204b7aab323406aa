"""Every vLLM internal vllm_dflash.patches touches is still where, and shaped
how, the patch expects (fails loudly on a vLLM upgrade), and register() is
idempotent. No engine is started."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import vllm_dflash
from vllm_dflash import patches


def _params(fn) -> tuple[str, ...]:
    return tuple(inspect.signature(inspect.unwrap(fn)).parameters)


def test_vllm_version_is_the_one_patched():
    import vllm

    assert vllm.__version__.startswith(patches.VLLM_VERSION), (
        f"patches were written against vLLM {patches.VLLM_VERSION}, found {vllm.__version__}: "
        "re-check every entry of vllm_dflash.patches.PATCHES"
    )


# Names in the runner that patches rebind to our classes -> vLLM's own class.
ORIGINAL_CLASSES = {
    "DFlashProposer": ("vllm.v1.spec_decode.dflash", "DFlashProposer"),
    "RejectionSampler": ("vllm.v1.sample.rejection_sampler", "RejectionSampler"),
}


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: f"{p.module}.{p.symbol}")
def test_patched_symbol_exists_with_expected_signature(patch):
    target = patches._resolve(patch.module, patch.symbol)  # AttributeError: it moved
    if patch.symbol in ORIGINAL_CLASSES:
        # The runner's name may already point at ours: vLLM's class must still fit too.
        original = patches._resolve(*ORIGINAL_CLASSES[patch.symbol])
        assert _params(original.__init__) == patch.signature, f"vLLM's {patch.symbol} changed shape"
    if isinstance(target, type):
        target = target.__init__
    assert _params(target) == patch.signature, f"{patch.module}.{patch.symbol} changed shape"
    assert patch.why and patch.vllm_version == patches.VLLM_VERSION


def test_runner_builds_and_calls_the_drafter_as_the_patches_assume():
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from vllm_dflash.serving.proposer import DFlashProposer

    source = inspect.getsource(runner_module.GPUModelRunner)
    assert "self.drafter = DFlashProposer(self.vllm_config, self.device, self)" in source
    assert "self.drafter.propose(" in source and "self.drafter.dummy_run(" in source
    # Ours accepts every argument vLLM's base propose() takes, by the same names.
    assert _params(DFlashProposer.propose) == _params(SpecDecodeBaseProposer.propose)
    assert _params(DFlashProposer.dummy_run) == _params(SpecDecodeBaseProposer.dummy_run)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert issubclass(CPUModelRunner, runner_module.GPUModelRunner)  # one patch covers both


def test_engine_args_fields_the_config_patch_reads():
    from vllm.engine.arg_utils import EngineArgs

    fields = EngineArgs.__dataclass_fields__
    for name in ("speculative_config", "spec_method", "spec_model", "spec_tokens"):
        assert name in fields, f"EngineArgs.{name} is gone; update patches._complete_dflash_speculative_config"


def test_register_is_idempotent_and_installs_the_plugin():
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm import ModelRegistry
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dflash.serving.proposer import DFlashProposer

    if not patches.use_plugin_impl():
        pytest.skip("VLLM_DFLASH_IMPL=vllm in this environment")
    vllm_dflash.register()
    first = patches.applied()
    wrapped = (EngineArgs.create_speculative_config, VllmConfig._get_v2_model_runner_unsupported_features)
    vllm_dflash.register()
    patches.apply_all()  # even a direct second call changes nothing
    assert patches.applied() == first == patches.PATCHES
    assert (EngineArgs.create_speculative_config, VllmConfig._get_v2_model_runner_unsupported_features) == wrapped
    for fn in wrapped:  # wrapped exactly once
        assert getattr(fn, patches._MARK)
        assert not getattr(fn.__wrapped__, patches._MARK, False)
    assert runner_module.DFlashProposer is DFlashProposer
    from vllm_dflash.serving.draft_model import DFlashDraftForCausalLM

    assert ModelRegistry._try_load_model_cls("DFlashDraftModel") is DFlashDraftForCausalLM


def _run_register(impl: str) -> subprocess.CompletedProcess:
    code = (
        "import vllm_dflash, vllm.v1.worker.gpu_model_runner as r\n"
        "from vllm_dflash import patches\n"
        "vllm_dflash.register()\n"
        "print(r.DFlashProposer.__module__, len(patches.applied()))\n"
    )
    env = dict(os.environ, VLLM_DFLASH_IMPL=impl)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_impl_vllm_keeps_the_in_tree_dflash():
    proc = _run_register("vllm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, num_applied = proc.stdout.split()[-2:]
    assert module == "vllm.v1.spec_decode.dflash"
    assert int(num_applied) == sum(not p.plugin_only for p in patches.PATCHES)


def test_bad_impl_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(patches.IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="VLLM_DFLASH_IMPL='fast' is not valid; use 'plugin'"):
        patches.use_plugin_impl()


@pytest.mark.parametrize("internal", patches.ADAPTIVE_INTERNALS, ids=lambda i: f"{i.module}.{i.symbol}")
def test_internals_adaptive_speculation_reads_are_unchanged(internal):
    target = patches._resolve(internal.module, internal.symbol)  # AttributeError: it moved
    source = inspect.getsource(inspect.unwrap(target))
    assert internal.marker in source, (
        f"{internal.module}.{internal.symbol} no longer contains {internal.marker!r}: "
        f"re-check what vllm-dflash relies on ({internal.why})")
    assert internal.process in ("frontend", "engine", "worker") and internal.why and internal.how


def test_async_scheduling_is_read_after_the_speculative_config():
    """Patch 4 sets EngineArgs.async_scheduling for adaptive speculation while vLLM builds the config."""
    from vllm.engine.arg_utils import EngineArgs

    source = inspect.getsource(EngineArgs.create_engine_config)
    assert source.index("self.create_speculative_config(") < source.index("async_scheduling=self.async_scheduling")
