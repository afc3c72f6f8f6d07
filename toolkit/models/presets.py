"""Named model presets: plain data, one list per family, looked up by name, alias or HF repo id.

Each entry holds the `Config` fields that differ from the defaults. Sizes are those of the
published Hugging Face `config.json` files; a test instantiates every preset on the meta device and
checks the parameter count against the published one (`expected_params`).
"""

from __future__ import annotations

from typing import Any

from toolkit.errors import UserError, did_you_mean

_LLAMA_31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
_LLAMA_32_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}

LLAMA = [
    dict(
        name="tiny-llama-1.1b", aliases=["tiny-llama"],
        hf_repo_id="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
        vocab_size=32000, block_size=2048, n_layer=22, n_embd=2048, n_head=32, n_query_groups=4,
        intermediate_size=5632, expected_params=1_100_048_384,
    ),
    dict(
        name="llama-2-7b", hf_repo_id="meta-llama/Llama-2-7b-hf",
        vocab_size=32000, block_size=4096, n_layer=32, n_embd=4096, n_head=32, intermediate_size=11008,
        expected_params=6_738_415_616,
    ),
    dict(
        name="llama-3-8b", hf_repo_id="meta-llama/Meta-Llama-3-8B",
        vocab_size=128256, block_size=8192, n_layer=32, n_embd=4096, n_head=32, n_query_groups=8,
        intermediate_size=14336, rope_base=500000.0, expected_params=8_030_261_248,
    ),
    dict(
        name="llama-3.1-8b", hf_repo_id="meta-llama/Llama-3.1-8B",
        vocab_size=128256, block_size=131072, n_layer=32, n_embd=4096, n_head=32, n_query_groups=8,
        intermediate_size=14336, rope_base=500000.0, rope_scaling=_LLAMA_31_SCALING,
        expected_params=8_030_261_248,
    ),
    dict(
        name="llama-3.1-70b", hf_repo_id="meta-llama/Llama-3.1-70B",
        vocab_size=128256, block_size=131072, n_layer=80, n_embd=8192, n_head=64, n_query_groups=8,
        intermediate_size=28672, rope_base=500000.0, rope_scaling=_LLAMA_31_SCALING,
        expected_params=70_553_706_496,
    ),
    dict(
        name="llama-3.2-1b", hf_repo_id="meta-llama/Llama-3.2-1B",
        vocab_size=128256, block_size=131072, n_layer=16, n_embd=2048, n_head=32, n_query_groups=8,
        intermediate_size=8192, rope_base=500000.0, rope_scaling=_LLAMA_32_SCALING, tie_embeddings=True,
        expected_params=1_235_814_400,
    ),
    dict(
        name="llama-3.2-3b", hf_repo_id="meta-llama/Llama-3.2-3B",
        vocab_size=128256, block_size=131072, n_layer=28, n_embd=3072, n_head=24, n_query_groups=8,
        intermediate_size=8192, rope_base=500000.0, rope_scaling=_LLAMA_32_SCALING, tie_embeddings=True,
        expected_params=3_212_749_824,
    ),
    # Llama 3.3 was released as an instruction-tuned model only
    dict(
        name="llama-3.3-70b-instruct", aliases=["llama-3.3-70b"], hf_repo_id="meta-llama/Llama-3.3-70B-Instruct",
        vocab_size=128256, block_size=131072, n_layer=80, n_embd=8192, n_head=64, n_query_groups=8,
        intermediate_size=28672, rope_base=500000.0, rope_scaling=_LLAMA_31_SCALING,
        expected_params=70_553_706_496,
    ),
]

MISTRAL = [
    dict(
        name="mistral-7b", hf_repo_id="mistralai/Mistral-7B-v0.1", family="mistral",
        vocab_size=32000, block_size=32768, n_layer=32, n_embd=4096, n_head=32, n_query_groups=8,
        intermediate_size=14336, sliding_window=4096, expected_params=7_241_732_096,
    ),
]

QWEN2 = [
    dict(
        name="qwen2.5-0.5b", hf_repo_id="Qwen/Qwen2.5-0.5B", family="qwen2",
        vocab_size=151936, block_size=32768, n_layer=24, n_embd=896, n_head=14, n_query_groups=2,
        intermediate_size=4864, attn_qkv_bias=True, rope_base=1000000.0, norm_eps=1e-6, tie_embeddings=True,
        expected_params=494_032_768,
    ),
    dict(
        name="qwen2.5-7b", hf_repo_id="Qwen/Qwen2.5-7B", family="qwen2",
        vocab_size=152064, block_size=131072, n_layer=28, n_embd=3584, n_head=28, n_query_groups=4,
        intermediate_size=18944, attn_qkv_bias=True, rope_base=1000000.0, norm_eps=1e-6,
        expected_params=7_615_616_512,
    ),
]

GEMMA = [
    dict(
        name="gemma-2b", hf_repo_id="google/gemma-2b", family="gemma",
        vocab_size=256000, block_size=8192, n_layer=18, n_embd=2048, n_head=8, n_query_groups=1, head_size=256,
        intermediate_size=16384, mlp="geglu", gelu_approximate="tanh", norm_eps=1e-6, norm_unit_offset=True,
        tie_embeddings=True, scale_embeddings=True, expected_params=2_506_172_416,
    ),
]

PHI = [
    dict(
        name="phi-2", hf_repo_id="microsoft/phi-2", family="phi",
        vocab_size=51200, block_size=2048, n_layer=32, n_embd=2560, n_head=32, intermediate_size=10240,
        norm="layernorm", mlp="gelu", gelu_approximate="tanh", bias=True, lm_head_bias=True,
        parallel_residual=True, shared_attention_norm=True, rotary_percentage=0.4,
        expected_params=2_779_683_840,
    ),
]

_PYTHIA = dict(
    family="gpt_neox", vocab_size=50304, block_size=2048, norm="layernorm", mlp="gelu", bias=True,
    parallel_residual=True, rotary_percentage=0.25,
)
PYTHIA = [
    dict(_PYTHIA, name="pythia-14m", hf_repo_id="EleutherAI/pythia-14m", n_layer=6, n_embd=128, n_head=4,
         expected_params=14_067_712),
    dict(_PYTHIA, name="pythia-160m", hf_repo_id="EleutherAI/pythia-160m", n_layer=12, n_embd=768, n_head=12,
         expected_params=162_322_944),
    dict(_PYTHIA, name="pythia-1b", hf_repo_id="EleutherAI/pythia-1b", n_layer=16, n_embd=2048, n_head=8,
         expected_params=1_011_781_632),
]

# Tiny models for tests and the CPU quick start. `debug` matches the 4096-token BPE tokenizer that
# the quick start trains; the others exercise the remaining architecture features.
DEBUG = [
    dict(name="debug", vocab_size=4096, block_size=512, n_layer=6, n_embd=256, n_head=8, n_query_groups=2,
         intermediate_size=704),
    dict(name="debug-neox", family="gpt_neox", vocab_size=50304, block_size=512, n_layer=2, n_embd=64, n_head=4,
         norm="layernorm", mlp="gelu", bias=True, parallel_residual=True, rotary_percentage=0.25),
    dict(name="debug-llama2", vocab_size=32000, block_size=512, n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
         intermediate_size=176),
    dict(name="debug-gemma", family="gemma", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=1, head_size=32, intermediate_size=128, mlp="geglu", gelu_approximate="tanh",
         norm_unit_offset=True, tie_embeddings=True, scale_embeddings=True, norm_eps=1e-6),
    dict(name="debug-phi", family="phi", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         norm="layernorm", mlp="gelu", gelu_approximate="tanh", bias=True, lm_head_bias=True,
         parallel_residual=True, shared_attention_norm=True, rotary_percentage=0.5),
    dict(name="debug-qwen3", family="qwen3", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=2, head_size=32, intermediate_size=128, norm_eps=1e-6, qk_norm="head", tie_embeddings=True),
    dict(name="debug-olmo2", family="olmo2", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=2, intermediate_size=128, norm_eps=1e-6, norm_position="post", qk_norm="projection"),
    dict(name="debug-smollm3", family="smollm3", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=2, intermediate_size=128, norm_eps=1e-6, tie_embeddings=True, no_rope_layers=[1]),
]

# Qwen3 dense: head size 128 whatever the width, per-head QK RMSNorm; the three smallest tie the head.
# The repositories are the released (post-trained) models; there is no Qwen3-32B-Base.
_QWEN3 = dict(family="qwen3", vocab_size=151936, block_size=40960, head_size=128, n_query_groups=8,
              rope_base=1000000.0, norm_eps=1e-6, qk_norm="head")
QWEN3 = [
    dict(_QWEN3, name="qwen3-0.6b", hf_repo_id="Qwen/Qwen3-0.6B", n_layer=28, n_embd=1024, n_head=16,
         intermediate_size=3072, tie_embeddings=True, expected_params=596_049_920),
    dict(_QWEN3, name="qwen3-1.7b", hf_repo_id="Qwen/Qwen3-1.7B", n_layer=28, n_embd=2048, n_head=16,
         intermediate_size=6144, tie_embeddings=True, expected_params=1_720_574_976),
    dict(_QWEN3, name="qwen3-4b", hf_repo_id="Qwen/Qwen3-4B", n_layer=36, n_embd=2560, n_head=32,
         intermediate_size=9728, tie_embeddings=True, expected_params=4_022_468_096),
    dict(_QWEN3, name="qwen3-8b", hf_repo_id="Qwen/Qwen3-8B", n_layer=36, n_embd=4096, n_head=32,
         intermediate_size=12288, expected_params=8_190_735_360),
    dict(_QWEN3, name="qwen3-14b", hf_repo_id="Qwen/Qwen3-14B", n_layer=40, n_embd=5120, n_head=40,
         intermediate_size=17408, expected_params=14_768_307_200),
    dict(_QWEN3, name="qwen3-32b", hf_repo_id="Qwen/Qwen3-32B", n_layer=64, n_embd=5120, n_head=64,
         intermediate_size=25600, expected_params=32_762_123_264),
]

# OLMo 2: norms after attention and MLP only, QK RMSNorm over the whole projections.
_OLMO2 = dict(family="olmo2", vocab_size=100352, block_size=4096, rope_base=500000.0, norm_eps=1e-6,
              norm_position="post", qk_norm="projection")
OLMO2 = [
    dict(_OLMO2, name="olmo-2-1b", hf_repo_id="allenai/OLMo-2-0425-1B", n_layer=16, n_embd=2048, n_head=16,
         intermediate_size=8192, expected_params=1_484_916_736),
    dict(_OLMO2, name="olmo-2-7b", hf_repo_id="allenai/OLMo-2-1124-7B", n_layer=32, n_embd=4096, n_head=32,
         intermediate_size=11008, expected_params=7_298_617_344),
    dict(_OLMO2, name="olmo-2-13b", hf_repo_id="allenai/OLMo-2-1124-13B", n_layer=40, n_embd=5120, n_head=40,
         intermediate_size=13824, expected_params=13_716_198_400),
    dict(_OLMO2, name="olmo-2-32b", hf_repo_id="allenai/OLMo-2-0325-32B", n_layer=64, n_embd=5120, n_head=40,
         n_query_groups=8, intermediate_size=27648, expected_params=32_234_279_936),
]

# SmolLM3: Llama-like, every fourth layer without RoPE (layers 3, 7, ..., 35).
SMOLLM3 = [
    dict(name="smollm3-3b", hf_repo_id="HuggingFaceTB/SmolLM3-3B", family="smollm3",
         vocab_size=128256, block_size=65536, n_layer=36, n_embd=2048, n_head=16, n_query_groups=4,
         intermediate_size=11008, rope_base=5000000.0, norm_eps=1e-6, tie_embeddings=True,
         no_rope_layers=list(range(3, 36, 4)), expected_params=3_075_098_624),
]

PRESETS: list[dict[str, Any]] = [*LLAMA, *MISTRAL, *QWEN2, *GEMMA, *PHI, *PYTHIA, *QWEN3, *OLMO2, *SMOLLM3, *DEBUG]


# Family id (Config.family) -> the name `toolkit list` shows; a family not listed shows its id.
FAMILY_TITLES: dict[str, str] = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2.5", "qwen3": "Qwen3", "gemma": "Gemma",
    "phi": "Phi", "gpt_neox": "GPT-NeoX (Pythia)", "olmo2": "OLMo 2", "smollm3": "SmolLM3",
}
# The title of the group of presets that mirror no published model (tests, the CPU quick start).
TINY_TITLE = "Tiny models for tests and the CPU quick start"


def presets_by_family() -> dict[str, list[dict[str, Any]]]:
    """Group title -> its presets, groups and presets in the order of PRESETS; the presets without a
    Hugging Face repository (the tiny ones) last, in a group of their own."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for preset in PRESETS:
        if preset.get("hf_repo_id"):
            family = preset.get("family", "llama")
            groups.setdefault(FAMILY_TITLES.get(family, family), []).append(preset)
    tiny = [p for p in PRESETS if not p.get("hf_repo_id")]
    return {**groups, TINY_TITLE: tiny} if tiny else groups


def _index() -> dict[str, dict[str, Any]]:
    index: dict[str, dict[str, Any]] = {}
    for preset in PRESETS:
        for key in (preset["name"], *preset.get("aliases", ()), preset.get("hf_repo_id", "")):
            if key:
                index[key.lower()] = preset
    return index


def preset_names() -> list[str]:
    return [p["name"] for p in PRESETS]


def find_preset(name: str) -> dict[str, Any]:
    """The preset's fields (without bookkeeping keys) for a name, alias or HF repo id."""
    preset = _index().get(name.lower())
    if preset is None:
        raise UserError(
            f"Unknown model {name!r}.{did_you_mean(name, preset_names())} Run `toolkit list` to see every model."
        )
    return {k: v for k, v in preset.items() if k not in ("aliases", "expected_params")}
