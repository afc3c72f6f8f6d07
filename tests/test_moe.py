"""The mixture-of-experts layer on one device: grouped experts equal looped ones, the router's
losses equal transformers' definition, config refusals."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.errors import UserError
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, count_parameters, init_weights
from toolkit.models.moe import MoE, expert_backend, load_summary, moe_layers, router_losses


def tiny_moe(**overrides) -> Config:
    values = dict(name="tiny-moe", vocab_size=96, block_size=64, n_layer=3, n_embd=32, n_head=4, n_query_groups=2,
                  intermediate_size=48, n_expert=6, n_expert_per_token=2, moe_intermediate_size=24, moe_layers=[0, 2])
    return Config(**{**values, **overrides})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_equal_looped_experts(dtype, bias):
    config = tiny_moe(bias=bias, mlp="clamped_swiglu" if bias else "swiglu", swiglu_limit=1.5)
    model = GPT(config)
    init_weights(model, config.n_layer, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3, generator=generator)
    model.to(dtype)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("grouped", "loop"):
        model.zero_grad()
        with expert_backend(backend):
            loss = model(ids, labels=ids)
            losses = router_losses(moe_layers(model))
            (loss + losses.aux + losses.z).backward()
        results[backend] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for grouped, looped in zip(results["grouped"], results["loop"]):
        # bf16: the two add up in different orders; a gradient of 2-4 may differ by one bf16 step (1/64)
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
        torch.testing.assert_close(grouped, looped, **tolerance)


def test_dense_and_moe_layers_follow_the_config():
    model = GPT(tiny_moe())
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["MoE", "GatedMLP", "MoE"]
    assert model.blocks[0].mlp.experts.gate_up_proj.shape == (6, 48, 32)
    assert model.blocks[1].mlp.down_proj.weight.shape == (32, 48)
    # one token computes with 2 of 6 experts in each of the two MoE layers
    expert_weights = 2 * 6 * 3 * 24 * 32
    assert count_parameters(tiny_moe()) - count_parameters(tiny_moe(), active=True) == expert_weights * 4 // 6


def _route_a_batch(real=None):
    """A tiny MoE's forward pass over 3 x 17 tokens, counting only `real` (None: all): (config, the
    routers' logits as transformers collects them, the router losses)."""
    from toolkit.models.moe import counting_only

    config = tiny_moe(moe_layers=None)
    model = GPT(config)
    init_weights(model, config.n_layer, seed=5)
    captured = []
    hooks = [layer.router.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
             for layer in moe_layers(model)]
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
    with counting_only(real):
        model(ids)
    for hook in hooks:
        hook.remove()
    return config, tuple(captured), router_losses(moe_layers(model))


def test_router_losses_equal_transformers_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config, captured, losses = _route_a_batch()
    expected = load_balancing_loss_func(captured, config.n_expert, config.n_expert_per_token)
    torch.testing.assert_close(losses.aux, expected.float(), rtol=1e-6, atol=1e-6)
    z = torch.cat(captured).logsumexp(dim=-1).square().mean()
    torch.testing.assert_close(losses.z, z, rtol=1e-6, atol=1e-6)
    assert losses.load.shape == (3, 6) and losses.load.sum() == 3 * 3 * 17 * 2


def test_padding_counts_in_no_router_loss_as_transformers_attention_mask_leaves_it_out():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    real = torch.ones(3, 17, dtype=torch.bool)
    real[1, 9:], real[2, 4:] = False, False  # two rows padded on the right
    config, captured, losses = _route_a_batch(real)
    expected = load_balancing_loss_func(captured, config.n_expert, config.n_expert_per_token, attention_mask=real.long())
    torch.testing.assert_close(losses.aux, expected.float(), rtol=1e-6, atol=1e-6)
    counted = torch.cat([logits[real.reshape(-1)] for logits in captured])
    torch.testing.assert_close(losses.z, counted.logsumexp(dim=-1).square().mean(), rtol=1e-6, atol=1e-6)
    assert losses.load.sum() == 3 * int(real.sum()) * 2
    everything = load_balancing_loss_func(captured, config.n_expert, config.n_expert_per_token)
    assert not torch.allclose(expected, everything)  # the padding would have changed it


def test_router_weights_renormalised_only_when_asked():
    for norm in (True, False):
        layer = MoE(tiny_moe(router_norm_topk=norm))
        torch.nn.init.normal_(layer.router.weight)
        _, probs, chosen, weights = layer.route(torch.randn(10, 32))
        torch.testing.assert_close(weights, probs.gather(1, chosen) / (probs.gather(1, chosen).sum(1, keepdim=True) if norm else 1))


def test_load_summary_of_a_balanced_and_a_skewed_router():
    even = load_summary(torch.full((2, 4), 5.0))
    assert even["min"] == even["max"] == 1 and even["cv"] == 0
    skewed = load_summary(torch.tensor([[8.0, 0.0, 0.0, 0.0]]))
    assert skewed["max"] == 4 and skewed["min"] == 0 and skewed["cv"] > 1


@pytest.mark.parametrize("overrides, message", [
    (dict(n_expert_per_token=7), "n_expert_per_token must be in [1, n_expert=6]"),
    (dict(n_expert=0), "need n_expert > 0"),
    (dict(moe_layers=[3]), "moe_layers entries must be layer indices in [0, 3)"),
    (dict(mlp="gelu"), "experts are gated"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef must not be negative"),
])
def test_bad_expert_configs_are_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        tiny_moe(**overrides)


def test_grouped_experts_compute_under_autocast_as_linear_layers_do():
    """Under "*-mixed" the rows come in float32 and the weights in float32 (one device) or bf16
    (gathered by FSDP): the grouped products cast both to autocast's dtype, as the looped F.linear
    calls are cast, and give what they give."""
    experts = MoE(tiny_moe()).experts
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2, generator=generator)
    x = torch.randn(12, 32, generator=generator)
    counts = torch.tensor([3, 0, 4, 1, 2, 2])
    for weights in (torch.float32, torch.bfloat16):
        experts.to(weights)
        outputs = {}
        for backend in ("grouped", "loop"):
            with expert_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
                outputs[backend] = experts(x, counts)
        assert outputs["grouped"].dtype == outputs["loop"].dtype == torch.bfloat16
        torch.testing.assert_close(outputs["grouped"], outputs["loop"], rtol=2e-2, atol=1e-2)


class _GroupedRuns(TorchDispatchMode):
    """Records where each run ends (`offs`) in every grouped product, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            self.ends.append((kwargs["offs"] if "offs" in kwargs else args[2]).tolist())
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_16_bit_runs_on_a_cpu_are_padded_and_compute_what_unpadded_runs_compute(dtype):
    """A CPU's 16-bit products go through oneDNN, which keeps a compiled kernel per height of rows:
    each expert's run reaches the grouped kernel padded to a multiple of RUN_ROWS (forward and
    backward), and gives the output and gradients of the runs as routed, bit for bit. float32, and
    fake tensors standing for a GPU's step (`expert_runs_as_on_a_gpu`), keep the runs as routed."""
    from toolkit.models.moe import RUN_ROWS, expert_product, expert_runs_as_on_a_gpu

    counts = torch.tensor([0, 5, RUN_ROWS, RUN_ROWS + 1, 1, 70])
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), 48, generator=generator).to(dtype)
    weight = torch.randn(6, 24, 48, generator=generator).to(dtype)
    grad = torch.randn(int(counts.sum()), 24, generator=generator).to(dtype)
    results, ends = {}, {}
    for padded in (True, False):
        rows, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with (contextlib.nullcontext() if padded else expert_runs_as_on_a_gpu()), _GroupedRuns() as runs:
            out = expert_product(rows, w, counts, grouped=True)
            out.backward(grad)
        results[padded], ends[padded] = (out, rows.grad, w.grad), runs.ends
    routed = counts.cumsum(0).tolist()
    assert ends[False] == [routed] * 3  # the forward product and the two of its backward pass
    if dtype == torch.bfloat16:
        lengths = torch.diff(torch.tensor(ends[True][0]), prepend=torch.tensor([0]))
        assert ends[True] == [ends[True][0]] * 3 and lengths.tolist() == [0, 32, 32, 64, 32, 96]
        assert all(n % RUN_ROWS == 0 for n in lengths.tolist())
    else:
        assert ends[True] == [routed] * 3
    for padded_result, routed_result in zip(results[True], results[False]):
        assert torch.equal(padded_result, routed_result)

def test_a_backend_switch_holds_only_inside_its_block_and_refuses_unknown_names():
    """`expert_backend` (like `attention_backend` and `router_stats_off`, one `Switch` each): the
    value inside the block, the previous one after it, also when the block raises."""
    from toolkit.models.moe import KERNEL, RECORDING, expert_backend, router_stats_off

    assert KERNEL.value is None and RECORDING.value is True
    with pytest.raises(RuntimeError, match="inside"):
        with expert_backend("loop"), router_stats_off():
            assert KERNEL.value == "loop" and RECORDING.value is False
            with expert_backend("grouped"):
                assert KERNEL.value == "grouped"
            assert KERNEL.value == "loop"
            raise RuntimeError("inside")
    assert KERNEL.value is None and RECORDING.value is True
    with pytest.raises(ValueError, match="expert backend 'grouped2': one of None, 'grouped', 'loop'"):
        with expert_backend("grouped2"):
            pass
    assert KERNEL.value is None
