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
]

MISTRAL = [
    dict(
        name="mistral-7b", hf_repo_id="mistralai/Mistral-7B-v0.1", family="mistral",
        vocab_size=32000, block_size=4096, n_layer=32, n_embd=4096, n_head=32, n_query_groups=8,
        intermediate_size=14336, expected_params=7_241_732_096,
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


def _every_nth_global(n_layer: int, period: int) -> list[str]:
    """Layer types with every `period`-th layer global, the others local (Gemma 2: 2, Gemma 3: 6)."""
    return ["global" if (i + 1) % period == 0 else "local" for i in range(n_layer)]


# Gemma 2 and 3: norms around attention and MLP, (1 + w) RMSNorm, scaled embeddings, tanh GeGLU,
# local (sliding-window) and global layers. Gemma 2 softcaps scores and logits; Gemma 3 normalises
# queries and keys per head and rotates local layers with their own base.
_GEMMA_2_3 = dict(
    norm_eps=1e-6, norm_unit_offset=True, norm_position="sandwich", mlp="geglu", gelu_approximate="tanh",
    scale_embeddings=True, tie_embeddings=True,
)
_GEMMA2 = dict(_GEMMA_2_3, family="gemma2", vocab_size=256000, block_size=8192, sliding_window=4096,
               attn_logit_softcap=50.0, final_logit_softcap=30.0)
_GEMMA3 = dict(_GEMMA_2_3, family="gemma3", qk_norm="head", rope_base=1000000.0, rope_local_base=10000.0)
# Gemma 3 4B and up: the text model of the published multimodal checkpoints (their parameter counts
# here are the language model's: Gemma 3 report, Table 1, embedding + non-embedding parameters)
_GEMMA3_LONG = dict(_GEMMA3, vocab_size=262208, block_size=131072, sliding_window=1024,
                    rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA_2_3 = [
    dict(_GEMMA2, name="gemma-2-2b", hf_repo_id="google/gemma-2-2b", aliases=["gemma-2-2b-it", "google/gemma-2-2b-it"],
         n_layer=26, n_embd=2304, n_head=8, n_query_groups=4, head_size=256, intermediate_size=9216,
         query_pre_attn_scalar=256, layer_types=_every_nth_global(26, 2), expected_params=2_614_341_888),
    dict(_GEMMA2, name="gemma-2-9b", hf_repo_id="google/gemma-2-9b", aliases=["gemma-2-9b-it", "google/gemma-2-9b-it"],
         n_layer=42, n_embd=3584, n_head=16, n_query_groups=8, head_size=256, intermediate_size=14336,
         query_pre_attn_scalar=256, layer_types=_every_nth_global(42, 2), expected_params=9_241_705_984),
    dict(_GEMMA2, name="gemma-2-27b", hf_repo_id="google/gemma-2-27b",
         aliases=["gemma-2-27b-it", "google/gemma-2-27b-it"],
         n_layer=46, n_embd=4608, n_head=32, n_query_groups=16, head_size=128, intermediate_size=36864,
         query_pre_attn_scalar=144, layer_types=_every_nth_global(46, 2), expected_params=27_227_128_320),
    dict(_GEMMA3, name="gemma-3-270m", hf_repo_id="google/gemma-3-270m", aliases=["gemma-3-270m-it", "google/gemma-3-270m-it"],
         vocab_size=262144, block_size=32768, sliding_window=512, n_layer=18, n_embd=640, n_head=4,
         n_query_groups=1, head_size=256, intermediate_size=2048, query_pre_attn_scalar=256,
         layer_types=_every_nth_global(18, 6), expected_params=268_098_176),
    dict(_GEMMA3, name="gemma-3-1b", hf_repo_id="google/gemma-3-1b-pt", aliases=["gemma-3-1b-it", "google/gemma-3-1b-it"],
         vocab_size=262144, block_size=32768, sliding_window=512, n_layer=26, n_embd=1152, n_head=4,
         n_query_groups=1, head_size=256, intermediate_size=6912, query_pre_attn_scalar=256,
         layer_types=_every_nth_global(26, 6), expected_params=999_885_952),
    dict(_GEMMA3_LONG, name="gemma-3-4b", hf_repo_id="google/gemma-3-4b-pt",
         aliases=["gemma-3-4b-it", "google/gemma-3-4b-it"],
         n_layer=34, n_embd=2560, n_head=8, n_query_groups=4, head_size=256, intermediate_size=10240,
         query_pre_attn_scalar=256, layer_types=_every_nth_global(34, 6), expected_params=3_884_000_000),
    dict(_GEMMA3_LONG, name="gemma-3-12b", hf_repo_id="google/gemma-3-12b-pt",
         aliases=["gemma-3-12b-it", "google/gemma-3-12b-it"],
         n_layer=48, n_embd=3840, n_head=16, n_query_groups=8, head_size=256, intermediate_size=15360,
         query_pre_attn_scalar=256, layer_types=_every_nth_global(48, 6), expected_params=11_771_000_000),
    dict(_GEMMA3_LONG, name="gemma-3-27b", hf_repo_id="google/gemma-3-27b-pt",
         aliases=["gemma-3-27b-it", "google/gemma-3-27b-it"],
         n_layer=62, n_embd=5376, n_head=32, n_query_groups=16, head_size=128, intermediate_size=21504,
         query_pre_attn_scalar=168, layer_types=_every_nth_global(62, 6), expected_params=27_016_000_000),
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
    dict(_GEMMA2, name="debug-gemma2", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=2, head_size=16, intermediate_size=128, sliding_window=16, query_pre_attn_scalar=24,
         layer_types=_every_nth_global(2, 2)),
    dict(_GEMMA3, name="debug-gemma3", vocab_size=512, block_size=256, n_layer=3, n_embd=64, n_head=4,
         n_query_groups=2, head_size=16, intermediate_size=128, sliding_window=16, query_pre_attn_scalar=24,
         layer_types=_every_nth_global(3, 3), rope_scaling={"rope_type": "linear", "factor": 8.0}),
    dict(name="debug-phi", family="phi", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         norm="layernorm", mlp="gelu", gelu_approximate="tanh", bias=True, lm_head_bias=True,
         parallel_residual=True, shared_attention_norm=True, rotary_percentage=0.5),
]

PRESETS: list[dict[str, Any]] = [*LLAMA, *MISTRAL, *QWEN2, *GEMMA, *GEMMA_2_3, *PHI, *PYTHIA, *DEBUG]


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
