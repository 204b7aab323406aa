"""Reference DFlash draft model: semantics against a naive re-derivation, the
context-K/V cache, masks, target features and z-lab checkpoint I/O."""

import json
import math

import pytest
import torch
from helpers import random_draft, tiny_target
from safetensors.torch import load_file, save_file

from vllm_dflash.reference import TargetFeatures, load_draft, new_draft_config, save_draft
from vllm_dflash.reference.model import DFlashDraftModel



@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target, num_layers=2, block_size=8, target_layer_ids=[0, 2, 3])


def _inputs(draft, c=11, q=8, b=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = draft.config.hidden_size
    feats = torch.randn(b, c, draft.fc.in_features, generator=gen)
    noise = torch.randn(b, q, d, generator=gen)
    return feats, noise


# --- semantics ---------------------------------------------------------------


def _naive_rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _naive_rope(x, pos, theta):
    """x [n, H, d] rotated by absolute positions pos [n]; neox halves."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        for j in range(d // 2):
            angle = pos[t].item() / theta ** (2 * j / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, :, j], x[t, :, j + d // 2]
            out[t, :, j], out[t, :, j + d // 2] = a * c - b * s, b * c + a * s
    return out


def _naive_draft(draft, feats, noise, positions):
    """Re-derivation of DFlash from its description, one head at a time (batch 1)."""
    cfg = draft.config
    eps, theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = _naive_rms(feats[0] @ draft.fc.weight.T, draft.hidden_norm.weight, eps)
    c = ctx.shape[0]
    x = noise[0]
    for layer in draft.layers:
        a = layer.self_attn
        h = _naive_rms(x, layer.input_layernorm.weight, eps)
        q = _naive_rms((h @ a.q_proj.weight.T).view(-1, H, d), a.q_norm.weight, eps)
        kv_in = torch.cat([ctx, h])  # context is NOT passed through input_layernorm
        k = _naive_rms((kv_in @ a.k_proj.weight.T).view(-1, Hkv, d), a.k_norm.weight, eps)
        v = (kv_in @ a.v_proj.weight.T).view(-1, Hkv, d)
        q, k = _naive_rope(q, positions[c:], theta), _naive_rope(k, positions, theta)
        heads = []
        for head in range(H):
            kv_head = head // (H // Hkv)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(d)  # no causal mask
            heads.append(torch.softmax(scores, -1) @ v[:, kv_head])
        x = x + torch.cat(heads, -1) @ a.o_proj.weight.T
        m = layer.mlp
        h = _naive_rms(x, layer.post_attention_layernorm.weight, eps)
        x = (
            x
            + (torch.nn.functional.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T))
            @ m.down_proj.weight.T
        )
    return _naive_rms(x, draft.norm.weight, eps)[None]


def test_forward_matches_naive_derivation(draft):
    feats, noise = _inputs(draft, c=6, q=5)
    positions = torch.arange(3, 3 + 6 + 5)  # absolute positions need not start at 0
    with torch.no_grad():
        got = draft(noise, draft.project_context(feats), positions[None])
        want = _naive_draft(draft, feats, noise, positions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_context_kv_is_normed_and_rotated(draft):
    feats, _ = _inputs(draft, c=7)
    positions = torch.arange(7)
    with torch.no_grad():
        ctx = draft.project_context(feats)
        (k, v), _ = draft.context_kv(ctx, positions[None])
    attn = draft.layers[0].self_attn
    cfg = draft.config
    raw_k = (ctx[0] @ attn.k_proj.weight.T).view(7, cfg.num_key_value_heads, cfg.head_dim)
    want_k = _naive_rope(
        _naive_rms(raw_k, attn.k_norm.weight, cfg.rms_norm_eps),
        positions,
        cfg.rope_parameters["rope_theta"],
    )
    assert k.shape == (1, 7, cfg.num_key_value_heads, cfg.head_dim)
    torch.testing.assert_close(k[0], want_k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v[0], (ctx[0] @ attn.v_proj.weight.T).view_as(v[0]))


def test_block_sees_context_and_both_directions(draft):
    feats, noise = _inputs(draft, c=6, q=4)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        ctx = draft.project_context(feats)
        base = draft(noise, ctx, pos)
        changed_ctx = ctx.clone()
        changed_ctx[:, 0] += 1.0
        changed_last = noise.clone()
        changed_last[:, -1] += 1.0
        out_ctx = draft(noise, changed_ctx, pos)
        out_last = draft(changed_last, ctx, pos)
    # Every block slot depends on the first context token and on the last block slot.
    assert (out_ctx - base).abs().amax(-1).min() > 1e-4
    assert (out_last - base)[:, :-1].abs().amax(-1).min() > 1e-4


def test_incremental_context_cache_equals_full_context(draft):
    """Rounds with cached context K/V == one forward over the whole context."""
    feats, _ = _inputs(draft, c=24)
    gen = torch.Generator().manual_seed(1)
    B = draft.block_size
    cache = draft.new_kv_cache()
    start = 0
    with torch.no_grad():
        for chunk in (9, 1, 5, 3, 6):
            noise = torch.randn(1, B, draft.config.hidden_size, generator=gen)
            new = feats[:, start : start + chunk]
            start += chunk
            cached = draft(
                noise,
                draft.project_context(new),
                torch.arange(start - chunk, start + B)[None],
                kv_cache=cache,
            )
            full = draft(
                noise, draft.project_context(feats[:, :start]), torch.arange(start + B)[None]
            )
            assert cache.length == start
            torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
        cache.crop(10)
        assert cache.length == 10 and all(k.shape[1] == 10 for k in cache.keys)


def test_boolean_mask_equals_dropping_keys(draft):
    """A mask hiding context tokens == those tokens absent (positions kept)."""
    feats, noise = _inputs(draft, c=8, q=4, b=2)
    keep = torch.tensor([0, 1, 2, 5, 6, 7])
    pos = torch.arange(12)[None]
    mask = torch.ones(1, 1, 4, 12, dtype=torch.bool)
    mask[..., [3, 4]] = False
    with torch.no_grad():
        ctx = draft.project_context(feats)
        masked = draft(noise, ctx, pos, attn_mask=mask)
        dropped = draft(noise, ctx[:, keep], torch.cat([keep, torch.arange(8, 12)])[None])
        all_true = draft(noise, ctx, pos, attn_mask=torch.ones_like(mask))
        unmasked = draft(noise, ctx, pos)
    torch.testing.assert_close(masked, dropped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(all_true, unmasked)
    assert (masked - unmasked).abs().max() > 1e-3


def test_flex_block_mask_equals_boolean_mask(draft):
    """Training passes a flex-attention BlockMask on GPU; it must mean the same as SDPA's."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask

    feats, noise = _inputs(draft, c=8, q=4, b=2)
    pos = torch.arange(12)[None]
    bool_mask = torch.ones(1, 1, 4, 12, dtype=torch.bool)
    bool_mask[..., [3, 4]] = False
    bool_mask[..., 0, 11] = False  # first block slot does not see the last one
    block_mask = create_block_mask(
        lambda b, h, q, kv: bool_mask[0, 0, q, kv], B=None, H=None, Q_LEN=4, KV_LEN=12, device="cpu"
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # eager flex attention on CPU warns that it is for debugging
        ctx = draft.project_context(feats)
        want = draft(noise, ctx, pos, attn_mask=bool_mask)
        got = draft(noise, ctx, pos, attn_mask=block_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise(draft):
    feats, noise = _inputs(draft, c=4, q=3)
    with pytest.raises(
        ValueError, match=r"expects 192 = 3 target layers \[0, 2, 3\] x hidden_size 64"
    ):
        draft.project_context(feats[..., :64])
    with pytest.raises(ValueError, match=r"expected context \(4\) \+ block \(3\) = 7"):
        draft(noise, draft.project_context(feats), torch.arange(6)[None])


def test_bfloat16_keeps_float32_rope(draft):
    feats, noise = _inputs(draft, c=50, q=8)
    pos = torch.arange(1000, 1058)[None]  # large positions: rounded frequencies would show
    bf16 = DFlashDraftModel(draft.config)
    bf16.load_state_dict(draft.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    assert bf16.layers[0].self_attn.rotary.inv_freq.dtype == torch.float32
    with torch.no_grad():
        want = draft(noise, draft.project_context(feats), pos)
        got = bf16(noise.bfloat16(), bf16.project_context(feats.bfloat16()), pos).float()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99, cos.min()


# --- target features ---------------------------------------------------------


def test_target_features_are_pre_norm_residual_stream(target):
    ids = torch.randint(0, 255, (1, 9))
    with torch.no_grad(), TargetFeatures(target, [0, 2, 3]) as features:
        out = target(ids, output_hidden_states=True)
        feats = features.pop()
    hs = out.hidden_states
    d = target.config.hidden_size
    torch.testing.assert_close(feats[..., :d], hs[1])
    torch.testing.assert_close(feats[..., d : 2 * d], hs[3])
    # Last layer: transformers' hidden_states[-1] is final-normed; ours is the residual stream.
    last = feats[..., 2 * d :]
    assert not torch.allclose(last, hs[4])
    torch.testing.assert_close(target.model.norm(last), hs[4])
    with torch.no_grad():
        target(ids)  # hooks are gone after the with-block: nothing is recorded
    with pytest.raises(RuntimeError, match="no target forward"):
        features.pop()


# --- checkpoints -------------------------------------------------------------


def _expected_tensor_names(num_layers):
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names.add(f"layers.{i}.self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"layers.{i}.mlp.{proj}.weight")
        names.add(f"layers.{i}.input_layernorm.weight")
        names.add(f"layers.{i}.post_attention_layernorm.weight")
    return names


def test_zlab_round_trip(tmp_path, target, draft):
    save_draft(draft, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == _expected_tensor_names(2)
    assert tensors["fc.weight"].shape == (64, 3 * 64)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [0, 2, 3]}
    assert config["block_size"] == 8 and config["num_target_layers"] == 4
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32" == config["dtype"]
    for key in (
        "hidden_size",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(target.config, key), key
    assert (
        config["rope_parameters"]["rope_theta"]
        == config["rope_theta"]
        == target.config.rope_parameters["rope_theta"]
    )
    assert (
        config["num_hidden_layers"] == 2
        and config["intermediate_size"] == target.config.intermediate_size
    )

    loaded = load_draft(tmp_path, target_config=target.config)
    feats, noise = _inputs(draft)
    pos = torch.arange(19)[None]
    with torch.no_grad():
        assert torch.equal(
            draft(noise, draft.project_context(feats), pos),
            loaded(noise, loaded.project_context(feats), pos),
        )


def test_bfloat16_checkpoint_keeps_dtype(tmp_path, draft):
    save_draft(draft, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_draft(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.fc.weight, draft.fc.weight.bfloat16())
    assert load_draft(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32


def test_load_rejects_wrong_tensor_names(tmp_path, draft):
    save_draft(draft, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["embed_tokens.weight"] = torch.zeros(256, 64)
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError) as err:
        load_draft(tmp_path)
    assert "missing tensors ['layers.1.mlp.up_proj.weight']" in str(err.value)
    assert "unexpected tensors ['embed_tokens.weight']" in str(err.value)


def test_load_rejects_wrong_shapes_and_mismatched_target(tmp_path, draft):
    save_draft(draft, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["fc.weight"] = tensors["fc.weight"][:, :128].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc.weight: \(64, 128\) != \(64, 192\)"):
        load_draft(tmp_path)
    other = tiny_target("qwen3", num_layers=2)
    with pytest.raises(
        ValueError, match=r"target_layer_ids\[1\]=2 is out of range .* use ids in \[0, 1\]"
    ):
        load_draft(tmp_path, target_config=other.config)
    with pytest.raises(ValueError, match="no config.json"):
        load_draft(tmp_path / "nowhere")


def test_new_draft_config_copies_target(target):
    llama = tiny_target("llama", num_layers=36, hidden_size=64)
    cfg = new_draft_config(llama.config, num_layers=5, block_size=16, mask_token_id=7)
    assert cfg.dflash_config == {"mask_token_id": 7, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert cfg.num_target_layers == 36 and cfg.architectures == ["DFlashDraftModel"]
    for key in (
        "hidden_size",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "intermediate_size",
        "rope_parameters",
    ):
        assert getattr(cfg, key) == getattr(llama.config, key), key
    cfg = new_draft_config(
        target.config,
        num_layers=1,
        block_size=4,
        mask_token_id=0,
        num_features=3,
        intermediate_size=96,
    )
    assert (
        cfg.dflash_config["target_layer_ids"] == [1] and cfg.intermediate_size == 96
    )  # z-lab rule, deduped
    with pytest.raises(ValueError, match="mask_token_id=256"):
        new_draft_config(target.config, num_layers=1, block_size=4, mask_token_id=256)
