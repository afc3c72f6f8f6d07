"""The model: presets, configuration validation, KV-cache generation."""

import pytest
import torch

from toolkit.errors import UserError
from toolkit.sampling import generate_tokens
from toolkit.models.config import Config
from toolkit.models import IGNORE_INDEX
from toolkit.models.gpt import GPT, init_weights
from toolkit.models.presets import PRESETS, find_preset


@pytest.mark.parametrize("preset", [p for p in PRESETS if "expected_params" in p], ids=lambda p: p["name"])
def test_every_preset_has_the_published_parameter_count(preset):
    config = Config.from_name(preset["name"])
    with torch.device("meta"):
        model = GPT(config)
    counted = sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once
    assert abs(counted - preset["expected_params"]) <= 0.005 * preset["expected_params"]


@pytest.mark.parametrize("preset", [p for p in PRESETS if "expected_params" not in p], ids=lambda p: p["name"])
def test_debug_presets_instantiate_and_train_one_step(preset):
    config = Config.from_name(preset["name"])
    torch.manual_seed(0)
    model = GPT(config)
    init_weights(model, config.n_layer)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    loss = model(ids, labels=ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_lookup_by_alias_and_hf_repo_id():
    assert Config.from_name("tiny-llama").name == "tiny-llama-1.1b"
    assert Config.from_name("meta-llama/Llama-3.2-1B").name == "llama-3.2-1b"
    assert Config.from_name("PYTHIA-14M").name == "pythia-14m"


def test_unknown_model_names_the_closest_presets():
    with pytest.raises(UserError, match="Did you mean: .*llama-3-8b"):
        find_preset("llama-3-8")
    with pytest.raises(UserError, match="toolkit list"):
        Config.from_name("no-such-model-at-all-xyz")


def test_config_validation_and_round_trip(tmp_path):
    with pytest.raises(UserError, match="n_query_groups"):
        Config(n_embd=64, n_head=4, n_query_groups=3)
    with pytest.raises(UserError, match="Unknown model config field 'n_layers'.*n_layer"):
        Config.from_name("debug", n_layers=2)
    config = Config.from_name("llama-3.1-8b")
    config.save(tmp_path)
    assert Config.from_file(tmp_path) == config
    assert config.head_size == 128 and config.kv_heads == 8 and config.rope_n_elem == 128
    assert Config.from_name("pythia-14m").rope_n_elem == 8  # 25% of 32


def test_summed_loss_ignores_masked_labels():
    torch.manual_seed(0)
    model = GPT(Config.from_name("debug-llama2"))
    ids = torch.randint(0, 32000, (1, 8))
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX
    full = torch.nn.functional.cross_entropy(model(ids)[0, 5:], ids[0, 5:], reduction="sum")
    torch.testing.assert_close(model(ids, labels=labels), full)


@pytest.mark.parametrize("name", ["debug", "debug-neox", "debug-gemma", "debug-phi"])
def test_kv_cache_generation_equals_full_recomputation(name):
    torch.manual_seed(0)
    config = Config.from_name(name)
    model = GPT(config).eval()
    init_weights(model, config.n_layer, std=0.2)  # larger weights: non-trivial, varied next tokens
    prompt = torch.randint(0, config.vocab_size, (7,))
    cached = generate_tokens(model, prompt, max_new_tokens=12, temperature=0.0, top_k=None)

    # The same greedy decoding, recomputing the whole sequence each time without a cache.
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):
            logits = model(tokens[None])[0, -1]
            tokens = torch.cat([tokens, logits.argmax()[None]])
    assert torch.equal(cached, tokens)

    # And the cached logits match the uncached ones position by position.
    with torch.no_grad():
        full = model(tokens[None])[0]
        model.set_kv_cache(1, tokens.numel())
        step_logits = [model(tokens[None, :7], input_pos=0)[0]]
        for pos in range(7, tokens.numel()):
            step_logits.append(model(tokens[None, pos : pos + 1], input_pos=pos)[0])
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(step_logits), full, atol=2e-4, rtol=1e-4)


def test_chunked_prefill_with_a_cache_matches_one_pass():
    torch.manual_seed(0)
    model = GPT(Config.from_name("debug")).eval()
    ids = torch.randint(0, 4096, (2, 20))
    with torch.no_grad():
        full = model(ids)
        model.set_kv_cache(2, 20)
        parts = [model(ids[:, :8], input_pos=0), model(ids[:, 8:15], input_pos=8), model(ids[:, 15:], input_pos=15)]
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


# torch features the toolkit calls, each with the first release that has it (from torch's release notes).
TORCH_FEATURES = {
    "enable_gqa=": (2, 5),  # scaled_dot_product_attention(..., enable_gqa=...)
    "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard": (2, 6),  # FSDP2's public API
}


def test_the_declared_torch_floor_has_every_feature_the_code_calls():
    """pip installs anything above pyproject's floor: a user on the floor must get a working model."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    floor = re.search(r'"torch>=(\d+)\.(\d+)', (repo / "pyproject.toml").read_text())
    assert floor, "pyproject.toml declares no torch floor"
    floor = (int(floor.group(1)), int(floor.group(2)))
    sources = "\n".join(p.read_text() for p in (repo / "toolkit").rglob("*.py"))
    used = {feature: version for feature, version in TORCH_FEATURES.items() if feature in sources}
    assert used, "the feature table is out of date: none of its features is called any more"
    for feature, version in used.items():
        assert floor >= version, f"{feature} needs torch>={version[0]}.{version[1]}, pyproject allows {floor}"
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= floor


def test_one_prompt_in_the_cache_continues_in_several_rows():
    torch.manual_seed(0)
    model = GPT(Config.from_name("debug")).eval()
    prompts = torch.randint(0, 4096, (2, 9))
    continuations = torch.randint(0, 4096, (3, 5))
    owner = torch.tensor([1, 0, 1])  # the prompt each continuation follows
    with torch.no_grad():
        full = model(torch.cat([prompts[owner], continuations], dim=1))[:, 9:]
        model.set_kv_cache(3, 14)
        model(prompts, input_pos=0)  # fills rows 0 and 1
        model.select_kv_cache_rows(owner)
        cached = model(continuations, input_pos=9)
        model.clear_kv_cache()
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["debug", "debug-neox", "debug-phi"])
def test_a_left_padded_batch_in_the_cache_gives_each_row_what_it_gets_alone(name):
    """Rows of 3, 9 and 6 tokens padded on the left to 9, then 4 tokens decoded one at a time: the
    logits of every real position equal those of the row run alone without a cache (padding is
    never attended to and each row's positions start at 0: partial RoPE in NeoX and Phi as well)."""
    torch.manual_seed(0)
    config = Config.from_name(name)
    model = GPT(config).eval()
    init_weights(model, config.n_layer, seed=0)
    rows = [torch.randint(0, config.vocab_size, (n,)) for n in (3, 9, 6)]
    steps = torch.randint(0, config.vocab_size, (3, 4))
    padding = torch.tensor([9 - len(r) for r in rows])
    batch = torch.stack([torch.cat([torch.zeros(9 - len(r), dtype=torch.long), r]) for r in rows])
    with torch.no_grad():
        model.set_kv_cache(3, 13, left_padding=padding)
        first = model(batch, input_pos=0, logits_to_keep=1)[:, -1]  # (3, V)
        later = [model(steps[:, i : i + 1], input_pos=9 + i)[:, -1] for i in range(4)]
        model.clear_kv_cache()
        for b, row in enumerate(rows):
            alone = model(torch.cat([row, steps[b]])[None])[0, len(row) - 1 :]  # (5, V)
            torch.testing.assert_close(torch.stack([first[b]] + [step[b] for step in later]), alone, atol=1e-5, rtol=1e-5)


def test_generation_ends_where_the_stop_hook_says():
    torch.manual_seed(0)
    config = Config.from_name("debug")
    model = GPT(config).eval()
    init_weights(model, config.n_layer, std=0.2)
    prompt = torch.randint(0, config.vocab_size, (7,))
    whole = generate_tokens(model, prompt, max_new_tokens=10, temperature=0.0, top_k=None)
    seen = []
    stopped = generate_tokens(model, prompt, max_new_tokens=10, temperature=0.0, top_k=None,
                              stop=lambda new: seen.append(new.clone()) or new.numel() == 4)
    assert torch.equal(stopped, whole[: 7 + 4])
    assert [t.tolist() for t in seen] == [whole[7 : 7 + n].tolist() for n in range(1, 5)]


@pytest.mark.parametrize("shape", [(5000, 300), (3, 7), (10,)])
def test_initial_rows_equal_the_rows_of_the_full_initial_value(shape):
    """A rank draws only the rows it owns; they must be the full tensor's rows, wherever a row block
    (INIT_BLOCK_ELEMENTS values) starts or ends. (5000, 300) spans two blocks."""
    from toolkit.models.gpt import initial_value

    full = initial_value(("normal", 0.02), shape, 7, "blocks.0.attn.q_proj.weight")
    assert full.shape == shape and full.std() > 0
    rows = shape[0]
    for start, stop in [(0, rows), (1, rows - 1), (rows // 3, 2 * rows // 3), (rows - 1, rows), (rows, rows)]:
        part = initial_value(("normal", 0.02), shape, 7, "blocks.0.attn.q_proj.weight", start, stop)
        assert torch.equal(part, full[start:stop]), (start, stop)
        into = torch.empty(part.shape, dtype=torch.bfloat16)  # a rank's shard, written in place
        assert initial_value(("normal", 0.02), shape, 7, "blocks.0.attn.q_proj.weight", start, stop, out=into) is into
        assert torch.equal(into, part.to(torch.bfloat16))
    other = initial_value(("normal", 0.02), shape, 8, "blocks.0.attn.q_proj.weight")
    assert not torch.equal(other, full)  # the seed matters


@pytest.mark.parametrize("shape", [(4, 6000, 100), (4, 10, 3), (4, 6)])
def test_initial_rows_of_part_of_each_expert_equal_the_full_initial_value(shape):
    """Expert weights split along dim 1 (`expert_shard_dim`): a rank draws rows [first, last) of every
    expert, and gets the full tensor's. (4, 6000, 100) draws as 24,000 rows, several blocks each
    expert; (4, 6) is a bias, drawn whole row by row."""
    from toolkit.models.gpt import initial_value

    name = "blocks.0.mlp.experts.gate_up_proj"
    full = initial_value(("normal", 0.02), shape, 7, name)
    assert full.shape == shape and full.std() > 0
    for start, stop, inner in [(0, 4, (0, shape[1] // 2)), (1, 3, (shape[1] // 2, shape[1])), (0, 4, (1, 2)),
                               (3, 4, (0, shape[1]))]:
        part = initial_value(("normal", 0.02), shape, 7, name, start, stop, inner=inner)
        assert torch.equal(part, full[start:stop, inner[0]:inner[1]]), (start, stop, inner)
        into = torch.empty(part.shape, dtype=torch.bfloat16)
        assert initial_value(("normal", 0.02), shape, 7, name, start, stop, out=into, inner=inner) is into
        assert torch.equal(into, part.to(torch.bfloat16))
    assert torch.equal(initial_value(("normal", 0.02), shape, 7, name, 1, 3), full[1:3])


@pytest.mark.parametrize(
    "overrides, message",
    [({"n_layer": "abc"}, "n_layer must be an integer"), ({"n_layer": 2.5}, "n_layer must be an integer"),
     ({"bias": 1}, "bias must be true or false"), ({"family": "foo"}, "family must be one of"),
     ({"rope_scaling": 3}, "rope_scaling must be a mapping")],
)
def test_config_fields_of_the_wrong_type_are_one_clear_error(overrides, message):
    with pytest.raises(UserError, match=message):
        Config.from_name("debug", **overrides)


def test_overrides_may_rename_a_preset_and_whole_numbers_are_accepted_as_floats():
    config = Config.from_name("debug", name="mine", rope_base=500000)
    assert config.name == "mine" and config.rope_base == 500000.0 and isinstance(config.rope_base, float)


def test_checkpoint_rows_read_into_a_shard_equal_the_stored_rows(tmp_path, monkeypatch):
    """A rank's rows of each weight of a bf16 checkpoint, copied into its float32 shard a few rows
    per mapping (READ_CHUNK_BYTES made tiny so that every weight takes several), and read whole."""
    import toolkit.model_dir as model_dir

    config = Config.from_name("debug", n_layer=2, n_embd=64, intermediate_size=128, vocab_size=512)  # rows of 128-256 bytes
    torch.manual_seed(0)
    stored = {k: torch.randn_like(v) for k, v in GPT(config).to(torch.bfloat16).state_dict().items()}
    model_dir.save_checkpoint_files(tmp_path, stored, config)
    monkeypatch.setattr(model_dir, "READ_CHUNK_BYTES", 1000)
    read_rows = model_dir.checkpoint_row_reader(tmp_path)
    for name, tensor in stored.items():
        rows = tensor.shape[0]
        for start, stop in [(0, rows), (1, rows - 1), (rows // 3, rows // 2)]:
            shard = torch.empty((stop - start, *tensor.shape[1:]))
            assert read_rows(name, start, stop, out=shard) is shard
            assert torch.equal(shard, tensor[start:stop].float()), (name, start, stop)
        assert torch.equal(read_rows(name, 0, None), tensor)
    matrices = [t for t in stored.values() if t.dim() > 1]
    assert max(t[0].numel() * t.element_size() for t in matrices) < 1000 // 3  # 3 rows or more per mapping
    assert min(t.numel() * t.element_size() for t in matrices) > 2 * 1000  # 3 mappings or more per whole matrix


def _rms(x, weight, eps, unit_offset=False):
    scale = (1.0 + weight) if unit_offset else weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


@pytest.mark.parametrize("qk_norm", ["head", "projection"])
def test_qk_norm_normalises_queries_and_keys_before_the_rotation(qk_norm):
    """Per head (Qwen3, Gemma 3: weights of D) or over the whole projection (OLMo 2: H * D, G * D)."""
    from toolkit.models.attention import CausalSelfAttention
    from toolkit.models.rope import RotaryEmbedding, apply_rope

    config = Config(n_layer=1, n_embd=32, n_head=4, n_query_groups=2, vocab_size=50, block_size=16, qk_norm=qk_norm,
                    norm_eps=1e-6)
    torch.manual_seed(0)
    attn = CausalSelfAttention(config, 0)
    for norm in (attn.q_norm, attn.k_norm):
        torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    assert attn.q_norm.weight.shape == ((8,) if qk_norm == "head" else (32,))
    assert attn.k_norm.weight.shape == ((8,) if qk_norm == "head" else (16,))
    x = torch.randn(2, 7, 32)
    cos, sin = RotaryEmbedding(config)(0, 7, x.device)

    def heads(t, n):
        return t.view(2, 7, n, 8)

    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    if qk_norm == "head":
        q, k = _rms(heads(q, 4), attn.q_norm.weight, 1e-6), _rms(heads(k, 2), attn.k_norm.weight, 1e-6)
    else:
        q, k = heads(_rms(q, attn.q_norm.weight, 1e-6), 4), heads(_rms(k, attn.k_norm.weight, 1e-6), 2)
    q, k = (apply_rope(t.transpose(1, 2), cos, sin, 8) for t in (q, k))
    v = heads(v, 2).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attn.o_proj(y.transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(attn(x, cos, sin, None), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["post", "sandwich"])
def test_post_and_sandwich_norms_wrap_attention_and_mlp(position):
    from toolkit.models.gpt import Block
    from toolkit.models.rope import RotaryEmbedding

    config = Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, block_size=16, norm_position=position,
                    norm_unit_offset=position == "sandwich")
    torch.manual_seed(0)
    block = Block(config, 0)
    norms = ["post_attn_norm", "post_mlp_norm"] + (["norm_1", "norm_2"] if position == "sandwich" else [])
    assert sorted(n for n, m in block.named_children() if m is not None and "norm" in n) == sorted(norms)
    for name in norms:
        torch.nn.init.normal_(getattr(block, name).weight, 0.5, 0.3)
    x = torch.randn(2, 5, 16)
    cos, sin = RotaryEmbedding(config)(0, 5, x.device)

    def norm(name, t):
        return _rms(t, getattr(block, name).weight, config.norm_eps, unit_offset=config.norm_unit_offset)

    h = norm("norm_1", x) if position == "sandwich" else x
    x1 = x + norm("post_attn_norm", block.attn(h, cos, sin, None))
    h = norm("norm_2", x1) if position == "sandwich" else x1
    expected = x1 + norm("post_mlp_norm", block.mlp(h))
    torch.testing.assert_close(block(x, cos, sin, None), expected, rtol=1e-5, atol=1e-5)


def test_new_layer_fields_are_checked():
    with pytest.raises(UserError, match="parallel_residual needs norm_position"):
        Config(parallel_residual=True, norm_position="post")
    with pytest.raises(UserError, match="qk_norm needs norm 'rmsnorm'"):
        Config(norm="layernorm", qk_norm="head")
    with pytest.raises(UserError, match="qk_norm must be one of"):
        Config(qk_norm="all")


def test_n_layer_override_fits_the_presets_per_layer_patterns():
    from toolkit.models.config import resize_layer_lists

    gemma = Config.from_name("gemma-3-1b", n_layer=12)  # five local layers, then one global
    assert gemma.layer_types == (["local"] * 5 + ["global"]) * 2
    assert Config.from_name("SmolLM3-3B", n_layer=8).no_rope_layers == [3, 7]  # NoPE every fourth layer
    assert Config.from_name("gemma-3-1b", n_layer=2, layer_types=["local", "global"]).layer_types == ["local", "global"]
    moe = dict(n_layer=4, moe_layers=[1, 3])
    assert resize_layer_lists(moe, 6, keep=set())["moe_layers"] == [1, 3, 5]
    assert resize_layer_lists(moe, 6, keep={"moe_layers"})["moe_layers"] == [1, 3]
    with pytest.raises(UserError, match="has no repeating pattern to extend: set layer_types too"):
        resize_layer_lists(dict(n_layer=3, layer_types=["global", "local", "local"]), 5, keep=set())
    assert resize_layer_lists(dict(n_layer=3, layer_types=["global", "local", "local"]), 2, keep=set())["layer_types"] == [
        "global", "local"]
