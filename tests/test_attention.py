"""Attention masks (causal, sliding window, packed samples, KV cache), per-layer config data and RoPE scalings.

References are written the slow, obvious way (a dense mask filled by Python loops, attention as
softmax(q k^T / sqrt(D)) v in float32), on tiny random models.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from toolkit.errors import UserError
from toolkit.models.attention import CausalSelfAttention, attention_mask, document_segments
from toolkit.models.config import ROPE_SCALING_KEYS, Config
from toolkit.models.gpt import GPT, flops_per_token, init_weights
from toolkit.models.rope import ROPE_SCALINGS, RotaryEmbedding, apply_rope, llama3_scale_frequencies

TINY = dict(vocab_size=97, block_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=48)


def _model(seed: int = 0, **overrides) -> GPT:
    config = Config(name="tiny", **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = GPT(config).eval()
    init_weights(model, config.n_layer, std=0.3, seed=seed)  # large weights: attention far from uniform
    return model


def _dense_reference(attn: CausalSelfAttention, x, cos, sin, sees) -> torch.Tensor:
    """The layer's output with query i of row b attending to key j where sees(b, i, j)."""
    B, T, _ = x.shape
    H, G, D = attn.n_head, attn.n_kv, attn.head_size
    q = apply_rope(attn.q_proj(x).view(B, T, H, D).transpose(1, 2), cos, sin, attn.rope_n_elem)
    k = apply_rope(attn.k_proj(x).view(B, T, G, D).transpose(1, 2), cos, sin, attn.rope_n_elem)
    v = attn.v_proj(x).view(B, T, G, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # (B, H, T, D)
    allowed = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            for j in range(T):
                allowed[b, 0, i, j] = sees(b, i, j)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("window", [1, 3, 5, 100])
def test_sliding_window_attention_equals_a_dense_mask_reference(window):
    model = _model(sliding_window=window)
    attn = model.blocks[0].attn
    assert attn.window == window
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope(0, 11, x.device)
    with torch.no_grad():
        got = attn(x, cos, sin, None)
        want = _dense_reference(attn, x, cos, sin, lambda b, i, j: j <= i and i - j < window)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [None, 2, 4])
def test_packed_samples_with_a_window_equal_a_dense_block_diagonal_reference(window):
    model = _model(sliding_window=window)
    attn = model.blocks[0].attn
    document_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2], [5] * 7 + [6] * 5])
    positions, segments = document_segments(document_ids)
    cos, sin = model.rope.at(positions, "cpu")
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    span = window or 12

    def sees(b, i, j):
        return document_ids[b, i] == document_ids[b, j] and j <= i and i - j < span

    with torch.no_grad():
        got = attn(x, cos, sin, None, segments)
        want = _dense_reference(attn, x, cos, sin, sees)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_packed_row_with_a_window_gives_each_sample_what_it_gets_alone():
    model = _model(sliding_window=3, layer_types=["local", "global"])
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 97, (6,), generator=g), torch.randint(0, 97, (9,), generator=g)
    with torch.no_grad():
        packed = model(torch.cat([a, b])[None], document_ids=torch.tensor([[0] * 6 + [1] * 9]))[0]
        alone = torch.cat([model(a[None])[0], model(b[None])[0]])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_the_window_changes_the_output_only_past_its_length():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 97, (1, 12), generator=g)
    with torch.no_grad():
        full = _model()(ids)
        windowed = _model(sliding_window=4)(ids)
        wide = _model(sliding_window=12)(ids)
    torch.testing.assert_close(windowed[:, :4], full[:, :4], rtol=0, atol=1e-6)  # nothing out of reach yet
    assert not torch.allclose(windowed[:, 4:], full[:, 4:], atol=1e-3)
    torch.testing.assert_close(wide, full, rtol=0, atol=0)  # a window as long as the input is no window


@pytest.mark.parametrize("layer_types", [None, ["local", "global"]])
def test_kv_cache_decoding_past_the_window_equals_the_full_forward(layer_types):
    """A prompt, a chunk prefilled at start > 0, then one token at a time, far past the window of 3:
    each step's logits equal the full forward's at the same positions."""
    model = _model(sliding_window=3, layer_types=layer_types)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        model.set_kv_cache(2, 16)
        steps = [model(ids[:, :5], input_pos=0), model(ids[:, 5:9], input_pos=5)]
        steps += [model(ids[:, t : t + 1], input_pos=t) for t in range(9, 16)]
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [False, True])
def test_a_left_padded_cache_with_a_window_gives_each_row_what_it_gets_alone(sinks):
    model = _model(sliding_window=3, attention_sinks=sinks)
    if sinks:
        with torch.no_grad():
            for block in model.blocks:
                block.attn.sinks.copy_(_sinks())
    g = torch.Generator().manual_seed(6)
    short, long = torch.randint(0, 97, (4,), generator=g), torch.randint(0, 97, (7,), generator=g)
    batch = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long])
    more = torch.randint(0, 97, (2, 5), generator=g)
    with torch.no_grad():
        model.set_kv_cache(2, 12, left_padding=torch.tensor([3, 0]))
        steps = [model(batch, input_pos=0)[:, -1:]]
        steps += [model(more[:, t : t + 1], input_pos=7 + t) for t in range(5)]
        model.clear_kv_cache()
        got = torch.cat(steps, dim=1)  # (2, 6, V): the prompt's last position and 5 decoded ones
        for row, prompt in enumerate([short, long]):
            alone = model(torch.cat([prompt, more[row]])[None])[0, -6:]
            torch.testing.assert_close(got[row], alone, rtol=1e-5, atol=1e-5)


def test_attention_mask_is_none_where_causal_attention_says_it_all():
    assert attention_mask(5, 5, "cpu") == (None, True)
    assert attention_mask(1, 9, "cpu") == (None, False)  # one new token sees every cached key
    assert attention_mask(5, 5, "cpu", window=5) == (None, True)
    mask, is_causal = attention_mask(2, 6, "cpu", window=3)
    assert not is_causal
    assert mask.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]


def test_layers_without_rope_ignore_positions():
    """Every layer without RoPE: the rotary base cannot matter. With RoPE in one layer, it does."""
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = _model(no_rope_layers=[0, 1])(ids)
        b = _model(no_rope_layers=[0, 1], rope_base=77.0)(ids)
        c = _model(no_rope_layers=[0])(ids)
        d = _model(no_rope_layers=[0], rope_base=77.0)(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(c, d, atol=1e-3)


# ------------------------------------------------------------------------------ config


def test_layer_specs_follow_the_config():
    config = Config(**TINY, sliding_window=8, layer_types=["local", "global"], no_rope_layers=[1])
    assert config.layer(0) == (8, True, False) and config.layer(1) == (None, False, False)
    assert [Config(**TINY, sliding_window=8).layer(i).window for i in range(2)] == [8, 8]  # None: every layer local
    assert [Config(**TINY).layer(i) for i in range(2)] == [(None, True, False), (None, True, False)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
        (dict(sliding_window=True), "sliding_window must be"),
        (dict(sliding_window=4, layer_types=["local"]), "layer_types has 1 entries for n_layer=2"),
        (dict(sliding_window=4, layer_types=["local", "sliding"]), "layer_types entries must be one of"),
        (dict(layer_types=["local", "global"]), "local layers but sliding_window is not set"),
        (dict(layer_types="global"), "layer_types must be a list"),
        (dict(no_rope_layers=[2]), r"no_rope_layers entries must be layer indices in \[0, 2\)"),
        (dict(no_rope_layers=[1, 1]), "no_rope_layers lists a layer twice"),
    ],
)
def test_per_layer_fields_are_checked_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as err:
        Config(**TINY, **overrides)
    assert "\n" not in str(err.value)


def test_new_fields_round_trip_and_old_config_files_load(tmp_path):
    config = Config(**TINY, sliding_window=8, layer_types=["local", "global"], no_rope_layers=[0],
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_seq_len": 32})
    config.save(tmp_path)
    assert Config.from_file(tmp_path) == config
    old = Config.from_name("llama-3.1-8b").to_dict()
    for key in ("sliding_window", "layer_types", "no_rope_layers"):  # a file written before they existed
        del old[key]
    assert Config.from_dict(old) == Config.from_name("llama-3.1-8b")
    assert Config.from_dict(old).rope_scaling_type == "llama3"


# ------------------------------------------------------------------------------ RoPE scalings


def test_every_rope_scaling_has_a_function_taking_exactly_its_keys():
    assert set(ROPE_SCALINGS) == set(ROPE_SCALING_KEYS)
    for kind, fn in ROPE_SCALINGS.items():
        params = inspect.signature(fn).parameters.values()
        keys = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        asked = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        assert keys[1:] == ROPE_SCALING_KEYS[kind]
        assert asked <= {"base", "long"}  # what RotaryEmbedding knows how to give


def test_rope_scaling_without_a_type_is_llama3():
    keys = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 32}
    untyped = RotaryEmbedding(Config(**TINY, rope_scaling=keys)).inverse_frequencies("cpu")
    typed = RotaryEmbedding(Config(**TINY, rope_scaling={"rope_type": "llama3", **keys})).inverse_frequencies("cpu")
    plain = RotaryEmbedding(Config(**TINY)).inverse_frequencies("cpu")
    torch.testing.assert_close(untyped, llama3_scale_frequencies(plain, **keys), rtol=0, atol=0)
    torch.testing.assert_close(typed, untyped, rtol=0, atol=0)
    assert not torch.equal(untyped, plain)


@pytest.mark.parametrize(
    "scaling, message",
    [({"rope_type": "dynamic", "factor": 4.0}, "rope_scaling's rope_type 'dynamic' is not one of"),
     ({"rope_type": "llama3", "factor": 4.0}, "rope_scaling lacks"),
     ({"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 32}, "rope_scaling lacks"),
     ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4, "original_max_seq_len": 32,
       "attention_factor": 1.0}, "short_factor must be a list of 4 positive numbers")],
)
def test_unknown_or_incomplete_rope_scalings_are_refused(scaling, message):
    with pytest.raises(UserError, match=message) as err:
        Config(**TINY, rope_scaling=scaling)
    assert "\n" not in str(err.value)


# LongRoPE on TINY's heads of 8 (4 rotated pairs): sequences longer than 12 tokens take the long factors.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [2.0, 3.0, 8.0, 16.0],
            "original_max_seq_len": 12, "attention_factor": 1.25}


def test_longrope_rotates_a_whole_sequence_by_the_long_factors_past_its_switch():
    rope = RotaryEmbedding(Config(**TINY, rope_scaling=LONGROPE))
    plain = RotaryEmbedding(Config(**TINY)).inverse_frequencies("cpu")
    tables = {n: rope(0, n, "cpu") for n in (12, 13)}
    for n, factors in ((12, LONGROPE["short_factor"]), (13, LONGROPE["long_factor"])):
        angles = torch.arange(n).float()[:, None] * (plain / torch.tensor(factors))  # (n, 4)
        angles = torch.cat([angles, angles], dim=-1)
        torch.testing.assert_close(tables[n][0], 1.25 * angles.cos())
        torch.testing.assert_close(tables[n][1], 1.25 * angles.sin())
    assert not torch.allclose(tables[12][0], tables[13][0][:12])  # the first 12 positions switch too
    # rows of a batch: the longest decides; packed samples: each its own length
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    torch.testing.assert_close(rope.at(positions, "cpu")[0][0, 0], tables[13][0])
    packed = torch.tensor([list(range(10)) + list(range(13))])
    cos = rope.at(packed, "cpu", torch.tensor([[10, 13]]))[0][0, 0]
    torch.testing.assert_close(cos[:10], rope(0, 10, "cpu")[0])
    torch.testing.assert_close(cos[10:], tables[13][0])


def test_a_cache_does_not_continue_across_the_longrope_switch_and_generation_runs_the_sequence_again():
    from toolkit.sampling import generate_tokens

    model = _model(rope_scaling=LONGROPE)
    ids = torch.randint(0, TINY["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.set_kv_cache(1, 16)
        model(ids[:, :12], input_pos=0)
        with pytest.raises(ValueError, match="LongRoPE"):
            model(ids[:, 12:13], input_pos=12)
        model.clear_kv_cache()
        sequence = ids[0, :8]
        for _ in range(8):  # greedy without a cache: every step a whole forward pass
            sequence = torch.cat([sequence, model(sequence[None])[0, -1].argmax()[None]])
    assert torch.equal(generate_tokens(model, ids[0, :8], max_new_tokens=8, temperature=0.0, top_k=None), sequence)


def test_export_refuses_per_layer_fields_it_cannot_express():
    from toolkit.convert import config_to_hf

    for overrides in (dict(sliding_window=4), dict(no_rope_layers=[0])):
        with pytest.raises(UserError, match=next(iter(overrides))):
            config_to_hf(Config.from_name("debug", **overrides))


def test_a_window_shortens_the_attention_flops_only_below_the_sequence_length():
    full = flops_per_token(Config(**TINY), 64)
    assert flops_per_token(Config(**TINY, sliding_window=64), 64) == full
    local = flops_per_token(Config(**TINY, sliding_window=4), 64)
    mixed = flops_per_token(Config(**TINY, sliding_window=4, layer_types=["local", "global"]), 64)
    assert local < mixed < full
    # one query-key pair costs 3 (fwd + bwd) x 2 matmuls x 2 FLOPs x heads x head size
    pair = 3 * 2 * 2 * TINY["n_head"] * (TINY["n_embd"] // TINY["n_head"])
    assert full - mixed == pytest.approx(pair * (64 / 2 - (4 * 5 / 2 + 60 * 4) / 64))


# ------------------------------------------------------------------------------ the kernels behind `attend`


def _reference_attention(q, k, v, sees, scale, softcap=None, sinks=None):
    """softmax(cap(q k^T * scale) where sees(i, j)) v in float64, key/value heads repeated. With
    `sinks` (H,): the scores get one more column, the head's sink, and its probability is dropped
    after the softmax (gpt-oss's eager attention)."""
    H, G = q.shape[1], k.shape[1]
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    T, S = q.shape[2], k.shape[2]
    allowed = torch.tensor([[sees(i, j) for j in range(S)] for i in range(T)])
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    column = sinks.double().view(1, H, 1, 1).expand(q.shape[0], H, T, 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1] @ v


def _sinks(H=4, seed=7):
    """Sinks (H,) around the scores' size, so that each takes a real share of the softmax."""
    return (torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2 + 1).requires_grad_()


def _qkv(T, S=None, B=2, H=4, G=2, D=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = S or T
    q = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype).requires_grad_()
    k = (torch.randn(B, G, S, D, generator=g) * 2).to(dtype).requires_grad_()
    v = torch.randn(B, G, S, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("window, softcap", [(5, None), (5, 3.0), (None, 3.0), (40, 3.0)])
@pytest.mark.parametrize("rows", [4, 7, 64])
def test_chunked_window_and_softcap_attention_equal_a_dense_reference_with_gradients(window, softcap, rows):
    """`windowed_attention` (SDPA per chunk) and `chunked_attention` (its own backward pass),
    whatever the chunk of queries, against the dense float64 reference: outputs and the gradients
    of q, k and v. Scale 0.3 (query_pre_attn_scalar), grouped-query heads."""
    from toolkit.models.attention import chunked_attention, windowed_attention

    q, k, v = _qkv(19)
    span = window or 19
    want = _reference_attention(q, k, v, lambda i, j: j <= i and i - j < span, 0.3, softcap)
    if softcap is None:
        got = windowed_attention(q, k, v, 0.3, window, rows=rows)
    else:
        got = chunked_attention(q, k, v, 0.3, softcap, window, rows=rows)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    got_grads = torch.autograd.grad((got * upstream.float()).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    for g, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), ref.double(), rtol=0, atol=1e-5)


def _fake_attention_peaks(monkeypatch, every_chunk: bool, window, softcap, sinks) -> tuple[int, int]:
    """Peak bytes of live storages (forward, forward and backward) of `chunked_attention` on fake
    tensors, with the fake path's chunks or (`every_chunk`) every chunk as on real tensors."""
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import toolkit.models.attention as attention

    if every_chunk:
        monkeypatch.setattr(attention, "_chunks_to_compute", lambda q, T, S, rows, window: list(
            attention._query_chunks(T, S, rows, window)))

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (key := t.untyped_storage()._cdata) not in self.seen | inputs:
                    size = t.untyped_storage().nbytes()
                    self.seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, lambda size=size, key=key: (setattr(self, "live", self.live - size),
                                                                    self.seen.discard(key)))
            return out

    with FakeTensorMode():
        q, k, v = (torch.randn(1, h, 1000, 64, requires_grad=True) for h in (8, 2, 2))
        sink = torch.zeros(8, requires_grad=True) if sinks else None
        live = Live()
        with live:
            out = attention.chunked_attention(q, k, v, None, softcap=softcap, window=window, rows=128, sinks=sink)
            forward = live.peak
            out.sum().backward()
    return forward, live.peak


@pytest.mark.parametrize("window, softcap, sinks", [(None, None, True), (None, 50.0, False), (128, 50.0, True),
                                                     (300, None, True)])
def test_fake_tensors_run_the_largest_chunk_for_the_peak_of_every_chunk(monkeypatch, window, softcap, sinks):
    """On fake tensors (the estimate, the pre-flight, the simulated step) chunked attention runs its
    largest chunk twice instead of every chunk: the forward peak is the loop's, and the backward's
    is the loop's or above it by less than one chunk's scores (the largest chunk's leftovers stand
    for a smaller one's), never below it."""
    one = _fake_attention_peaks(monkeypatch, False, window, softcap, sinks)
    every = _fake_attention_peaks(monkeypatch, True, window, softcap, sinks)
    assert one[0] == every[0]
    chunk_scores = 4 * 8 * 128 * (1000 if window is None else 128 + window)  # float32, heads x rows x keys
    assert every[1] <= one[1] < every[1] + chunk_scores, (one, every)


def test_a_softcap_changes_attention_and_bf16_chunked_attention_is_close_to_float32():
    from toolkit.models.attention import chunked_attention

    q, k, v = _qkv(12)
    capped = chunked_attention(q, k, v, 0.5, 1.0)
    plain = _reference_attention(q, k, v, lambda i, j: j <= i, 0.5)
    assert (capped.double() - plain).abs().max() > 0.1
    q16, k16, v16 = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    low = chunked_attention(q16, k16, v16, 0.5, 1.0, rows=5)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), capped, rtol=0, atol=5e-2)
    grads = torch.autograd.grad(low.float().sum(), (q16, k16, v16))
    want = torch.autograd.grad(capped.sum(), (q, k, v))
    for g, ref in zip(grads, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), ref, rtol=0, atol=1e-1)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_decoding_with_cached_keys_and_padding_equals_the_reference(softcap):
    """T queries at the last T of S cached slots, left padding, window 4: `attend`'s chunked paths."""
    from toolkit.models.attention import attend

    q, k, v = _qkv(3, 11, seed=3)
    padding = torch.tensor([2, 0])
    with torch.no_grad():
        got = attend(q, k, v, 0.4, 4, softcap, padding)
    for b in range(2):
        def sees(i, j, b=b):
            i = i + 8
            return j == i or (j <= i and i - j < 4 and j >= padding[b])

        want = _reference_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], sees, 0.4, softcap)
        torch.testing.assert_close(got[b : b + 1].double(), want, rtol=0, atol=2e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_flex_attention_backend_equals_the_reference(softcap):
    """The CUDA path (flex_attention with a block mask and a softcap score_mod), run eagerly on the
    CPU without gradients (torch 2.13 has no CPU backward for it): window, documents of a packed row."""
    from toolkit.models.attention import attention_backend, flex_attend

    q, k, v = (t.detach() for t in _qkv(20, seed=4))
    documents = torch.tensor([[0] * 9 + [1] * 11, [0] * 20])
    with torch.no_grad(), attention_backend("flex"):
        got = flex_attend(q, k, v, 0.3, 5, softcap, documents)
    for b in range(2):
        def sees(i, j, b=b):
            return documents[b, i] == documents[b, j] and j <= i and i - j < 5

        want = _reference_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], sees, 0.3, softcap)
        torch.testing.assert_close(got[b : b + 1].double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0), (40, 3.0)])
@pytest.mark.parametrize("rows", [4, 64])
def test_attention_sinks_equal_a_dense_reference_with_a_sink_column_with_gradients(window, softcap, rows):
    """`chunked_attention` with sinks against scores with a sink column, softmax, column dropped
    (float64): outputs and the gradients of q, k, v and the sinks, any window, softcap and chunk."""
    from toolkit.models.attention import chunked_attention

    q, k, v = _qkv(19)
    sinks = _sinks()
    span = window or 19
    want = _reference_attention(q, k, v, lambda i, j: j <= i and i - j < span, 0.3, softcap, sinks)
    got = chunked_attention(q, k, v, 0.3, softcap, window, rows=rows, sinks=sinks)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    without = _reference_attention(q, k, v, lambda i, j: j <= i and i - j < span, 0.3, softcap)
    assert (want - without).abs().max() > 0.05  # the sinks matter
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_grads = torch.autograd.grad((got * upstream.float()).sum(), (q, k, v, sinks))
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v, sinks))
    for g, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), ref.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_decoding_with_sinks_cached_keys_and_padding_equals_the_reference(window):
    """`attend` with sinks for T queries at the last T of S cached slots of left-padded rows."""
    from toolkit.models.attention import attend

    q, k, v = _qkv(3, 11, seed=3)
    sinks = _sinks()
    padding = torch.tensor([2, 0])
    with torch.no_grad():
        for T in (3, 1):  # a chunk of queries, then one token
            got = attend(q[:, :, -T:], k, v, 0.4, window, None, padding, sinks)
            for b in range(2):
                def sees(i, j, b=b, T=T):
                    i = i + 11 - T
                    return j == i or (j <= i and (window is None or i - j < window) and j >= padding[b])

                want = _reference_attention(q[b : b + 1, :, -T:], k[b : b + 1], v[b : b + 1], sees, 0.4, None, sinks)
                torch.testing.assert_close(got[b : b + 1].double(), want, rtol=2e-6, atol=2e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_attention_with_sinks_equals_the_reference(window):
    """The CUDA path's sinks (the output scaled by sigmoid(lse - sink) with flex_attention's
    log-sum-exp), run eagerly on the CPU without gradients; documents of a packed row. Its
    gradients are checked on a GPU (the attention_sinks check of benchmarks/gpu_check.py)."""
    from toolkit.models.attention import attention_backend, flex_attend

    q, k, v = (t.detach() for t in _qkv(20, seed=4))
    sinks = _sinks().detach()
    documents = torch.tensor([[0] * 9 + [1] * 11, [0] * 20])
    with torch.no_grad(), attention_backend("flex"):
        got = flex_attend(q, k, v, 0.3, window, None, documents, sinks)
    span = window or 20
    for b in range(2):
        def sees(i, j, b=b):
            return documents[b, i] == documents[b, j] and j <= i and i - j < span

        want = _reference_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1], sees, 0.3, None, sinks)
        torch.testing.assert_close(got[b : b + 1].double(), want, rtol=0, atol=2e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_gradients_flow_through_flex_attentions_log_sum_exp_into_the_sinks(monkeypatch):
    """The CUDA path differentiates through flex_attention's log-sum-exp. On the CPU torch 2.13
    refuses flex_attention's backward at its public entry (`_validate_device`); lifted, its autograd
    op runs its dense reference backward, which takes d(lse) as the Triton kernel does (folded into
    delta): q, k, v and sinks get the dense reference's gradients. The compiled kernel itself is
    checked on a GPU (the attention_sinks check of benchmarks/gpu_check.py)."""
    import torch.nn.attention.flex_attention as flex

    from toolkit.models.attention import attention_backend, flex_attend

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    q, k, v = _qkv(20, seed=4)
    sinks = _sinks()
    documents = torch.tensor([[0] * 9 + [1] * 11, [0] * 20])
    with attention_backend("flex"):
        got = flex_attend(q, k, v, 0.3, 5, None, documents, sinks)
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v, sinks))
    want = torch.cat([
        _reference_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1],
                             lambda i, j, b=b: documents[b, i] == documents[b, j] and j <= i and i - j < 5, 0.3, None,
                             sinks)
        for b in range(2)])
    want_grads = torch.autograd.grad((want * upstream.double()).sum(), (q, k, v, sinks))
    for g, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), ref.double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_a_layer_with_sinks_gives_packed_samples_what_they_get_alone_and_decodes_as_it_runs_whole(window):
    """CausalSelfAttention with sinks through `segment_attention` (packed) and the KV cache."""
    model = _model(sliding_window=window, attention_sinks=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.copy_(_sinks(seed=block.attn.n_head))
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(ids, document_ids=torch.tensor([[0] * 6 + [1] * 7]))
        alone = torch.cat([model(ids[:, :6]), model(ids[:, 6:])], dim=1)
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
        whole = model(ids)
        model.set_kv_cache(1, 13)
        steps = [model(ids[:, :5], input_pos=0)] + [model(ids[:, i : i + 1], input_pos=i) for i in range(5, 13)]
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    assert (alone - model.eval()(ids)).abs().max() > 0  # packing changes what the second sample sees


def test_a_long_window_never_builds_a_mask_over_all_queries_and_keys():
    """At T = 2048 with a window of 64, no tensor that `attend` makes (masks, scores) holds T x T / 8
    elements: the work is block-sparse. Attention sinks, windowed or not, are computed by chunks of
    queries too (without a window, a chunk's scores reach every key, never all queries' at once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from toolkit.models.attention import attend

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    T = 2048
    q, k, v = _qkv(T, B=1, H=2, G=1, D=4)
    sinks = torch.zeros(2, requires_grad=True)
    for window, softcap, sink in ((64, None, None), (64, 5.0, None), (64, None, sinks), (None, None, sinks)):
        Largest.largest = 0
        with Largest():
            out = attend(q, k, v, None, window, softcap, sinks=sink)
            out.sum().backward()
        # a chunk of 128 queries against all 2048 keys (2 heads) is T x T / 8; the whole would be 2 x T x T
        assert Largest.largest < (T * T // 8 if window else T * T // 4), (window, softcap, sink, Largest.largest)
