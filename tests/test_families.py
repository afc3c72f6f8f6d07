"""Each family against transformers, through the real converter, on a tiny random model.

One row of `FAMILIES` per architecture variant: transformers' config and model classes and the
config values that exercise what the family does differently (a window shorter than the test
sequences, softcapping, QK norm...). For each row:

- logits of the converted model equal transformers' within 1e-5 in float32, on a sequence longer
  than any sliding window;
- 40 greedy tokens through the toolkit's KV cache equal `generate` (the cache runs past the window);
- a packed row (two samples, `document_ids`) gives each sample the logits it gets alone;
- converted back, every tensor is bit-identical to the original and `from_pretrained` loads it.

The sizes are tiny so that the whole table runs in seconds; the tests of conversion's error paths
and of sharded, streamed checkpoints are in tests/test_convert.py.
"""

from __future__ import annotations


import pytest
import torch
import transformers

from parity import assert_greedy_generation_equals, assert_packed_row_equals_samples_alone, assert_round_trip
from toolkit.convert import config_from_hf, convert_from_hf
from toolkit.model_dir import load_model
from toolkit.models.config import Config

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=256, initializer_range=0.2)
WINDOW = 16  # shorter than the test sequences (PROMPT + NEW_TOKENS tokens): windows are exercised
PROMPT, NEW_TOKENS = 24, 40

# LongRoPE switches to its long factors for sequences longer than LONGROPE_SWITCH tokens: the logits
# test runs past it, generation crosses it, and one packed sample is shorter and one longer.
LONGROPE_SWITCH = 32
# No special ids: Phi3Config's defaults lie outside TINY's vocabulary, and `generate`'s min_new_tokens
# forbids the EOS id (Llama's 2), which greedy decoding in the toolkit may pick.
_NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _longrope(pairs: int) -> dict:
    return dict(original_max_position_embeddings=LONGROPE_SWITCH, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(pairs)],
        long_factor=[1.5 + 2.5 * i for i in range(pairs)]))


# name -> (transformers config class, model class, config values beside TINY)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    # every layer windowed
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=WINDOW)),
    # the layers from max_window_layers on windowed: layer 0 global, layer 1 local
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                              max_window_layers=1)),
    # per-head QK norm, a head size other than hidden / heads, a tied head
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, use_sliding_window=True,
                                                              sliding_window=WINDOW, max_window_layers=1)),
    # QK norm over the whole (grouped) projections, norms after attention and MLP only
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    # layer 1 without RoPE (0 in no_rope_layers) and, as SmolLM3 windows its NoPE layers, windowed
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0], use_sliding_window=True,
                                                             sliding_window=WINDOW, pad_token_id=0)),
    # YaRN: defaults (beta 32 / 1, truncated ramp, attention factor from the factor), then every key
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(_NO_IDS, head_dim=16, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(_NO_IDS, rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=16.0, beta_slow=2.0,
        mscale=1.0, mscale_all_dim=0.5, truncate=False))),
    # Phi-3: fused qkv_proj (grouped-query) and gate_up_proj, a sliding window (Phi-3-mini-4k)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_NO_IDS, sliding_window=WINDOW)),
    # LongRoPE with a window, multi-head (Phi-3-mini-128k, Phi-3.5-mini)
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(_NO_IDS, num_key_value_heads=4, sliding_window=WINDOW,
                                                           **_longrope(8))),
    # Phi-4-mini: 3/4 of each head rotates, tied embeddings, LongRoPE
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", dict(_NO_IDS, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                                       **_longrope(6))),
    # one local layer (window) and one global; softcaps that bite with these weights; the scores
    # scaled by 1/sqrt(24), not 1/sqrt(head_dim); exact GELU (Gemma 2's configs may say "gelu"); tied
    # embeddings, as published, scaled down (EMBEDDING_SCALE)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu")),
    # the layer pattern transformers derives when config.json has no layer_types; tanh GELU
    "gemma2-tanh-gelu": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3)),
    # local layers rotate with their own base, global ones with another and linear scaling; QK norm
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        initializer_range=0.05, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, num_hidden_layers=3, sliding_window_pattern=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
}


# Tied embeddings multiplied by this after initialisation. Gemma scales its input embeddings by
# sqrt(hidden): at the initializer range of the others a tied Gemma 2 this small copies its last token
# greedily whatever the prompt (its residual is that token's embedding, its head the same matrix),
# which would leave the generation test comparing one repeated token. (At 0.1 the tanh row's
# `generate` leaves transformers' own full forward pass at the 40th token, where the toolkit's cache
# stays with it: top logits 0.529 against 0.353, so not a near tie; 0.2 is clear of it.)
EMBEDDING_SCALE = {"gemma2": 0.1, "gemma2-tanh-gelu": 0.2}


def hf_model(name: str):
    """A random transformers model in eval mode, float32, norms and biases away from their 1/0 init."""
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.add_(torch.randn_like(p) * 0.1)
        model.get_input_embeddings().weight.mul_(EMBEDDING_SCALE.get(name, 1.0))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained folder, the toolkit model converted from it)."""
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    model = hf_model(name)
    model.save_pretrained(tmp / "hf")
    convert_from_hf(tmp / "hf", tmp / "toolkit")
    return name, model, tmp, load_model(tmp / "toolkit").eval()


def test_logits_equal_transformers(converted):
    name, hf, _, ours = converted
    ids = torch.randint(0, TINY["vocab_size"], (2, PROMPT + NEW_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert expected.abs().max() > 0.5, "degenerate reference"
    assert (got - expected).abs().max().item() <= 1e-5, name


def test_greedy_generation_through_the_cache_equals_generate(converted):
    name, hf, _, ours = converted
    prompt = torch.randint(0, TINY["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(2))
    assert_greedy_generation_equals(hf, ours, prompt, NEW_TOKENS, name)


def test_a_packed_row_gives_each_sample_its_own_logits(converted):
    name, _, _, ours = converted
    first, second = (torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
                     for n in (PROMPT + 5, PROMPT + 11))
    assert_packed_row_equals_samples_alone(ours, first, second, name)


def test_the_round_trip_is_bit_identical_and_loads_in_transformers(converted):
    name, hf, tmp, _ = converted
    ids = torch.randint(0, TINY["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(3))
    assert_round_trip(hf, tmp, ids, name)


# ------------------------------------------------------------------------------ what cannot be reproduced


def _hf_config(name: str, **changes) -> dict:
    config_cls, _, extra = FAMILIES[name]
    return {**getattr(transformers, config_cls)(**{**TINY, **extra}).to_dict(), **changes}


@pytest.mark.parametrize("name, changes, field", [
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(query_pre_attn_scalar=24.5), "query_pre_attn_scalar"),
    # the published 4B, 12B and 27B checkpoints: image and text model in one (text_config, vision_tower)
    ("gemma3", dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
     "Unsupported architecture 'Gemma3ForConditionalGeneration'"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0}}),
     "rope_parameters.sliding_attention"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}),
     "RoPE scaling 'dynamic'"),
])
def test_a_config_the_toolkit_cannot_reproduce_is_refused_naming_the_field(name, changes, field):
    from toolkit.errors import UserError

    config_from_hf(_hf_config(name))  # the row itself converts
    with pytest.raises(UserError, match=field) as err:
        config_from_hf(_hf_config(name, **changes))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("preset, changes, field", [
    ("gemma-2-2b", dict(rope_local_base=100.0), "rope_local_base"),
    ("gemma-3-1b", dict(qk_norm=None), "qk_norm"),
    ("llama-3.1-8b", dict(attn_logit_softcap=50.0), "attn_logit_softcap"),
])
def test_export_refuses_what_the_family_cannot_express(preset, changes, field):
    from toolkit.convert import config_to_hf
    from toolkit.errors import UserError

    config_to_hf(Config.from_name(preset))
    with pytest.raises(UserError, match=field):
        config_to_hf(Config.from_name(preset, **changes))


@pytest.mark.parametrize("name", ["gemma-2-27b", "gemma-3-1b", "gemma-3-27b"])
def test_gemma_presets_export_to_configs_transformers_reads_back_to_the_same_preset(name):
    """A preset's config.json builds transformers' model config with the same layer pattern,
    softcaps, scale and per-layer RoPE, and reads back as that preset."""
    from toolkit.convert import config_to_hf

    config = Config.from_name(name)
    hf = config_to_hf(config)
    built = transformers.AutoConfig.for_model(**hf)
    assert built.layer_types == ["sliding_attention" if t == "local" else "full_attention" for t in config.layer_types]
    assert built.query_pre_attn_scalar == config.query_pre_attn_scalar
    assert built.final_logit_softcapping == config.final_logit_softcap
    assert config_from_hf(built.to_dict()) == config
    # transformers 4.x files: RoPE as rope_theta / rope_local_base_freq / rope_scaling, the layer
    # pattern as sliding_window_pattern (Gemma 3) or implied (Gemma 2)
    legacy = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    if config.family == "gemma3":
        legacy["sliding_window_pattern"] = 6
    assert config_from_hf(legacy) == config
