"""Mixtral, Qwen3-MoE and OLMoE against transformers, through the real converter, on tiny random models.

One row of `FAMILIES` per family: a few experts, top 2 or 4, and what the family does differently
(Mixtral: a window on every layer; Qwen3-MoE: a dense layer between two sparse ones, renormalised
top-k; OLMoE: QK norm over the whole projections, top-k not renormalised). For each row:

- float32 logits equal transformers' within 1e-5, and every layer routes every token to the same
  experts (recorded on both sides while the logits are computed);
- 40 greedy tokens through the toolkit's KV cache equal `generate`;
- the router's load-balancing loss equals transformers' `aux_loss` for the same batch;
- both layouts transformers 5.23 writes (its default, per-expert tensors as on the hub, and
  `save_original_format=False`, its in-memory 3-D expert tensors) convert to the same toolkit weights;
- converted back, every tensor is bit-identical to the hub layout, `from_pretrained` loads it and
  the config reads back the same;
- in bfloat16 (the published checkpoints' dtype) the conversion keeps every weight's bits and the
  logits stay close to transformers' bfloat16 logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import save_file

from parity import assert_greedy_generation_equals, assert_packed_row_equals_samples_alone, assert_round_trip
from parity import safetensors_in
from toolkit.convert import config_from_hf, config_to_hf, convert_from_hf, convert_to_hf
from toolkit.convert import weight_maps
from toolkit.errors import UserError
from toolkit.model_dir import load_model
from toolkit.models.config import Config
from toolkit.models.gpt import count_parameters
from toolkit.models.moe import moe_layers, router_losses
from toolkit.models.presets import PRESETS

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, max_position_embeddings=256, initializer_range=0.2, num_experts_per_tok=2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
WINDOW = 16  # shorter than the test sequences
PROMPT, NEW_TOKENS = 24, 40

# name -> (transformers config class, model class, config values beside TINY)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, head_dim=16, sliding_window=WINDOW)),
    # layer 1 dense (mlp_only_layers), experts narrower than the dense MLP, per-head QK norm
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, mlp_only_layers=[1],
        head_dim=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False)),
}


def hf_config(name: str, **changes) -> "transformers.PretrainedConfig":
    config_cls, _, extra = FAMILIES[name]
    return getattr(transformers, config_cls)(**{**TINY, **extra, **changes})


def hf_model(name: str):
    """A random transformers model in eval mode, float32, norms away from their init of 1."""
    _, model_cls, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(hf_config(name)).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(name, transformers model, folder: hf/ (hub layout) and toolkit/, the converted toolkit model)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    model = hf_model(name)
    model.save_pretrained(tmp / "hf")  # transformers 5 writes the hub's per-expert layout by default
    assert any(".experts.0." in key for key in safetensors_in(tmp / "hf")), "expected one tensor per expert"
    convert_from_hf(tmp / "hf", tmp / "toolkit")
    return name, model, tmp, load_model(tmp / "toolkit").eval()


def record_routing(hf, ours):
    """Record each MoE layer's chosen experts (N, K) on both sides: transformers' router modules return
    them (a forward hook keeps them); the toolkit's `MoE.route` is wrapped to keep what it returns.
    Returns (theirs, ours, a function that stops the recording)."""
    theirs, mine = [], []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: theirs.append(out[2].detach()))
             for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    layers = moe_layers(ours)
    for layer in layers:
        def route(x, _route=layer.route):
            result = _route(x)
            mine.append(result[2].detach())
            return result
        layer.route = route

    def stop():
        for hook in hooks:
            hook.remove()
        for layer in layers:
            del layer.route  # back to the class's method

    return theirs, mine, stop


def test_logits_and_the_chosen_experts_equal_transformers(converted):
    name, hf, _, ours = converted
    ids = torch.randint(0, TINY["vocab_size"], (2, PROMPT + NEW_TOKENS), generator=torch.Generator().manual_seed(1))
    theirs, mine, stop = record_routing(hf, ours)
    try:
        with torch.no_grad():
            expected, got = hf(ids).logits, ours(ids)
    finally:
        stop()
    assert expected.abs().max() > 0.5, "degenerate reference"
    assert (got - expected).abs().max().item() <= 1e-5, name
    n_moe = sum(ours.config.layer(i).moe for i in range(ours.config.n_layer))
    assert len(theirs) == len(mine) == n_moe > 0
    for layer, (a, b) in enumerate(zip(theirs, mine)):
        assert a.shape == b.shape == (ids.numel(), ours.config.n_expert_per_token)
        assert torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values), (name, layer)
    used = torch.cat(mine).unique().numel()
    assert used == ours.config.n_expert, "every expert should take some tokens"


def test_greedy_generation_through_the_cache_equals_generate(converted):
    name, hf, _, ours = converted
    # seed 4: a prompt after which every family's greedy tokens vary (after seed 2's, Qwen3-MoE's settle)
    prompt = torch.randint(0, TINY["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(4))
    assert_greedy_generation_equals(hf, ours, prompt, NEW_TOKENS, name)


def test_router_aux_loss_equals_transformers(converted):
    name, hf, _, ours = converted
    ids = torch.randint(0, TINY["vocab_size"], (3, 29), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(ids, output_router_logits=True).aux_loss
        ours(ids)
    losses = router_losses(moe_layers(ours))
    assert expected > 0
    torch.testing.assert_close(losses.aux, expected.float(), rtol=1e-6, atol=1e-6, msg=name)
    assert ours.config.router_aux_loss_coef == hf.config.router_aux_loss_coef


def test_a_packed_row_gives_each_sample_its_own_logits(converted):
    name, _, _, ours = converted
    first, second = (torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
                     for n in (PROMPT + 5, PROMPT + 11))
    assert_packed_row_equals_samples_alone(ours, first, second, name)


def test_transformers_in_memory_layout_converts_to_the_same_weights(converted):
    name, hf, tmp, _ = converted
    hf.save_pretrained(tmp / "hf-fused", save_original_format=False)
    stored = safetensors_in(tmp / "hf-fused")
    assert any(key.endswith("mlp.experts.gate_up_proj") for key in stored)
    assert not any(".experts.0." in key for key in stored)
    convert_from_hf(tmp / "hf-fused", tmp / "toolkit-fused")
    per_expert, fused = safetensors_in(tmp / "toolkit"), safetensors_in(tmp / "toolkit-fused")
    assert set(per_expert) == set(fused)
    for key, tensor in per_expert.items():
        assert torch.equal(fused[key], tensor), (name, key)
    config = Config.from_file(tmp / "toolkit")
    assert Config.from_file(tmp / "toolkit-fused").replace(name=config.name) == config


def test_the_round_trip_is_bit_identical_and_loads_in_transformers(converted):
    name, hf, tmp, _ = converted
    ids = torch.randint(0, TINY["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(3))
    assert_round_trip(hf, tmp, ids, name)


def test_export_says_that_the_router_z_loss_coefficient_is_left_out(converted, tmp_path, capsys):
    _, _, tmp, _ = converted
    shutil.copytree(tmp / "toolkit", tmp_path / "z")
    config = json.loads((tmp_path / "z" / "model_config.json").read_text())
    (tmp_path / "z" / "model_config.json").write_text(json.dumps({**config, "router_z_loss_coef": 0.001}))
    convert_to_hf(tmp_path / "z", tmp_path / "hf")
    assert "Note: router_z_loss_coef 0.001 (a training setting) has no field" in capsys.readouterr().out
    assert "router_z_loss_coef" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_bfloat16_checkpoints_keep_their_bits_and_logits_stay_close(converted):
    """In bf16 the two implementations round differently (the order of sums, the grouped products),
    and a token whose K-th and (K+1)-th experts score within rounding of each other may route
    differently, so the logits agree to bf16's precision only. Tolerance, against the float32 model:
    the toolkit's bf16 logits are off by at most 1.5 times as much (mean absolute difference) as
    transformers' own bf16 logits are (measured: 1.0x Mixtral, 1.0x Qwen3-MoE, 1.25x OLMoE)."""
    name, hf, tmp, _ = converted
    model = hf_model(name).to(torch.bfloat16)
    model.save_pretrained(tmp / "hf-bf16")
    convert_from_hf(tmp / "hf-bf16", tmp / "toolkit-bf16")
    ours = load_model(tmp / "toolkit-bf16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    convert_to_hf(tmp / "toolkit-bf16", tmp / "export-bf16")
    original, exported = safetensors_in(tmp / "hf-bf16"), safetensors_in(tmp / "export-bf16")
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(exported[key], tensor), (name, key)
    ids = torch.randint(0, TINY["vocab_size"], (2, PROMPT + NEW_TOKENS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact, theirs, got = hf(ids).logits, model(ids).logits.float(), ours(ids).float()
    their_error = (theirs - exact).abs().mean()
    assert 0 < their_error < 0.1 * exact.abs().mean(), "bf16 should be close to float32"
    assert (got - exact).abs().mean() <= 1.5 * their_error, name


# ------------------------------------------------------------------------------ configs and presets


@pytest.mark.parametrize("name, changes, field", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("mixtral", dict(hidden_act="gelu"), "Unsupported activation 'gelu'"),
    ("mixtral", dict(num_local_experts=4, num_experts=6), "num_local_experts and num_experts differ"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared experts"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("olmoe", dict(head_dim=32), "head_dim"),
])
def test_a_config_the_toolkit_cannot_reproduce_is_refused_in_one_line(name, changes, field):
    values = hf_config(name).to_dict()
    config_from_hf(values)  # the row itself converts
    with pytest.raises(UserError, match=field) as err:
        config_from_hf({**values, **changes})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("preset, changes, field", [
    ("debug-mixtral", dict(moe_layers=[0]), "moe_layers"),
    ("debug-mixtral", dict(router_norm_topk=False), "router_norm_topk"),
    ("debug-olmoe", dict(qk_norm="head"), "qk_norm"),
    ("debug-qwen3-moe", dict(sliding_window=8, layer_types=["local", "global", "local"]), "layer_types"),
    # a dense family's export would lose the experts
    ("debug", dict(n_expert=4, n_expert_per_token=2), "n_expert"),
])
def test_export_refuses_what_the_family_cannot_express(preset, changes, field):
    config_to_hf(Config.from_name(preset))
    with pytest.raises(UserError, match=field) as err:
        config_to_hf(Config.from_name(preset, **changes))
    assert "\n" not in str(err.value)


def test_qwen3_moe_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    """transformers' rule: layer i is sparse unless listed in mlp_only_layers, and when (i + 1) % step == 0."""
    values = hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]).to_dict()
    config = config_from_hf(values)
    model = transformers.Qwen3MoeForCausalLM(hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                                        mlp_only_layers=[3]))
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == [1, 5] == config.moe_layers
    back = config_to_hf(config)
    assert back["mlp_only_layers"] == [0, 2, 3, 4] and back["decoder_sparse_step"] == 1
    assert config_from_hf(back) == config


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.get("family") in ("mixtral", "qwen3_moe", "olmoe")],
                         ids=lambda p: p["name"])
def test_moe_presets_export_to_transformers_models_of_exactly_their_size(preset):
    """Each preset's config.json builds transformers' own model (on the meta device) with exactly the
    toolkit's parameter count, and reads back as the preset."""
    config = Config.from_name(preset["name"])
    hf = config_to_hf(config)
    built = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(built)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == count_parameters(config) == preset.get("expected_params", counted)
    assert config_from_hf(json.loads(json.dumps(hf))).replace(name=config.name, hf_repo_id=config.hf_repo_id) == config


def test_published_mixtral_config_names_its_preset():
    # mistralai/Mixtral-8x7B-v0.1's config.json as published (transformers 4.36 layout)
    published = {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
        "use_cache": True, "vocab_size": 32000,
    }
    config = config_from_hf(published, default_name="mistralai/Mixtral-8x7B-v0.1")
    assert config.name == "mixtral-8x7b" and config.sliding_window is None and config.router_aux_loss_coef == 0.02


# ------------------------------------------------------------------------------ checkpoints that do not fit


def test_a_missing_expert_and_a_doubly_given_one_are_named_in_one_line(converted, tmp_path):
    name, hf, tmp, _ = converted
    stored = safetensors_in(tmp / "hf")
    lacking = next(key for key in stored if ".experts.1." in key)
    fused = safetensors_in(_fused(hf, tmp))
    lacking_fused = next(key for key in fused if ".experts." in key and not key.endswith("bias"))
    for folder, state, message in (
        ("lacking", {k: v for k, v in stored.items() if k != lacking}, f"lacks weight '{lacking}'"),
        # in the fused layout, the fused tensor is named
        ("lacking-fused", {k: v for k, v in fused.items() if k != lacking_fused}, f"lacks weight '{lacking_fused}'"),
        # the per-expert tensors and transformers' 3-D ones for the same layer
        ("both", {**stored, **{k: v for k, v in safetensors_in(_fused(hf, tmp)).items() if "experts.gate_up" in k}},
         "already provides"),
    ):
        (tmp_path / folder).mkdir()
        shutil.copy(tmp / "hf" / "config.json", tmp_path / folder / "config.json")
        save_file(state, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(UserError, match=message) as err:
            convert_from_hf(tmp_path / folder, tmp_path / f"{folder}-out")
        assert "\n" not in str(err.value)


def _fused(hf, tmp):
    if not (tmp / "hf-fused").exists():
        hf.save_pretrained(tmp / "hf-fused", save_original_format=False)
    return tmp / "hf-fused"


# ------------------------------------------------------------------------------ expert layouts as data


def _interleaved_transposed(toolkit: torch.Tensor) -> torch.Tensor:
    """gpt-oss's layout written out by hand: (X, 2I, C) gate rows then up rows -> (X, C, 2I) with the
    gate's and the up projection's columns alternating."""
    n_expert, rows, width = toolkit.shape
    out = torch.empty(n_expert, width, rows)
    out[:, :, 0::2] = toolkit[:, : rows // 2].transpose(1, 2)
    out[:, :, 1::2] = toolkit[:, rows // 2 :].transpose(1, 2)
    return out


def test_a_transposed_interleaved_expert_layout_converts_both_ways(tmp_path, monkeypatch):
    """A fused, transposed, interleaved layout (gpt-oss's `experts.gate_up_proj`, (X, C, 2I)) is one
    line of data in a weight map: described so for OLMoE, the converter reads such a checkpoint into
    the same toolkit weights, one expert at a time, and writes it back bit for bit."""
    tmp = tmp_path / "hub"
    hf_model("olmoe").save_pretrained(tmp / "hf")
    convert_from_hf(tmp / "hf", tmp / "toolkit")
    table = {hf: tk for hf, tk in weight_maps.OLMOE.items() if not isinstance(tk, weight_maps.ExpertPart)}
    table["model.layers.{l}.mlp.experts.gate_up_proj"] = weight_maps.ExpertPart(
        "blocks.{l}.mlp.experts.gate_up_proj", blocks=2, interleaved=True, transposed=True)
    table["model.layers.{l}.mlp.experts.down_proj"] = weight_maps.ExpertPart(
        "blocks.{l}.mlp.experts.down_proj", transposed=True)
    monkeypatch.setitem(weight_maps.WEIGHT_MAPS, "olmoe", table)
    monkeypatch.setitem(weight_maps.ALTERNATIVE_NAMES, "olmoe", {})
    for cached in (weight_maps.reverse_map, weight_maps.expert_reverse_map):
        cached.cache_clear()  # derived from the tables; cleared again once the test is done
    try:
        ours = safetensors_in(tmp / "toolkit")
        hub = safetensors_in(tmp / "hf")
        state = {k: v for k, v in hub.items() if ".experts." not in k}
        for layer in range(2):
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = _interleaved_transposed(
                ours[f"blocks.{layer}.mlp.experts.gate_up_proj"])
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = (
                ours[f"blocks.{layer}.mlp.experts.down_proj"].transpose(1, 2).contiguous())
        (tmp_path / "hf").mkdir()
        shutil.copy(tmp / "hf" / "config.json", tmp_path / "hf" / "config.json")
        save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
        convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
        got = safetensors_in(tmp_path / "toolkit")
        assert set(got) == set(ours) and all(torch.equal(got[k], ours[k]) for k in ours)
        convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
        exported = safetensors_in(tmp_path / "export")
        assert set(exported) == set(state) and all(torch.equal(exported[k], state[k]) for k in state)
    finally:
        for cached in (weight_maps.reverse_map, weight_maps.expert_reverse_map):
            cached.cache_clear()
