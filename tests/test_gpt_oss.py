"""gpt-oss against transformers' GptOss, through the real converter, on a tiny random model.

The tiny model has what gpt-oss does differently: every MLP a mixture of experts (6 experts, top-2)
with a biased router and biased experts whose clamped SwiGLU clamps (a small `swiglu_limit`),
attention with biases and a sink per head, layers alternating a sliding window shorter than the
test sequences and full attention, YaRN not truncated. Checked:

- its attention and its MLP, one layer each, with weights copied by hand (the experts' gate and up
  de-interleaved, their matrices transposed), equal GptOssAttention (eager) and GptOssMLP;
- logits of the converted model equal transformers' within 1e-5 in float32, every token routed to
  the same experts; 40 greedy tokens through the KV cache equal `generate`; a packed row gives each
  sample its own logits; the router's load-balancing loss equals transformers' aux_loss;
- converted back, every tensor is bit-identical and `from_pretrained` loads it;
- a checkpoint holding the experts as MXFP4 (blocks and scales, as published) converts to the
  weights transformers' own dequantization gives;
- both ways, MXFP4 or not, the experts' tensors are read one expert at a time, never a layer's whole;
- the presets: config.json files as published name them, parameter counts are transformers'.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss

from parity import assert_greedy_generation_equals, assert_packed_row_equals_samples_alone, assert_round_trip
from toolkit.convert import config_from_hf, convert_from_hf, convert_to_hf
from toolkit.model_dir import load_model
from toolkit.models.config import Config
from toolkit.models.moe import moe_layers, router_losses

WINDOW = 6  # shorter than the test sequences
PROMPT, NEW_TOKENS = 16, 40
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW,
    max_position_embeddings=128, swiglu_limit=1.5, router_aux_loss_coef=0.02, initializer_range=0.2,
    rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=32),
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def hf_model(**changes):
    """A random GptOssForCausalLM in eval mode, float32, eager attention; biases, sinks and norms
    away from their initial values."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**TINY, **changes})
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("sinks"):
                p.normal_(0.5, 1.0)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its folder, the toolkit model converted from it)."""
    tmp = tmp_path_factory.mktemp("gpt_oss")
    model = hf_model()
    model.save_pretrained(tmp / "hf")
    convert_from_hf(tmp / "hf", tmp / "toolkit")
    return model, tmp, load_model(tmp / "toolkit").eval()


def _ids(n: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ one layer, copied by hand


def _toolkit_config(hf_config) -> Config:
    return config_from_hf(hf_config.to_dict())


@pytest.mark.parametrize("layer", [0, 1])  # sliding, full
def test_attention_with_sinks_equals_gpt_oss_attention(layer):
    """CausalSelfAttention against GptOssAttention (eager: scores with a sink column, softmax, the
    column dropped) with the same weights and rotary tables, forward and gradients of the inputs
    and sinks."""
    from toolkit.models.attention import CausalSelfAttention
    from toolkit.models.rope import RotaryEmbedding

    hf = hf_model()
    theirs = hf.model.layers[layer].self_attn
    config = _toolkit_config(hf.config)
    ours = CausalSelfAttention(config, layer)
    ours.load_state_dict({name: p.detach().clone() for name, p in theirs.named_parameters()})
    assert ours.window == (WINDOW if layer == 0 else None)
    T = 20
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    position_ids = torch.arange(T)[None]
    cos, sin = hf.model.rotary_emb(x, position_ids)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    if layer == 0:
        allowed &= ~torch.ones(T, T, dtype=torch.bool).tril(-WINDOW)
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    want = theirs(x, (cos, sin), mask)[0]
    got = ours(x, *RotaryEmbedding(config)(0, T, x.device), None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    want_grads = torch.autograd.grad((want * upstream).sum(), (x, theirs.sinks))
    got_grads = torch.autograd.grad((got * upstream).sum(), (x, ours.sinks))
    for g, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g, ref, rtol=0, atol=1e-5)


def test_mixture_of_experts_equals_gpt_oss_mlp():
    """MoE against GptOssMLP with copied weights: the router (top-k of the logits, softmax over
    them) and the experts, whose (X, C, 2I) gate_up_proj holds gate and up interleaved."""
    from toolkit.models.moe import MoE

    hf = hf_model()
    theirs = hf.model.layers[0].mlp
    config = _toolkit_config(hf.config)
    ours = MoE(config)
    experts = theirs.experts
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.router.bias.copy_(theirs.router.bias)
        gate, up = experts.gate_up_proj[..., ::2], experts.gate_up_proj[..., 1::2]  # (X, C, I) each
        ours.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=2).transpose(1, 2))  # (X, 2I, C)
        bias = experts.gate_up_proj_bias
        ours.experts.gate_up_bias.copy_(torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1))
        ours.experts.down_proj.copy_(experts.down_proj.transpose(1, 2))  # (X, C, I)
        ours.experts.down_bias.copy_(experts.down_proj_bias)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(6)) * 3
    with torch.no_grad():
        want, _ = theirs(x)
        got = ours(x)
        h = experts.gate_up_proj[0].T @ x.reshape(-1, 32).T  # the limit clamps: some values beyond it
        assert h.abs().max() > config.swiglu_limit
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ the whole model, converted


def test_logits_and_routing_equal_transformers(converted):
    hf, _, ours = converted
    ids = _ids(PROMPT + NEW_TOKENS, 1)
    chosen: dict[str, list] = {"hf": [], "ours": []}
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, out: chosen["hf"].append(out[2].sort(-1).values))
             for layer in hf.model.layers]
    routes = []
    for layer in moe_layers(ours):
        route = layer.route

        def recorded(x, route=route):
            out = route(x)
            chosen["ours"].append(out[2].sort(-1).values)
            return out

        layer.route = recorded
        routes.append(layer)
    try:
        with torch.no_grad():
            expected, got = hf(ids).logits, ours(ids)
    finally:
        for hook in hooks:
            hook.remove()
        for layer in routes:
            del layer.route
    assert expected.abs().max() > 0.5, "degenerate reference"
    assert (got - expected).abs().max().item() <= 1e-5
    assert len(chosen["ours"]) == len(chosen["hf"]) == TINY["num_hidden_layers"]
    for theirs, mine in zip(chosen["hf"], chosen["ours"]):
        assert torch.equal(theirs, mine)
    used = torch.cat(chosen["ours"]).unique()
    assert used.numel() == TINY["num_local_experts"]  # every expert takes part


def test_greedy_generation_through_the_cache_equals_generate(converted):
    hf, _, ours = converted
    got = assert_greedy_generation_equals(hf, ours, _ids(PROMPT, 2, batch=1)[0], NEW_TOKENS)
    assert len(set(got[PROMPT:].tolist())) > 3  # not one token over and over


def test_a_packed_row_gives_each_sample_its_own_logits(converted):
    _, _, ours = converted
    assert_packed_row_equals_samples_alone(ours, _ids(PROMPT + 5, 3, batch=1)[0], _ids(PROMPT + 11, 4, batch=1)[0])


def test_router_load_balancing_loss_equals_transformers_aux_loss(converted):
    """gpt-oss's aux_loss in transformers is Mixtral's: softmax over all experts' logits, top-k of
    it (the same experts as top-k of the logits), X * sum of share x mean probability over all layers
    and tokens; `router_losses` computes the same, and the coefficient comes from config.json."""
    hf, _, ours = converted
    ids = _ids(PROMPT, 5)
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        ours(ids)
    losses = router_losses(moe_layers(ours))
    torch.testing.assert_close(losses.aux, out.aux_loss.float(), rtol=1e-6, atol=1e-6)
    assert ours.config.router_aux_loss_coef == hf.config.router_aux_loss_coef == TINY["router_aux_loss_coef"]


def test_the_round_trip_is_bit_identical_and_loads_in_transformers(converted):
    hf, tmp, _ = converted
    assert_round_trip(hf, tmp, _ids(PROMPT, 6, batch=1), attn_implementation="eager")


# ------------------------------------------------------------------------------ MXFP4 checkpoints


def _mxfp4_checkpoint(tmp_path):
    """A tiny gpt-oss folder whose experts' weights are stored as MXFP4 (`_blocks`, `_scales`), as
    published, and the transformers model holding the weights its own dequantization gives
    (widths of 32: one group of 32 values per row)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model(intermediate_size=32)
    hf.save_pretrained(tmp_path / "hf")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) == 1
    state = load_file(files[0])
    generator = torch.Generator().manual_seed(7)
    X, C, I = TINY["num_local_experts"], TINY["hidden_size"], 32
    weights = dict(hf.named_parameters())
    for layer in range(TINY["num_hidden_layers"]):
        for proj, rows, k in (("gate_up_proj", 2 * I, C), ("down_proj", C, I)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks = torch.randint(0, 256, (X, rows, k // 32, 16), dtype=torch.uint8, generator=generator)
            scales = torch.randint(120, 126, (X, rows, k // 32), dtype=torch.uint8, generator=generator)
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            with torch.no_grad():
                weights[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).float())
    save_file(state, str(files[0]), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = _published(1, 1)["quantization_config"]  # as the Hub's config.json says
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    return hf


def test_mxfp4_experts_convert_to_the_weights_transformers_dequantizes(tmp_path):
    """Converted, the MXFP4 experts are transformers' dequantized weights (bf16 values), rearranged
    as the toolkit keeps them, and the model computes what GptOss computes with them. Exported
    again, the checkpoint is an unquantized gpt-oss (no quantization_config) that transformers
    loads with the same logits."""
    from toolkit.convert import weight_maps

    hf = _mxfp4_checkpoint(tmp_path)
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit", dtype="float32")
    ours = load_model(tmp_path / "toolkit").eval()
    state = ours.state_dict()
    for layer in range(TINY["num_hidden_layers"]):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"blocks.{layer}.mlp.experts.{proj}"
            hf_name = f"model.layers.{layer}.mlp.experts.{proj}"
            theirs = hf.get_parameter(hf_name).detach()
            part = weight_maps.hf_to_toolkit_name("gpt_oss", hf_name)
            assert part.target == name
            want = torch.stack([weight_maps.expert_rows_from_hf(part, expert) for expert in theirs])
            assert torch.equal(state[name], want), name
    ids = _ids(PROMPT, 8)
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert (got - expected).abs().max().item() <= 1e-5
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (exported(ids).logits - expected).abs().max().item() <= 1e-5


def test_mxfp4_experts_default_to_bfloat16_and_a_lone_part_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from toolkit.errors import UserError

    _mxfp4_checkpoint(tmp_path)
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
    with safe_open(str(tmp_path / "toolkit" / "model.safetensors"), "pt") as f:
        assert f.get_slice("blocks.0.mlp.experts.gate_up_proj").get_dtype() == "BF16"
        assert f.get_slice("blocks.0.attn.q_proj.weight").get_dtype() == "F32"  # the rest as stored
    path = next((tmp_path / "hf").glob("*.safetensors"))
    state = load_file(path)
    scales = state.pop("model.layers.1.mlp.experts.down_proj_scales")
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks 'model.layers.1.mlp.experts.down_proj_scales'") as err:
        convert_from_hf(tmp_path / "hf", tmp_path / "again")
    assert "\n" not in str(err.value)
    # MXFP4 parts of a tensor that is not an expert tensor: named, refused
    state["model.layers.1.mlp.experts.down_proj_scales"] = scales
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    rows, width = state.pop(q_proj).shape
    state[q_proj + "_blocks"] = torch.zeros(rows, width // 32, 16, dtype=torch.uint8)
    state[q_proj + "_scales"] = torch.zeros(rows, width // 32, dtype=torch.uint8)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"'{q_proj}_blocks' is stored quantized \\(mxfp4\\)") as err:
        convert_from_hf(tmp_path / "hf", tmp_path / "again")
    assert "\n" not in str(err.value)


def test_dequantization_equals_transformers_bit_for_bit():
    """`toolkit.convert.mxfp4.dequantize` against transformers' `convert_moe_packed_tensors` on random
    blocks, with scales over their whole range (an exponent past float's is inf, 0 x inf NaN, in both)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from toolkit.convert.mxfp4 import dequantize

    generator = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=generator)
    for low, high in ((110, 140), (0, 256)):
        scales = torch.randint(low, high, (3, 10, 4), dtype=torch.uint8, generator=generator)
        for dtype in (torch.bfloat16, torch.float32):
            want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            got = dequantize(blocks, scales, dtype)
            assert got.dtype == want.dtype and got.shape == want.shape == (3, 128, 10)
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("stored", ["mxfp4", "float32"])
def test_experts_are_read_one_expert_at_a_time_both_ways(tmp_path, monkeypatch, stored):
    """Streaming: converting, then exporting, reads each tensor holding a layer's experts (MXFP4
    blocks and scales, float32 weights, the interleaved bias, the toolkit's own) one expert's rows at
    a time, each expert once. The real reader is called; the wrapper only records the rows asked for."""
    from toolkit.convert.hf_to_toolkit import TensorReader

    if stored == "mxfp4":
        _mxfp4_checkpoint(tmp_path)
    else:
        hf_model().save_pretrained(tmp_path / "hf")
    reads: dict[str, list[tuple[int, int]]] = {}
    load_rows = TensorReader.load_rows

    def recording(self, info, start, stop):
        reads.setdefault(info.name, []).append((start, stop))
        return load_rows(self, info, start, stop)

    monkeypatch.setattr(TensorReader, "load_rows", recording)
    convert_from_hf(tmp_path / "hf", tmp_path / "toolkit")
    convert_to_hf(tmp_path / "toolkit", tmp_path / "export")
    hf_parts = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales") \
        if stored == "mxfp4" else ("gate_up_proj", "down_proj")
    expected = {
        name
        for layer in range(TINY["num_hidden_layers"])
        for name in (*(f"model.layers.{layer}.mlp.experts.{p}" for p in (*hf_parts, "gate_up_proj_bias")),
                     *(f"blocks.{layer}.mlp.experts.{p}" for p in ("gate_up_proj", "gate_up_bias", "down_proj")))
    }
    experts = {name: spans for name, spans in reads.items()
               if re.search(r"experts\.(gate_up_proj|gate_up_bias|down_proj)(_bias|_blocks|_scales)?$", name)
               and not name.endswith("down_proj_bias")}  # (X, C), the toolkit's own layout: copied as stored
    assert set(experts) == expected
    for name, spans in experts.items():
        assert sorted(spans) == [(e, e + 1) for e in range(TINY["num_local_experts"])], name


# ------------------------------------------------------------------------------ presets


def _published(n_layer: int, n_expert: int) -> dict:
    """config.json of openai/gpt-oss-20b and -120b as published (transformers 4.55 layout)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)],
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": n_layer, "num_key_value_heads": 8, "num_local_experts": n_expert,
        "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }


@pytest.mark.parametrize("name, n_layer, n_expert", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_published_configs_name_their_preset_which_counts_transformers_parameters(name, n_layer, n_expert):
    from toolkit.convert import config_to_hf
    from toolkit.models.gpt import count_parameters
    from toolkit.models.presets import PRESETS

    config = config_from_hf(_published(n_layer, n_expert))
    assert config.name == name
    assert config == Config.from_name(name)
    # transformers builds the same model from the toolkit's config.json (on the meta device)
    hf_config = transformers.GptOssConfig(**config_to_hf(config))
    assert hf_config.layer_types == _published(n_layer, n_expert)["layer_types"]
    with torch.device("meta"):
        theirs = transformers.GptOssForCausalLM(hf_config)
    counted = sum(p.numel() for p in theirs.parameters())
    assert count_parameters(config) == counted == next(p for p in PRESETS if p["name"] == name)["expected_params"]
    # transformers reads the same RoPE: YaRN's frequencies and attention factor
    from toolkit.models.rope import RotaryEmbedding

    rotary = modeling_gpt_oss.GptOssRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(config)
    assert torch.equal(ours.inverse_frequencies("cpu"), rotary.inv_freq)
    assert ours._scaled("cpu", False)[1] == rotary.attention_scaling == 0.1 * math.log(32) + 1


def test_transformers_defaults_fill_what_config_json_leaves_out():
    """GptOssConfig's defaults (its sizes are gpt-oss-120b's) where config.json says nothing: YaRN
    factor 32 over 4096 tokens untruncated on base 150000, a 128-token window on every other layer."""
    minimal = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088,
               "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072}
    config = config_from_hf(minimal)
    preset = Config.from_name("gpt-oss-120b")
    assert config.replace(name=preset.name, hf_repo_id=preset.hf_repo_id, router_aux_loss_coef=0.9) == preset
    assert config.router_aux_loss_coef == transformers.GptOssConfig().router_aux_loss_coef
    assert config_from_hf(transformers.GptOssConfig().to_dict()) == config


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=False), "attention_bias=false"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok=7 exceeds num_local_experts=6"),
    (dict(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1000.0)), "RoPE scaling 'dynamic'"),
])
def test_configs_the_toolkit_cannot_reproduce_are_refused_in_one_line(changes, message):
    from toolkit.errors import UserError

    base = transformers.GptOssConfig(**TINY).to_dict()
    config_from_hf(base)
    with pytest.raises(UserError, match=message) as err:
        config_from_hf({**base, **changes})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("changes, field", [
    (dict(attention_sinks=False), "attention_sinks"),
    (dict(mlp="swiglu"), "mlp"),
    (dict(moe_layers=list(range(0, 24, 2))), "every gpt_oss layer is a mixture of experts"),
    (dict(router_norm_topk=False), "router_norm_topk"),
])
def test_export_refuses_what_gpt_oss_cannot_express(changes, field):
    from toolkit.convert import config_to_hf
    from toolkit.errors import UserError

    config_to_hf(Config.from_name("gpt-oss-20b"))
    with pytest.raises(UserError, match=field):
        config_to_hf(Config.from_name("gpt-oss-20b", **changes))
    # and the other families refuse sinks
    with pytest.raises(UserError, match="attention_sinks"):
        config_to_hf(Config.from_name("llama-3.2-1b", attention_sinks=True))
