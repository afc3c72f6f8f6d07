"""Named model presets: plain data, one list per family, looked up by name, alias or HF repo id.

Each entry holds the `Config` fields that differ from the defaults. Sizes are those of the
published Hugging Face `config.json` files; a test instantiates every preset on the meta device and
checks the parameter count against the published one (`expected_params`).
"""

from __future__ import annotations

import math
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

# Phi-3 family (transformers' Phi3ForCausalLM). LongRoPE factor lists as the published config.json
# files have them: Phi-3-mini/medium-128k from their first release (transformers 4.39, "type": "su"),
# Phi-3.5-mini and Phi-4-mini from theirs. The attention factor is the one transformers derives from
# max_position_embeddings / original_max_position_embeddings (toolkit.convert.hf_config).
_PHI3_MINI_128K_LONG = [
    1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547, 1.2299998998641968,
    1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684, 1.6499998569488525,
    1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787, 5.489999771118164,
    5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
    15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055, 30.009998321533203,
    32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672, 53.840003967285156,
    56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094, 59.920005798339844,
    61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
    63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625,
    64.80001068115234, 64.81001281738281, 64.81001281738281,
]
_PHI3_MINI_128K_SHORT = [
    1.05, 1.05, 1.05, 1.1, 1.1,
    1.1500000000000001, 1.2000000000000002, 1.2500000000000002, 1.3000000000000003, 1.3500000000000003,
    1.5000000000000004, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007,
    2.1000000000000005, 2.1000000000000005, 2.1000000000000005, 2.1500000000000004, 2.1500000000000004,
    2.3499999999999996, 2.549999999999999, 2.5999999999999988, 2.5999999999999988, 2.7499999999999982,
    2.849999999999998, 2.849999999999998, 2.9499999999999975,
]
_PHI3_MEDIUM_128K_LONG = [
    1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
    1.0, 1.0, 1.0, 1.25, 1.25, 1.5, 2.0, 2.75, 5.75, 5.75,
    6.5, 9.25, 11.0, 13.25, 19.25, 19.75, 19.75, 21.25, 21.5, 26.5,
    30.0, 33.75, 35.25, 38.5, 42.0, 42.25, 46.0, 47.0, 50.0, 50.5,
    51.0, 52.0, 52.75, 53.75, 54.75, 57.0, 57.25, 58.5, 59.25, 59.5,
    62.0, 62.5, 62.75, 63.25, 63.25, 63.25, 63.75, 64.0, 64.0, 64.25,
    64.5, 64.5, 65.0, 65.0,
]
_PHI3_MEDIUM_128K_SHORT = [
    1.0, 1.0, 1.0, 1.0, 1.0,
    1.0, 1.01, 1.02, 1.02, 1.04,
    1.04, 1.07, 1.07, 1.1, 1.3000000000000003,
    1.3000000000000003, 1.5000000000000004, 1.5700000000000005, 1.9000000000000008, 2.3100000000000014,
    2.759999999999992, 3.3899999999999784, 3.9399999999999666, 4.009999999999965, 4.289999999999959,
    4.349999999999958, 5.349999999999937, 6.659999999999909, 7.029999999999901, 7.51999999999989,
    8.00999999999988, 8.249999999999876, 8.279999999999875, 9.629999999999846, 9.89999999999984,
    10.589999999999826, 11.049999999999816, 11.7899999999998, 12.189999999999792, 12.889999999999777,
    13.129999999999772, 13.16999999999977, 13.20999999999977, 13.479999999999764, 13.539999999999763,
    13.779999999999758, 13.929999999999755, 14.429999999999744, 14.759999999999737, 15.149999999999729,
    15.419999999999723, 15.53999999999972, 15.659999999999718, 15.749999999999716, 15.759999999999716,
    15.799999999999715, 16.05999999999971, 16.079999999999714, 16.11999999999972, 16.11999999999972,
    16.18999999999973, 16.31999999999975, 16.539999999999786, 16.799999999999827,
]
_PHI35_MINI_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
_PHI35_MINI_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979,
    1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662,
    1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
    1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
    2.729999542236328, 2.749999523162842, 2.8399994373321533,
]
_PHI4_MINI_LONG = [
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897,
    1.956131817, 2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075,
    3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555,
    7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
    14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418,
    28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93,
    32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]


def _longrope(short: list, long: list, block_size: int, original: int = 4096) -> dict[str, Any]:
    factor = block_size / original
    return dict(rope_type="longrope", short_factor=short, long_factor=long, original_max_seq_len=original,
                attention_factor=math.sqrt(1 + math.log(factor) / math.log(original)))


_PHI3_MINI = dict(family="phi3", vocab_size=32064, n_layer=32, n_embd=3072, n_head=32, intermediate_size=8192,
                  expected_params=3_821_079_552)
_PHI3_MEDIUM = dict(family="phi3", vocab_size=32064, n_layer=40, n_embd=5120, n_head=40, n_query_groups=10,
                    intermediate_size=17920, expected_params=13_960_238_080)
PHI3 = [
    dict(_PHI3_MINI, name="phi-3-mini-4k-instruct", hf_repo_id="microsoft/Phi-3-mini-4k-instruct", block_size=4096,
         sliding_window=2047),
    dict(_PHI3_MINI, name="phi-3-mini-128k-instruct", hf_repo_id="microsoft/Phi-3-mini-128k-instruct",
         block_size=131072, rope_scaling=_longrope(_PHI3_MINI_128K_SHORT, _PHI3_MINI_128K_LONG, 131072)),
    dict(_PHI3_MEDIUM, name="phi-3-medium-4k-instruct", hf_repo_id="microsoft/Phi-3-medium-4k-instruct",
         block_size=4096, sliding_window=2047),
    dict(_PHI3_MEDIUM, name="phi-3-medium-128k-instruct", hf_repo_id="microsoft/Phi-3-medium-128k-instruct",
         block_size=131072, rope_scaling=_longrope(_PHI3_MEDIUM_128K_SHORT, _PHI3_MEDIUM_128K_LONG, 131072)),
    dict(_PHI3_MINI, name="phi-3.5-mini-instruct", hf_repo_id="microsoft/Phi-3.5-mini-instruct", block_size=131072,
         rope_scaling=_longrope(_PHI35_MINI_SHORT, _PHI35_MINI_LONG, 131072)),
    dict(
        name="phi-4", hf_repo_id="microsoft/phi-4", family="phi3",
        vocab_size=100352, block_size=16384, n_layer=40, n_embd=5120, n_head=40, n_query_groups=10,
        intermediate_size=17920, rope_base=250000.0, expected_params=14_659_507_200,
    ),
    dict(
        name="phi-4-mini-instruct", hf_repo_id="microsoft/Phi-4-mini-instruct", family="phi3",
        vocab_size=200064, block_size=131072, n_layer=32, n_embd=3072, n_head=24, n_query_groups=8,
        intermediate_size=8192, rotary_percentage=0.75, tie_embeddings=True,
        rope_scaling=_longrope([1.0] * 48, _PHI4_MINI_LONG, 131072), expected_params=3_836_021_760,
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

# Mixtures of experts. Mixtral: Mistral's layer with 8 experts of intermediate_size per layer, top 2,
# renormalised; the 8x22B repositories hold the v3 tokenizer's 32768 tokens. Parameter counts are
# those of transformers' own classes built from the published config.json files.
_MIXTRAL = dict(family="mixtral", rope_base=1000000.0, n_query_groups=8, n_expert=8, n_expert_per_token=2)
_MIXTRAL_8X7B = dict(_MIXTRAL, vocab_size=32000, block_size=32768, n_layer=32, n_embd=4096, n_head=32,
                     intermediate_size=14336, router_aux_loss_coef=0.02, expected_params=46_702_792_704)
_MIXTRAL_8X22B = dict(_MIXTRAL, vocab_size=32768, block_size=65536, n_layer=56, n_embd=6144, n_head=48,
                      intermediate_size=16384, router_aux_loss_coef=0.001, expected_params=140_630_071_296)
MIXTRAL = [
    dict(_MIXTRAL_8X7B, name="mixtral-8x7b", aliases=["mixtral-8x7b-v0.1"], hf_repo_id="mistralai/Mixtral-8x7B-v0.1"),
    dict(_MIXTRAL_8X7B, name="mixtral-8x7b-instruct", aliases=["mixtral-8x7b-instruct-v0.1"],
         hf_repo_id="mistralai/Mixtral-8x7B-Instruct-v0.1"),
    dict(_MIXTRAL_8X22B, name="mixtral-8x22b", aliases=["mixtral-8x22b-v0.1"],
         hf_repo_id="mistralai/Mixtral-8x22B-v0.1"),
    dict(_MIXTRAL_8X22B, name="mixtral-8x22b-instruct", aliases=["mixtral-8x22b-instruct-v0.1"],
         hf_repo_id="mistralai/Mixtral-8x22B-Instruct-v0.1"),
]

# Qwen3-MoE: Qwen3's attention (head size 128, per-head QK norm) and 128 experts per layer, top 8,
# renormalised; every layer sparse. The 2507 release reads 256K tokens with a larger RoPE base.
_QWEN3_MOE = dict(family="qwen3_moe", vocab_size=151936, block_size=40960, head_size=128, n_query_groups=4,
                  rope_base=1000000.0, norm_eps=1e-6, qk_norm="head", n_expert=128, n_expert_per_token=8,
                  router_aux_loss_coef=0.001)
_QWEN3_30B_A3B = dict(_QWEN3_MOE, n_layer=48, n_embd=2048, n_head=32, intermediate_size=6144, moe_intermediate_size=768,
                      expected_params=30_532_122_624)
QWEN3_MOE = [
    dict(_QWEN3_30B_A3B, name="qwen3-30b-a3b", hf_repo_id="Qwen/Qwen3-30B-A3B"),
    dict(_QWEN3_30B_A3B, name="qwen3-30b-a3b-instruct-2507", hf_repo_id="Qwen/Qwen3-30B-A3B-Instruct-2507",
         block_size=262144, rope_base=10000000.0),
    dict(_QWEN3_MOE, name="qwen3-235b-a22b", hf_repo_id="Qwen/Qwen3-235B-A22B", n_layer=94, n_embd=4096, n_head=64,
         intermediate_size=12288, moe_intermediate_size=1536, expected_params=235_093_634_560),
]

# OLMoE: Llama's pre-norm layer with QK norms over the whole projections, 64 experts of 1024, top 8,
# not renormalised.
_OLMOE = dict(family="olmoe", vocab_size=50304, block_size=4096, n_layer=16, n_embd=2048, n_head=16,
              intermediate_size=1024, qk_norm="projection", n_expert=64, n_expert_per_token=8, router_norm_topk=False,
              router_aux_loss_coef=0.01, expected_params=6_919_161_856)
OLMOE = [
    dict(_OLMOE, name="olmoe-1b-7b", aliases=["olmoe-1b-7b-0924"], hf_repo_id="allenai/OLMoE-1B-7B-0924"),
    dict(_OLMOE, name="olmoe-1b-7b-instruct", aliases=["olmoe-1b-7b-0924-instruct"],
         hf_repo_id="allenai/OLMoE-1B-7B-0924-Instruct"),
]

# Tiny mixtures of experts: one per family, each layer kind present (Qwen3-MoE: a dense layer too)
DEBUG_MOE = [
    dict(name="debug-mixtral", family="mixtral", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         n_query_groups=2, intermediate_size=96, rope_base=1000000.0, n_expert=4, n_expert_per_token=2,
         router_aux_loss_coef=0.02),
    dict(name="debug-qwen3-moe", family="qwen3_moe", vocab_size=512, block_size=256, n_layer=3, n_embd=64, n_head=4,
         n_query_groups=2, head_size=32, intermediate_size=128, moe_intermediate_size=48, norm_eps=1e-6, qk_norm="head",
         n_expert=8, n_expert_per_token=2, moe_layers=[0, 2], router_aux_loss_coef=0.001),
    dict(name="debug-olmoe", family="olmoe", vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
         intermediate_size=48, qk_norm="projection", n_expert=8, n_expert_per_token=2, router_norm_topk=False,
         router_aux_loss_coef=0.01),
]

# gpt-oss: every layer a mixture of 2880-wide experts (top-4, biased router and experts, clamped
# SwiGLU), attention with biases and a sink per head, layers alternating a 128-token window and full
# attention from the first, YaRN (factor 32 over 4096 tokens, not truncated) on base 150000. The
# published checkpoints store the experts as MXFP4, dequantized to bf16 at conversion.
# router_aux_loss_coef: 0.9 in the published config.json files.
_GPT_OSS = dict(
    family="gpt_oss", vocab_size=201088, block_size=131072, n_embd=2880, n_head=64, n_query_groups=8, head_size=64,
    intermediate_size=2880, n_expert_per_token=4, norm_eps=1e-5, mlp="clamped_swiglu", bias=True,
    attention_sinks=True, rope_base=150000.0, sliding_window=128,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_seq_len": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "attention_factor": 0.1 * math.log(32.0) + 1.0, "truncate": False},
    router_aux_loss_coef=0.9, swiglu_limit=7.0, swiglu_alpha=1.702,
)
GPT_OSS = [
    dict(name="gpt-oss-20b", hf_repo_id="openai/gpt-oss-20b", **_GPT_OSS, n_layer=24, n_expert=32,
         layer_types=_every_nth_global(24, 2), expected_params=20_914_757_184),
    dict(name="gpt-oss-120b", hf_repo_id="openai/gpt-oss-120b", **_GPT_OSS, n_layer=36, n_expert=128,
         layer_types=_every_nth_global(36, 2), expected_params=116_829_156_672),
]

PRESETS: list[dict[str, Any]] = [*LLAMA, *MISTRAL, *QWEN2, *GEMMA, *GEMMA_2_3, *PHI, *PHI3, *PYTHIA, *QWEN3, *OLMO2,
                                 *SMOLLM3, *MIXTRAL, *QWEN3_MOE, *OLMOE, *GPT_OSS, *DEBUG, *DEBUG_MOE]


# Family id (Config.family) -> the name `toolkit list` shows; a family not listed shows its id.
FAMILY_TITLES: dict[str, str] = {
    "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2.5", "qwen3": "Qwen3", "gemma": "Gemma", "gemma2": "Gemma 2",
    "gemma3": "Gemma 3",
    "phi": "Phi", "phi3": "Phi-3 and Phi-4", "gpt_neox": "GPT-NeoX (Pythia)", "olmo2": "OLMo 2", "smollm3": "SmolLM3",
    "mixtral": "Mixtral (mixture of experts)", "qwen3_moe": "Qwen3-MoE (mixture of experts)",
    "olmoe": "OLMoE (mixture of experts)", "gpt_oss": "gpt-oss (mixture of experts)",
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
