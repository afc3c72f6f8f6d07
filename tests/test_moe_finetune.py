"""LoRA and QLoRA on a mixture of experts, on CPU: adapters on attention by default, optionally on the
experts' 3-D weights through peft's LoRA on parameters (`target_parameters`); NF4 experts under
`--quantize nf4`, sharded by FSDP2 by expert. Real peft, torchao, transformers (Qwen3-MoE and
gpt-oss, through the real converter) and gloo processes.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import ASSETS, logged_val_losses, run_in_process, run_toolkit
from toolkit.cli import run
from toolkit.models.config import Config

ALPACA = ASSETS / "instruct" / "alpaca_tiny.json"


def tiny_moe(**overrides) -> Config:
    """Qwen3-MoE's layout: per-head QK norms, 4 experts of which each token takes 2, renormalised."""
    values = dict(name="tiny-qwen3-moe", family="qwen3_moe", vocab_size=96, block_size=64, n_layer=2, n_embd=32,
                  n_head=4, n_query_groups=2, head_size=8, qk_norm="head", norm_eps=1e-6, rope_base=1e6,
                  intermediate_size=48, n_expert=4, n_expert_per_token=2, moe_intermediate_size=16)
    return Config(**{**values, **overrides})


# family -> (transformers config class, model class, config values): tiny random models, float32
HF_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, max_position_embeddings=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64)),
    # the experts transposed (X, C, 2I) with gate and up rows alternating, biases, attention sinks
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, swiglu_limit=1.5)),
}


def converted_hf_model(family: str, folder: Path, **changes):
    """A random transformers model of `family` (float32, eval, eager attention), saved in `folder/hf`
    and converted to `folder/toolkit`; biases and norms moved away from their initial values."""
    config_cls, model_cls, values = HF_MODELS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**values, **changes}, bos_token_id=None, eos_token_id=None,
                                                 pad_token_id=None)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder / "hf")
    from toolkit.convert import convert_from_hf

    convert_from_hf(folder / "hf", folder / "toolkit")
    return model


def _expert_delta(adapter: dict, name: str, scale: float, experts: int) -> torch.Tensor:
    """The update (X, out, in) of the experts' weight `name` from its adapter, as peft defines it:
    lora_A (r * X, in) holds expert e's A in rows [e * r, (e + 1) * r); lora_B (out, r * X) holds its
    B in columns e, e + X, e + 2X, ..."""
    A, B = adapter[f"{name}.lora_A.weight"].float(), adapter[f"{name}.lora_B.weight"].float()
    r = A.shape[0] // experts
    return scale * torch.stack([B[:, e::experts] @ A[e * r:(e + 1) * r] for e in range(experts)])


# ---------------------------------------------------------------- adapters on one model, in memory


def test_default_targets_adapt_attention_and_leave_router_and_experts_frozen():
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.gpt import GPT

    model = get_peft_model(GPT(tiny_moe()), LoRAArgs().peft_config())
    adapted = sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer)})
    assert adapted == ["q_proj", "v_proj"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and ".attn." in n for n in trainable)


def test_a_rank_above_an_adapted_weight_narrower_side_is_noted(capsys):
    """Rank 20 on tiny_moe: v_proj (16 x 32) and the experts' down_proj (X x 32 x 16) cannot use it
    all; q_proj (32 x 32) and gate_up_proj (X x 32 x 32) can. Rank 16 fits every one."""
    from toolkit.finetune.lora import _note_rank_above_width
    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(tiny_moe())
    targets = ("query", "value", "experts")
    _note_rank_above_width(model, LoRAArgs(r=20, alpha=40, dropout=0.0, targets=targets))
    note = capsys.readouterr().out
    assert note.startswith("Note: --lora.r 20 is above") and "(down_proj 16, v_proj 16)" in note, note
    _note_rank_above_width(model, LoRAArgs(r=16, alpha=32, dropout=0.0, targets=targets))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_expert_adapters_equal_their_update_added_to_the_weights(backend):
    """peft's LoRA on the experts' (X, out, in) weights, through both expert kernels (the grouped one
    reads the weight transposed, the loop indexes it by expert), computes what the model with
    W + (alpha / r) B_e A_e gives, and the adapters get gradients."""
    from peft import get_peft_model

    from toolkit.finetune.lora import adapter_key
    from toolkit.models.adapters import LoRAArgs, adapter_module_names
    from toolkit.models.gpt import GPT, init_weights
    from toolkit.models.moe import expert_backend

    config = tiny_moe()
    model = GPT(config)
    init_weights(model, config.n_layer, seed=2)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRAArgs(r=2, alpha=6, dropout=0.0, targets=("experts",))
    peft_model = get_peft_model(model, lora.peft_config())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    adapters = {adapter_key(k, adapter_module_names(peft_model)): v.detach()
                for k, v in peft_model.named_parameters() if ".lora_" in k}
    assert len(adapters) == 2 * 2 * config.n_layer  # A and B of two weights per layer

    expected = GPT(config)
    for name in ("gate_up_proj", "down_proj"):
        for layer in range(config.n_layer):
            key = f"blocks.{layer}.mlp.experts.{name}"
            base[key] = base[key] + _expert_delta(adapters, key, lora.alpha / lora.r, config.n_expert)
    expected.load_state_dict(base)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with expert_backend(backend):
        out = peft_model(ids)
        out.square().mean().backward()
        with torch.no_grad():
            torch.testing.assert_close(out, expected(ids), atol=1e-5, rtol=1e-5)
    grads = [p.grad for n, p in peft_model.named_parameters() if ".lora_" in n]
    assert all(g is not None and g.abs().max() > 0 for g in grads)


def test_expert_adapters_compute_from_their_factors_what_peft_computes_from_the_updated_weight():
    """The toolkit's expert adapter (`FactoredExpertLoRA`) against peft's own (`ParamWrapper`, which
    forms W + dW) on the same weights, in float32: the same output and adapter gradients. peft's
    keeps tensors the size of a layer's experts for the backward pass that are not the experts'
    weights (W + dW); the toolkit's keeps none."""
    import copy

    from peft import LoraConfig, get_peft_model

    from toolkit.models.expert_adapters import FactoredExpertLoRA, lora_config
    from toolkit.models.gpt import GPT, init_weights

    config = tiny_moe()
    base = GPT(config)
    init_weights(base, config.n_layer, seed=3)
    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj",
                    "experts.down_proj"], bias="none")  # fmt: skip
    models = {"peft": get_peft_model(copy.deepcopy(base), LoraConfig(**settings)),
              "factored": get_peft_model(base, lora_config(**settings))}
    assert sum(isinstance(m, FactoredExpertLoRA) for m in models["factored"].modules()) == 2 * config.n_layer
    assert not any(isinstance(m, FactoredExpertLoRA) for m in models["peft"].modules())
    with torch.no_grad():
        trained = dict(models["peft"].named_parameters())
        for name, p in models["factored"].named_parameters():
            if p.requires_grad:
                p.copy_(trained[name].normal_(0, 0.3))
    expert_sizes = {config.n_expert * 2 * config.moe_intermediate_size * config.n_embd,
                    config.n_expert * config.n_embd * config.moe_intermediate_size}
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(model):
        """Output, adapter gradients, and the expert-sized tensors kept for backward that are not weights."""
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept = []

        def pack(tensor):
            if tensor.dim() == 3 and tensor.numel() in expert_sizes and tensor.untyped_storage().data_ptr() not in weights:
                kept.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids)
        out.float().square().mean().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
        model.zero_grad(set_to_none=True)
        return out.float(), grads, kept

    (out, grads, kept), (peft_out, peft_grads, peft_kept) = run(models["factored"]), run(models["peft"])
    assert len(peft_kept) >= 2 * config.n_layer and not kept, (peft_kept, kept)
    torch.testing.assert_close(out, peft_out, atol=1e-5, rtol=1e-5)
    scale = peft_grads.abs().max()
    assert scale > 0
    torch.testing.assert_close(grads / scale, peft_grads / scale, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("family", list(HF_MODELS))
def test_expert_adapter_in_peft_format_gives_transformers_the_same_logits(family, tmp_path):
    """The adapter as finetune_lora writes it in peft's format (attention modules and the experts'
    parameters, wrapped by peft in the order transformers' experts register them; gpt-oss's B rows
    reordered as its gate and up rows alternate) loads with `PeftModel.from_pretrained` onto
    transformers' model and gives the toolkit model's logits with its adapters, in float32."""
    from peft import PeftModel, get_peft_model

    from toolkit.finetune.lora import adapter_key, write_peft_adapter
    from toolkit.model_dir import load_model
    from toolkit.models.adapters import LoRAArgs, adapter_module_names, adapters_switched_off

    hf = converted_hf_model(family, tmp_path)
    model = load_model(tmp_path / "toolkit")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids)
        torch.testing.assert_close(hf(ids).logits, plain, atol=1e-5, rtol=0)  # the same base

    lora = LoRAArgs(r=2, alpha=4, dropout=0.0, targets=("query", "value", "experts"))
    peft_model = get_peft_model(model, lora.peft_config()).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.2)
    names = adapter_module_names(peft_model)
    adapters = {adapter_key(k, names): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    out = tmp_path / "adapter"
    out.mkdir()
    assert write_peft_adapter(out, adapters, lora, model.config) is None
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    assert sorted(saved["target_modules"]) == ["q_proj", "v_proj"]

    hf_adapted = PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        ours, theirs = peft_model(ids), hf_adapted(ids).logits
        with adapters_switched_off(peft_model):  # a preference loss's reference: the base
            torch.testing.assert_close(peft_model(ids), plain, atol=0, rtol=0)
    assert (ours - plain).abs().max() > 1e-2  # the experts' adapters act
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_nf4_experts_compute_with_their_dequantized_weights(backend):
    """NF4Experts (X * out, in) give the outputs and input gradients of the same experts holding the
    dequantized weights, and keep only the NF4 weights for the backward pass."""
    from toolkit.models.moe import GroupedExperts, expert_backend
    from toolkit.parallel.nf4 import is_nf4, nf4_experts_class, quantize_blocks_nf4
    from toolkit.models.gpt import GPT, init_weights

    config = tiny_moe(n_embd=128, head_size=32, n_query_groups=4, moe_intermediate_size=64, n_layer=1)
    model = GPT(config)
    init_weights(model, 1, seed=4)
    router = model.blocks[0].mlp.router.weight.detach().clone()
    quantize_blocks_nf4(model, torch.bfloat16)
    experts = model.blocks[0].mlp.experts
    assert isinstance(experts, nf4_experts_class()) and is_nf4(experts.gate_up_proj) and is_nf4(experts.down_proj)
    assert experts.gate_up_proj.shape == (4 * 128, 128) and experts.down_proj.shape == (4 * 128, 64)
    assert torch.equal(model.blocks[0].mlp.router.weight, router)  # the router is not quantized
    dense = GroupedExperts(config)
    dense.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.to(torch.bfloat16).view(4, 128, 128))
    dense.down_proj = torch.nn.Parameter(experts.down_proj.to(torch.bfloat16).view(4, 128, 64))
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    with expert_backend(backend):
        results = []
        for module in (experts, dense):
            x_ = x.clone().requires_grad_(True)
            y = module(x_, counts)
            y.float().square().sum().backward()
            results.append((y, x_.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)


# ---------------------------------------------------------------- finetune_lora end to end


def _save_moe_checkpoint(root: Path, experts: int) -> Path:
    """A random tiny Qwen3-MoE with `experts` experts saved by transformers in bfloat16 with the
    Llama-2 tokenizer and converted; wide enough for NF4 to shard over 2 ranks (every attention
    weight and every 1.5 experts hold whole groups of 16384 values)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from toolkit.convert import convert_from_hf

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=experts,
                            num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "tokenizers" / "llama2" / name, root / "hf" / name)
    convert_from_hf(root / "hf", root / "checkpoint")
    return root / "checkpoint"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    return _save_moe_checkpoint(tmp_path_factory.mktemp("moe"), 4)


@pytest.fixture(scope="module")
def moe3_checkpoint(tmp_path_factory) -> Path:
    """Three experts: over 2 ranks, a shard ends inside the second expert."""
    return _save_moe_checkpoint(tmp_path_factory.mktemp("moe3"), 3)


def _args(checkpoint: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        "finetune_lora", str(checkpoint), "--out_dir", str(out_dir),
        "--data", "Alpaca", "--data.json_path", str(ALPACA), "--data.val_split_fraction", "0.1",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.max_seq_length", "64",
        "--train.max_steps", "6", "--train.warmup_steps", "1", "--train.learning_rate", "0.01",
        "--eval.interval", "6", "--eval.max_iters", "2", "--log.interval", "1", "--log.loggers", "[csv]",
        "--lora.dropout", "0.0", *extra,
    ]


EXPERT_RUN = ("--precision", "32-true", "--lora.targets", "[query, value, experts]")


@pytest.fixture(scope="module")
def expert_run(moe_checkpoint, tmp_path_factory) -> dict:
    """finetune_lora with adapters on attention and experts, on one process (this one): its output folder and log."""
    out = tmp_path_factory.mktemp("experts") / "one"
    log = run_in_process(_args(moe_checkpoint, out, *EXPERT_RUN))
    return {"out": out, "log": log}


def test_expert_adapters_train_and_merge_into_base_plus_update(moe_checkpoint, expert_run):
    out = expert_run["out"]
    first, last = logged_val_losses(out)[0], logged_val_losses(out)[-1]
    assert last < first - 0.1, (first, last)
    adapter = load_file(str(out / "final" / "lora_adapter.safetensors"))
    config = Config.from_file(moe_checkpoint)
    for layer in range(config.n_layer):
        for name in ("attn.q_proj", "attn.v_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            assert adapter[f"blocks.{layer}.{name}.lora_B.weight"].abs().max() > 1e-3, name  # every adapter trained
    assert not any("router" in k for k in adapter)
    assert json.loads((out / "final" / "adapter_config.json").read_text())["target_parameters"] == [
        "experts.gate_up_proj", "experts.down_proj"]

    assert run(["merge_lora", str(out)]) == 0
    merged, base = load_file(str(out / "merged" / "model.safetensors")), load_file(str(moe_checkpoint / "model.safetensors"))
    meta = json.loads((out / "final" / "lora.json").read_text())["lora"]
    for name in ("blocks.1.mlp.experts.gate_up_proj", "blocks.1.mlp.experts.down_proj"):
        update = _expert_delta(adapter, name, meta["alpha"] / meta["r"], config.n_expert)
        assert update.abs().max() > 1e-3
        expected = base[name].float() + update
        # stored in bfloat16, as the base: the update rounded to bfloat16, then the sum
        torch.testing.assert_close(merged[name].float(), expected, rtol=2 ** -8, atol=2 ** -8 * update.abs().max().item())
    assert torch.equal(merged["blocks.0.mlp.router.weight"], base["blocks.0.mlp.router.weight"])


def test_trained_expert_adapter_loads_with_peft_onto_transformers(moe_checkpoint, expert_run):
    """The peft-format copy the run wrote, on transformers' Qwen3-MoE read from the checkpoint's
    Hugging Face folder, gives the logits of the toolkit model with the adapter attached, in float32."""
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    from toolkit.finetune.lora import attach_adapter, read_adapter_meta
    from toolkit.model_dir import load_model

    final = expert_run["out"] / "final"
    _, lora = read_adapter_meta(final)
    ours = attach_adapter(load_model(moe_checkpoint, dtype=torch.float32), final, lora).eval()
    hf = Qwen3MoeForCausalLM.from_pretrained(moe_checkpoint.parent / "hf", dtype=torch.float32).eval()
    theirs = PeftModel.from_pretrained(hf, final).eval()
    ids = torch.tensor([[1, 319, 3462, 29871, 29941, 322, 29871, 29946, 29889]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-5, rtol=0)


def test_expert_adapters_on_two_fsdp_processes_equal_one_process(moe_checkpoint, expert_run, tmp_path):
    """peft's adapters on the experts' weights under FSDP2: the same adapter as one process (the
    same global batch, float32)."""
    out = tmp_path / "two"
    log = run_toolkit(_args(moe_checkpoint, out, *EXPERT_RUN, "--devices", "2"))
    assert "FSDP2 FULL_SHARD over 2 processes" in log
    one, two = (load_file(str(o / "final" / "lora_adapter.safetensors")) for o in (expert_run["out"], out))
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=0, msg=name)


def _nf4_bytes(log: str) -> list[int]:
    line = next(line for line in log.splitlines() if line.startswith("NF4 base bytes per rank: "))
    return [int(b) for b in line.split(": ")[1].split(", ")]


def test_qlora_with_nf4_experts_on_one_and_two_processes(moe3_checkpoint, tmp_path):
    """--quantize nf4 stores the experts in NF4 beside the attention weights (the router stays in
    16 bits), shards their rows over 2 processes (3 experts: a shard ends inside one), and trains the adapter of one process (the
    tolerance of tests/test_qlora_distributed.py at bf16-mixed), adapters on the NF4 experts
    included; the estimator predicts each rank's NF4 bytes exactly."""
    from toolkit.memory import estimator as est

    logs, adapters = {}, {}
    for devices in ("1", "2"):
        out = tmp_path / devices
        runner = run_in_process if devices == "1" else run_toolkit
        logs[devices] = runner(_args(moe3_checkpoint, out, "--quantize", "nf4", "--precision", "bf16-mixed",
                                     "--lora.targets", "[query, value, experts]", "--devices", devices,
                                     "--train.learning_rate", "0.002"))
        adapters[devices] = load_file(str(out / "final" / "lora_adapter.safetensors"))
    assert "QLoRA scheme: sharded" in logs["2"]
    assert "the NF4 base gathered as NF4, the other block weights gathered in bfloat16" in logs["2"]
    config = Config.from_file(moe3_checkpoint)
    C, I, X = config.n_embd, config.moe_intermediate_size, config.n_expert
    attention = C * C * 2 + C * config.n_query_groups * config.head_size * 2
    quantized = config.n_layer * (attention + X * 3 * I * C)  # experts included, the router not
    assert all(f"{quantized:,} frozen in NF4" in log for log in logs.values())  # the start-up's precision line
    assert all(v.abs().max().item() > 1e-3 for k, v in adapters["1"].items() if "lora_B" in k)  # every adapter trained
    assert any(".experts.gate_up_proj.lora_B" in k for k in adapters["1"])
    assert adapters["1"].keys() == adapters["2"].keys()
    for name in adapters["1"]:
        torch.testing.assert_close(adapters["2"][name], adapters["1"][name], atol=1e-4, rtol=0, msg=name)

    (whole,), halves = _nf4_bytes(logs["1"]), _nf4_bytes(logs["2"])
    assert whole == pytest.approx(quantized * 0.5 * (1 + 2 / 64), rel=0.01), (whole, quantized)
    weights = 6 * config.n_layer  # q, k, v, o and the two experts' weights: one 2-byte mean each, on every rank
    assert len(halves) == 2 and all(whole / 2 <= half <= whole / 2 + weights * 2 for half in halves), (whole, halves)
    opts = est.Options(config, "bf16-mixed", "lora", ("q_proj", "v_proj"), 8, "nf4", 64)
    specs = est.parameter_specs(config, opts.lora_modules, opts.lora_r)
    assert est.fsdp_rank_memory(specs, est.make_column("single", 1, 1), opts)[0]["quantized_base"] == whole
    assert [r["quantized_base"] for r in est.fsdp_rank_memory(specs, est.make_column("FULL_SHARD", 2, 1), opts)] == halves


def test_moe_lora_refusals_are_one_clear_line(moe_checkpoint, base, tmp_path, capsys):
    def fails_with(args: list[str], *needles: str) -> None:
        assert run(args) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(n in err[0] for n in needles), err

    fails_with(_args(moe_checkpoint, tmp_path / "a", "--lora.targets", "[experts]", "--quantize", "bnb.nf4"),
               "--quantize nf4")
    fails_with(_args(moe_checkpoint, tmp_path / "b", "--lora.targets", "[experts]", "--lora.dropout", "0.05"),
               "--lora.dropout 0")
    fails_with(_args(moe_checkpoint, tmp_path / "c", "--quantize", "bnb.nf4"), "--quantize nf4")
    fails_with(_args(base["checkpoint"], tmp_path / "d", "--lora.targets", "[query, experts]"), "has no mixture of experts")
    # Weights that do not match their model_config.json are refused before anything is read or
    # written: not a traceback from the grouped product or a rank's shard copy.
    edited = tmp_path / "edited"
    shutil.copytree(moe_checkpoint, edited)
    config = json.loads((edited / "model_config.json").read_text())
    (edited / "model_config.json").write_text(json.dumps({**config, "n_expert": 2 * config["n_expert"]}))
    fails_with(_args(edited, tmp_path / "e"), "weight 'blocks.0.mlp.router.weight' is 4 x 256, but its model_config.json "
               "implies 8 x 256: the weights and the config do not match")
    (edited / "model_config.json").write_text(json.dumps({**config, "n_layer": 1}))
    fails_with(_args(edited, tmp_path / "f"), "holds weight 'blocks.1.")
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_read_expert_rows_reads_whole_experts_and_pieces_of_cut_ones():
    """Any row range of experts (X, out, in) seen as (X * out, in) is read as that range, whole
    experts in one read and a cut expert through `inner`."""
    from toolkit.training.model_setup import read_expert_rows

    weight = torch.arange(4 * 6 * 3).reshape(4, 6, 3)
    calls = []

    def read_rows(name, start, stop, inner=None):
        calls.append((start, stop, inner))
        rows = weight[start:stop]
        return rows if inner is None else rows[:, inner[0]:inner[1]]

    flat = weight.flatten(0, 1)
    for start in range(24):
        for stop in range(start + 1, 25):
            calls.clear()
            assert torch.equal(read_expert_rows(read_rows, "w", start, stop, 6), flat[start:stop]), (start, stop)
            assert len(calls) <= 3 and sum(inner is None for *_, inner in calls) <= 1, calls
    calls.clear()
    read_expert_rows(read_rows, "w", 3, 21, 6)  # the end of expert 0, experts 1 and 2, the start of 3
    assert calls == [(0, 1, (3, 6)), (1, 3, None), (3, 4, (0, 3))]


def test_nf4_experts_split_by_rows_of_whole_groups_and_are_refused_otherwise():
    """NF4 experts (X * out, in) split along their rows: 6 experts over 4 ranks is 1.5 experts each.
    Rows that do not make whole NF4 groups are refused, by set-up and by the estimate alike."""
    from toolkit.errors import UserError
    from toolkit.memory.parameters import nf4_unshardable
    from toolkit.models.gpt import GPT
    from toolkit.parallel.nf4 import check_nf4_shardable

    fits = tiny_moe(n_embd=256, n_query_groups=4, head_size=64, n_expert=6, moe_intermediate_size=128)
    with torch.device("meta"):
        model = GPT(fits)
    check_nf4_shardable(model, 2)  # 3 experts of 256 x 256 (and of 256 x 128) per rank
    check_nf4_shardable(model, 4)  # 1.5 experts: 384 rows of 256 (of 128), 6 (3) groups of 16384 values
    assert nf4_unshardable(fits, 2) is None and nf4_unshardable(fits, 4) is None
    odd = tiny_moe(n_embd=256, n_query_groups=4, head_size=64, n_expert=6, moe_intermediate_size=96)
    with torch.device("meta"):
        model = GPT(odd)
    with pytest.raises(UserError, match=r"cannot split blocks\.0\.mlp\.experts\.gate_up_proj \(6 experts of 192 x 256\) over 4"):
        check_nf4_shardable(model, 4)  # 288 rows of 256: 4.5 groups
    assert nf4_unshardable(odd, 4) == "blocks.0.mlp.experts.gate_up_proj (6 x 192 x 256)"
    # On one device each weight must still be whole groups: a clear line, not torchao's reshape error.
    check_nf4_shardable(model, 1)
    with torch.device("meta"):
        narrow, narrow_experts = GPT(tiny_moe()), GPT(tiny_moe(n_embd=256, n_query_groups=4, head_size=64,
                                                               moe_intermediate_size=8))
    with pytest.raises(UserError, match=r"cannot quantize blocks\.0\.attn\.q_proj \(32 x 32\): NF4 takes whole groups of 16384 .*; use bnb\.nf4\.$"):
        check_nf4_shardable(narrow, 1)
    with pytest.raises(UserError, match=r"cannot quantize blocks\.0\.mlp\.experts\.down_proj \(4 experts of 256 x 8\).*no --quantize"):
        check_nf4_shardable(narrow_experts, 1)
