"""--autocast auto: bf16 only where the device computes it natively, fp32 elsewhere, with the reason."""

import pytest
import torch

from vllm_dflash import precision


@pytest.fixture
def x86(monkeypatch):
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")


def cpu_flags(monkeypatch, amx: bool, avx512_bf16: bool):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def no_probe(monkeypatch):
    def fail(*args):
        raise AssertionError("an x86 CPU is decided from its flags, without a probe")

    monkeypatch.setattr(precision, "_seconds_per_matmul", fail)


@pytest.mark.parametrize("amx,avx512_bf16,word", [(True, False, "AMX"), (False, True, "AVX512_BF16")])
def test_x86_cpu_with_native_bf16_gets_bf16(monkeypatch, x86, amx, avx512_bf16, word):
    cpu_flags(monkeypatch, amx, avx512_bf16)
    no_probe(monkeypatch)
    p = precision.resolve("auto", "cpu")
    assert p.name == "bf16" and p.dtype == torch.bfloat16 and word in p.reason


def test_x86_cpu_without_native_bf16_gets_fp32(monkeypatch, x86):
    cpu_flags(monkeypatch, False, False)
    no_probe(monkeypatch)
    p = precision.resolve("auto", "cpu")
    assert p.name == "fp32" and p.dtype == torch.float32
    assert p.describe() == "fp32 (CPU has neither AMX nor AVX512_BF16: bf16 matrix products would be emulated)"
    asked = precision.resolve("bf16", "cpu")   # an explicit choice is kept, with the warning in its reason
    assert asked.name == "bf16" and "slow here" in asked.reason
    assert precision.resolve("fp32", "cpu").name == "fp32"
    assert precision.model_dtype(torch.bfloat16, p) == torch.float32
    assert precision.model_dtype(torch.bfloat16, asked) == torch.bfloat16
    assert precision.model_dtype(torch.float32, asked) == torch.float32


@pytest.mark.parametrize("bf16_seconds,expected", [(0.5, "bf16"), (8.0, "fp32")])
def test_other_cpus_are_probed(monkeypatch, bf16_seconds, expected):
    monkeypatch.setattr(precision.platform, "machine", lambda: "aarch64")
    timings = {torch.bfloat16: bf16_seconds, torch.float32: 1.0}
    monkeypatch.setattr(precision, "_seconds_per_matmul", lambda dtype, device, **kw: timings[dtype])
    p = precision.resolve("auto", "cpu")
    assert p.name == expected and f"{bf16_seconds:.2f}x the fp32 time" in p.reason


def test_the_probe_times_both_dtypes_for_real():
    seconds = precision._seconds_per_matmul(torch.float32, torch.device("cpu"), size=32, budget=0.01)
    assert 0 < seconds < 1


@pytest.mark.parametrize("supported,expected", [(True, "bf16"), (False, "fp32")])
def test_cuda_follows_is_bf16_supported(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    p = precision.resolve("auto", "cuda")
    assert p.name == expected and "Test GPU" in p.reason


def test_bad_choice_names_the_options():
    with pytest.raises(ValueError, match="autocast='fp16': choose one of auto, bf16, fp32"):
        precision.resolve("fp16", "cpu")


def test_trainer_and_cli_take_the_decision(monkeypatch, x86, tmp_path):
    """The trainer's autocast and the CLI's target / generation / feature dtypes follow the same rule."""
    import argparse

    from helpers import random_draft, tiny_target
    from vllm_dflash.training import cli
    from vllm_dflash.training.data import Sample
    from vllm_dflash.training.features import build_feature_cache
    from vllm_dflash.training.trainer import TrainConfig, Trainer

    target = tiny_target(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    draft = random_draft(target, num_layers=1, block_size=4)
    cache = build_feature_cache(target, [Sample(list(range(5, 30)), 4)] * 4, list(draft.target_layer_ids),
                                str(tmp_path / "f"))
    target.to(torch.bfloat16).save_pretrained(tmp_path / "t")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--target", str(tmp_path / "t"), "--out", str(tmp_path)])
    for native in (False, True):
        cpu_flags(monkeypatch, native, False)
        trainer = Trainer(draft, target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                          cache, TrainConfig(max_steps=1, batch_size=2), str(tmp_path / "run"))
        assert trainer.precision.bf16 is native
        prec = precision.resolve("auto", "cpu")
        assert cli.generation_dtype(args, prec) == ("auto" if native else "float32")
        loaded = cli.load_target(args, torch.device("cpu"), prec)
        assert next(loaded.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
        assert cli.feature_dtype(args, loaded) == ("bf16" if native else "fp32")   # stored as computed
