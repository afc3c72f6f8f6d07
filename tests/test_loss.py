"""The fused head + cross-entropy (`linear_cross_entropy_sum`) against the plain computation.

Plain: `F.cross_entropy(F.linear(h, W, b).float(), labels, ignore_index=-100, reduction="sum")`,
whose loss and gradients (w.r.t. h, W, b) the fused version must reproduce within float tolerance,
whatever the chunking, the ignored rows, the bias, weight tying or autocast. All on small random
tensors: the whole file runs in a few seconds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolkit.models import IGNORE_INDEX, gpt
from toolkit.models import loss as fused_loss
from toolkit.models.config import Config
from toolkit.models.gpt import GPT, init_weights
from toolkit.models.loss import (
    cross_entropy_sum, label_log_probs, linear_cross_entropy_sum, linear_label_log_probs, loss_settings,
)

N, E, V = 37, 16, 101  # rows, hidden size, vocabulary: odd sizes so that chunks do not divide evenly


def _inputs(bias: bool, ignored: float, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, E, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, E, generator=g, dtype=dtype) * 0.5).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.5).requires_grad_() if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < ignored] = IGNORE_INDEX
    return h, w, b, labels


def _grads(loss, tensors):
    tensors = [t for t in tensors if t is not None]
    return [g for g in torch.autograd.grad(loss, tensors)]


def _plain(h, w, b, labels):
    return cross_entropy_sum(F.linear(h, w, b), labels)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignored", [0.0, 0.4])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
@pytest.mark.parametrize("skip_ignored", [True, False])
def test_loss_and_gradients_match_plain_cross_entropy(bias, ignored, chunk_rows, skip_ignored):
    h, w, b, labels = _inputs(bias, ignored)
    want = _plain(h, w, b, labels)
    want_grads = _grads(want, (h, w, b))
    got = linear_cross_entropy_sum(h, w, b, labels, chunk_rows=chunk_rows, skip_ignored=skip_ignored)
    got_grads = _grads(got, (h, w, b))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for g, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)


def test_ignored_rows_get_zero_gradient_and_add_nothing():
    h, w, b, labels = _inputs(True, 0.5)
    ignored = labels == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    loss = linear_cross_entropy_sum(h, w, b, labels)
    (grad_h,) = torch.autograd.grad(loss, (h,))
    assert (grad_h[ignored] == 0).all()
    # the loss over the kept rows alone is the same number
    kept = linear_cross_entropy_sum(h[~ignored], w, b, labels[~ignored])
    torch.testing.assert_close(loss, kept)


def test_all_rows_ignored_gives_zero_loss_and_gradients():
    h, w, b, labels = _inputs(True, 1.1)
    assert (labels == IGNORE_INDEX).all()
    for skip in (True, False):
        loss = linear_cross_entropy_sum(h, w, b, labels, skip_ignored=skip)
        grads = _grads(loss, (h, w, b))
        assert loss.item() == 0.0 == _plain(h, w, b, labels).item()
        assert all((g == 0).all() for g in grads)


def test_incoming_gradient_scales_every_gradient():
    """The loop backpropagates loss_sum * scale: the stored gradients must be multiplied by it."""
    h, w, b, labels = _inputs(True, 0.2)
    scale = torch.tensor(0.37)
    want = _grads(_plain(h, w, b, labels) * scale + 2.0 * _plain(h, w, b, labels), (h, w, b))
    fused = linear_cross_entropy_sum(h, w, b, labels)
    got = _grads(fused * scale + 2.0 * fused, (h, w, b))
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)


def test_batched_shapes_and_partial_requires_grad():
    h, w, b, labels = _inputs(False, 0.3)
    w.requires_grad_(False)
    hb, lb = h.reshape(1, N, E), labels.reshape(1, N)
    got = linear_cross_entropy_sum(hb, w, None, lb)
    (grad_h,) = torch.autograd.grad(got, (h,))
    want = _plain(h, w, None, labels)
    (want_h,) = torch.autograd.grad(want, (h,))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad_h, want_h, rtol=1e-5, atol=1e-6)


def test_no_grad_computes_the_loss_only(monkeypatch):
    h, w, b, labels = _inputs(True, 0.3)
    with torch.no_grad():
        got = linear_cross_entropy_sum(h, w, b, labels)
        want = _plain(h, w, b, labels)
    torch.testing.assert_close(got, want)
    assert not got.requires_grad


def test_bf16_autocast_matches_plain_autocast():
    h, w, b, labels = _inputs(True, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _plain(h, w, b, labels)
        got = linear_cross_entropy_sum(h, w, b, labels, chunk_rows=8)
    want_grads = _grads(want, (h, w, b))
    got_grads = _grads(got, (h, w, b))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-2)
    for g, ref in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2e-2)


def test_bf16_autocast_loss_is_the_float32_cross_entropy_of_its_rounded_logits():
    # Under autocast the products are bfloat16, everything after them float32: against the float64
    # cross-entropy of the same rounded logits the loss agrees to float32 rounding (the tolerance
    # above is the gap to float32 products).
    h, w, b, labels = _inputs(True, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy_sum(h, w, b, labels, chunk_rows=8)
    rounded = F.linear(h.bfloat16(), w.bfloat16(), b.bfloat16())
    want = F.cross_entropy(rounded.double(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 300.0])
@pytest.mark.parametrize("skip_ignored", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_labels_far_below_the_largest_logit_give_their_exact_loss(autocast, skip_ignored, softcap):
    # A label 200 below the row's largest logit has probability exp(-200): 0 in float32. Its loss is
    # still 200 (+ the log of the row's sum), not inf, and its gradient stays -1. With skip_ignored
    # (the CPU's default) the loss is read from the label's probability and such rows are made again;
    # without it, from the row's largest logit (the GPU's way).
    h, w, _, labels = _inputs(False, 0.0)
    w = w.detach().clone()
    w[labels[0]] = 0.0
    w[(labels[0] + 1) % V] = h[0].detach() / h[0].detach().square().sum() * 200.0  # logit 200 for row 0
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = linear_cross_entropy_sum(h, w, None, labels, chunk_rows=8, skip_ignored=skip_ignored, softcap=softcap)
        per_token = linear_label_log_probs(h, w, None, labels, chunk_rows=8, skip_ignored=skip_ignored, softcap=softcap)
        other_way = linear_cross_entropy_sum(h, w, None, labels, chunk_rows=8, skip_ignored=not skip_ignored,
                                             softcap=softcap)
        logits = F.linear(h, w)
        if softcap is not None:
            logits = torch.tanh(logits.float() / softcap) * softcap
        want = cross_entropy_sum(logits, labels)
    assert torch.isfinite(got) and got.item() > 150
    torch.testing.assert_close(got, other_way, rtol=1e-6, atol=0)
    torch.testing.assert_close(per_token.sum(), -got, rtol=1e-6, atol=0)
    if autocast and softcap is not None:
        return  # the fused head holds the capped logits in bf16 (spaced 1.0 near 175): no float32 reference
    (got_h,), (want_h,) = _grads(got, (h,)), _grads(want, (h,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


def test_bf16_weights_give_bf16_gradients():
    h, w, b, labels = _inputs(False, 0.3, dtype=torch.bfloat16)
    got = linear_cross_entropy_sum(h, w, None, labels)
    want = _plain(h, w, None, labels)
    got_grads, want_grads = _grads(got, (h, w)), _grads(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-1)
    for g, ref in zip(got_grads, want_grads):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), ref.float(), rtol=3e-2, atol=3e-2)


# ------------------------------------------------------------------------------ through the model


def _model_and_batch(name: str, seed: int = 0, **overrides):
    config = Config.from_name(name, **overrides)
    torch.manual_seed(seed)
    model = GPT(config)
    init_weights(model, config.n_layer)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = torch.randint(0, config.vocab_size, (2, 24))
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    labels[1, -7:] = IGNORE_INDEX  # padding
    return model, ids, labels


@pytest.mark.parametrize("name", ["debug-neox", "debug-gemma", "debug-phi"])
def test_model_loss_equals_plain_loss_on_its_logits(name):
    """GPT(ids, labels) (fused) == cross_entropy_sum(GPT(ids), labels), gradients included.

    debug-gemma ties the head to the embedding (both gradients land on one tensor); debug-phi has a
    bias on the head.
    """
    model, ids, labels = _model_and_batch(name)
    params = [p for p in model.parameters()]
    fused = model(ids, labels=labels)
    fused_grads = torch.autograd.grad(fused, params)
    plain = cross_entropy_sum(model(ids), labels)
    plain_grads = torch.autograd.grad(plain, params)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    for (n, _), g, ref in zip(model.named_parameters(), fused_grads, plain_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_head_with_lora_takes_the_plain_path(monkeypatch):
    peft = pytest.importorskip("peft")
    model, ids, labels = _model_and_batch("debug-neox")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))

    def refuse(*args, **kwargs):
        raise AssertionError("the fused loss must not bypass a LoRA head")

    monkeypatch.setattr(gpt, "linear_cross_entropy_sum", refuse)
    loss = model(ids, labels=labels)
    torch.testing.assert_close(loss, cross_entropy_sum(model(ids), labels))
    loss.backward()


def test_plain_linear_head_takes_the_fused_path(monkeypatch):
    model, ids, labels = _model_and_batch("debug-neox")
    calls = []
    original = gpt.linear_cross_entropy_sum
    monkeypatch.setattr(gpt, "linear_cross_entropy_sum", lambda *a, **k: calls.append(1) or original(*a, **k))
    model(ids, labels=labels)
    assert calls == [1]


@pytest.mark.slow
def test_compiled_model_keeps_the_fused_loss_outside_the_graph(monkeypatch):
    """Under torch.compile the fused loss runs eagerly (graph break), with the same result."""
    model, ids, labels = _model_and_batch("debug-neox")
    calls = []
    original = gpt.linear_cross_entropy_sum

    def counting(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return original(*args, **kwargs)

    monkeypatch.setattr(gpt, "linear_cross_entropy_sum", counting)
    want = model(ids, labels=labels)
    got = torch.compile(model)(ids, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert calls and not any(calls)  # called, and never while tracing
    got.backward()


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_gradient_equals_the_plain_product_cast(dtype, monkeypatch):
    """`_scaled` writes (grad * scale).to(dtype) a chunk of rows at a time: bit for bit the same,
    whatever the chunking (one row, a few rows, all at once), for a matrix and for a vector."""
    g = torch.Generator().manual_seed(0)
    grad, bias, scale = torch.randn(300, 77, generator=g) * 1e-3, torch.randn(1001, generator=g), torch.tensor(0.3712)
    for chunk_bytes in (1, 77 * 4 * 7, fused_loss.LOSS_CHUNK_BYTES):
        monkeypatch.setattr(fused_loss, "LOSS_CHUNK_BYTES", chunk_bytes)
        assert torch.equal(fused_loss._scaled(grad, scale, dtype), (grad * scale).to(dtype))
        assert torch.equal(fused_loss._scaled(bias, scale, dtype), (bias * scale).to(dtype))


def test_weight_gradient_pieces_give_the_same_gradients(monkeypatch):
    """Under 16-bit autocast the weight's gradient is added up a piece of vocabulary rows at a time:
    pieces of 3 rows give the gradients that one piece of the whole vocabulary gives."""
    h, w, b, labels = _inputs(True, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = _grads(linear_cross_entropy_sum(h, w, b, labels, chunk_rows=8), (h, w, b))
        monkeypatch.setattr(fused_loss, "LOSS_CHUNK_BYTES", 3 * 4 * E)  # 3 vocabulary rows per piece
        pieces = _grads(linear_cross_entropy_sum(h, w, b, labels, chunk_rows=8), (h, w, b))
    for got, want in zip(pieces, whole):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loss_memory_is_bounded_by_its_chunks():
    """Llama-3.1-8B's head (128256 x 4096, gathered in bf16 as FSDP gathers it) on 2048 tokens, on
    fake tensors, with torch's memory tracker. Forward: beside the gradients it keeps, the loss holds
    its chunk buffers and a piece of the weight's gradient, not a 16-bit copy of the whole (V, E)
    product (1 GB). Backward: it creates the two gradients it returns (the weight's in bf16, the
    hidden's in float32) and nothing else: no float32 (V, E) product beside the kept one (2 GB)."""
    n, hidden, vocab = 2048, 4096, 128256
    fwd, bwd = _fake_peaks(linear_cross_entropy_sum, n, hidden, vocab, lambda loss: loss.grad_fn.saved_tensors)
    kept = n * hidden * 2 + vocab * hidden * 4  # grad_h (bf16) and grad_w (float32)
    transient = fwd["_MemRefType.ACT"] - kept
    assert 0 < transient < vocab * hidden * 2 // 2  # about a third of it: 330 MiB of 1002
    assert bwd["_MemRefType.TEMP"] == n * hidden * 4 + vocab * hidden * 2


def test_float32_gradients_are_scaled_in_place():
    """A float32 head (32-true): the backward pass scales the kept weight and bias gradients where
    they are and creates only the hidden's gradient: no second (V, E) float32 matrix (2 GB for
    Llama-3's head). Values: the plain loss's gradients times the incoming gradient. A second
    backward pass over the same forward pass (retain_graph) would scale them twice: it is refused."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    n, hidden, vocab = 256, 512, 16000
    with FakeTensorMode(), loss_settings(reuse_scratch=False, skip_ignored=False):
        h = torch.empty(n, hidden, requires_grad=True)
        w = torch.empty(vocab, hidden, requires_grad=True)
        b = torch.empty(vocab, requires_grad=True)
        labels = torch.zeros(n, dtype=torch.long)
        loss = linear_cross_entropy_sum(h, w, b, labels)
        backward = MemTracker()
        backward.track_external(h, w, b, labels, loss, *loss.grad_fn.saved_tensors)
        with backward:
            loss.backward()
    ((_, bwd),) = backward.get_tracker_snapshot("peak").items()
    assert {str(k): v for k, v in bwd.items()}["_MemRefType.TEMP"] == n * hidden * 4  # the hidden's only

    h, w, b, labels = _inputs(True, 0.3)
    want = _grads(2.5 * cross_entropy_sum(F.linear(h, w, b), labels), (h, w, b))
    loss = 2.5 * linear_cross_entropy_sum(h, w, b, labels)
    got = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="runs once per forward pass"):
        torch.autograd.grad(loss, (h, w, b))


# ------------------------------------------------------------------------------ per-token log-probabilities


def _plain_log_probs(h, w, b, labels):
    """log_softmax of the float32 logits at each label, 0 where ignored: the obvious way."""
    valid = labels != IGNORE_INDEX
    log_probs = torch.log_softmax(F.linear(h, w, b).float(), dim=-1)
    return torch.where(valid, log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
@pytest.mark.parametrize("skip_ignored", [True, False])
def test_label_log_probs_and_gradients_match_log_softmax(bias, chunk_rows, skip_ignored):
    """Values (N,) and gradients w.r.t. hidden, weight and bias under an incoming gradient that differs
    per row (as a preference loss gives), with ignored labels present."""
    h, w, b, labels = _inputs(bias, 0.3)
    assert (labels == IGNORE_INDEX).any()
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(9))
    want = _plain_log_probs(h, w, b, labels)
    got = linear_label_log_probs(h, w, b, labels, chunk_rows=chunk_rows, skip_ignored=skip_ignored)
    assert got.shape == (N,) and got.dtype == torch.float32
    assert torch.all(got[labels == IGNORE_INDEX] == 0) and torch.all(got[labels != IGNORE_INDEX] < 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, ref in zip(_grads((got * upstream).sum(), (h, w, b)), _grads((want * upstream).sum(), (h, w, b))):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)


def test_label_log_probs_sum_to_minus_the_loss_and_keep_the_batch_shape():
    h, w, b, labels = _inputs(True, 0.3)
    hb, lb = h[:36].reshape(4, 9, E), labels[:36].reshape(4, 9)
    got = linear_label_log_probs(hb, w, b, lb)
    assert got.shape == (4, 9)
    torch.testing.assert_close(-got.sum(), linear_cross_entropy_sum(hb, w, b, lb), rtol=1e-6, atol=1e-4)


def test_bf16_label_log_probs_match_log_softmax():
    """bf16 weights and hidden states: bf16 gradients; and float32 ones under bf16 autocast. Both
    against the plain computation in the same precision."""
    h, w, _, labels = _inputs(False, 0.3, dtype=torch.bfloat16)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(9))
    got = linear_label_log_probs(h, w, None, labels, chunk_rows=8)
    want = _plain_log_probs(h, w, None, labels)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-2)
    for g, ref in zip(_grads((got * upstream).sum(), (h, w)), _grads((want * upstream).sum(), (h, w))):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), ref.float(), rtol=3e-2, atol=3e-2)

    h, w, b, labels = _inputs(True, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_label_log_probs(h, w, b, labels, chunk_rows=8)
        want = _plain_log_probs(h, w, b, labels)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-2)
    for g, ref in zip(_grads((got * upstream).sum(), (h, w, b)), _grads((want * upstream).sum(), (h, w, b))):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["debug-neox", "debug-gemma", "debug-phi"])
def test_model_per_token_log_probs_equal_log_softmax_of_its_logits(name):
    """GPT(ids, labels, per_token=True) (B, T) == log_softmax(GPT(ids)) at the labels, gradients of every
    parameter included; its sum is minus the summed loss."""
    model, ids, labels = _model_and_batch(name)
    params = list(model.parameters())
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(9))
    fused = model(ids, labels=labels, per_token=True)
    assert fused.shape == labels.shape
    fused_grads = torch.autograd.grad((fused * upstream).sum(), params)
    logits = model(ids)
    plain = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    plain = torch.where(labels != IGNORE_INDEX, plain, 0.0)
    plain_grads = torch.autograd.grad((plain * upstream).sum(), params)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(-fused.sum(), model(ids, labels=labels), rtol=1e-5, atol=1e-4)
    for (n, _), g, ref in zip(model.named_parameters(), fused_grads, plain_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_per_token_with_a_lora_head_takes_the_plain_path():
    peft = pytest.importorskip("peft")
    model, ids, labels = _model_and_batch("debug-neox")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    got = model(ids, labels=labels, per_token=True)
    torch.testing.assert_close(got, label_log_probs(model(ids), labels))
    assert got.shape == labels.shape and torch.all(got[labels == IGNORE_INDEX] == 0)


def test_per_token_without_labels_is_refused():
    model, ids, _ = _model_and_batch("debug-neox")
    with pytest.raises(ValueError, match="pass labels"):
        model(ids, per_token=True)


def test_label_log_probs_never_hold_the_whole_float32_logits():
    """Llama-3.1-8B's head (bf16) on 2048 tokens under bf16 autocast, on fake tensors, with torch's
    memory tracker: the forward pass holds its chunk buffers (a fifth of the (N, V) float32 logits,
    1002 MiB), the backward pass the weight's float32 gradient, its bf16 copy and the hidden's
    gradients beside the same chunk buffers: never a (N, V) float32 matrix."""
    n, hidden, vocab = 2048, 4096, 128256
    logits_bytes = n * vocab * 4
    fwd, bwd = _fake_peaks(linear_label_log_probs, n, hidden, vocab,
                           lambda out: out.grad_fn.saved_tensors)
    assert 0 < fwd["_MemRefType.ACT"] < logits_bytes // 3
    gradients = vocab * hidden * (4 + 2) + n * hidden * (4 + 2)  # float32 and bf16 weight; bf16 and float32 hidden
    assert gradients < bwd["_MemRefType.TEMP"] < gradients + logits_bytes // 3


def _fake_peaks(loss_fn, n: int, hidden: int, vocab: int, saved) -> tuple[dict, dict]:
    """Peak memory by kind (MemTracker's snapshot) of `loss_fn(h, w, None, labels)` under bf16
    autocast on fake tensors (h (n, hidden) float32, w (vocab, hidden) bf16), forward and backward
    apart; `saved(out)`: what the forward pass kept, which the backward tracker counts as existing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(), loss_settings(reuse_scratch=False, skip_ignored=False):
        h = torch.empty(n, hidden, requires_grad=True)
        w = torch.empty(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(n, dtype=torch.long)
        forward = MemTracker()
        forward.track_external(h, w, labels)
        with forward, torch.autocast("cpu", dtype=torch.bfloat16):
            out = loss_fn(h, w, None, labels)
        backward = MemTracker()
        backward.track_external(h, w, labels, out, *saved(out))
        with backward:
            (out if out.dim() == 0 else out.sum()).backward()
    ((_, fwd),) = forward.get_tracker_snapshot("peak").items()
    ((_, bwd),) = backward.get_tracker_snapshot("peak").items()
    return {str(k): v for k, v in fwd.items()}, {str(k): v for k, v in bwd.items()}


# ------------------------------------------------------------------------------ final-logit softcap


def _softcapped(h, w, b, cap):
    return torch.tanh(F.linear(h, w, b) / cap) * cap


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_loss_and_log_probs_match_the_plain_softcapped_logits(bias, chunk_rows, dtype):
    """`softcap` c: loss and per-token log-probabilities (and their gradients) are those of the
    logits c * tanh(logits / c), computed plainly (in float32 from the same values: the fused
    path's softmax and tanh are float32); a cap of 2 moves the loss far from the uncapped one."""
    h, w, b, labels = _inputs(bias, 0.3, dtype=dtype)
    with torch.no_grad():
        w.mul_(8)  # logits of tens: the cap bites
    tensors = (h, w, b)
    exact = [None if t is None else t.detach().float().requires_grad_() for t in tensors]
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(9))
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    want = cross_entropy_sum(_softcapped(*exact, 2.0), labels)
    got = linear_cross_entropy_sum(h, w, b, labels, chunk_rows=chunk_rows, softcap=2.0)
    torch.testing.assert_close(got, want, **tol)
    assert (want - _plain(*exact, labels)).abs() > 10
    for g, ref in zip(_grads(got, tensors), _grads(want, exact)):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), ref, **tol)
    want = label_log_probs(_softcapped(*exact, 2.0), labels)
    got = linear_label_log_probs(h, w, b, labels, chunk_rows=chunk_rows, softcap=2.0)
    torch.testing.assert_close(got, want, **tol)
    for g, ref in zip(_grads((got * upstream).sum(), tensors), _grads((want * upstream).sum(), exact)):
        torch.testing.assert_close(g.float(), ref, **tol)


def test_a_model_with_a_final_softcap_caps_its_logits_and_its_fused_loss():
    """GPT with `final_logit_softcap`: its logits never exceed the cap, and its fused loss and
    per-token log-probs equal the plain ones on those logits, gradients included."""
    model, ids, labels = _model_and_batch("debug-gemma")
    uncapped = model(ids)
    model.config = model.config.replace(final_logit_softcap=0.5)
    params = list(model.parameters())
    logits = model(ids)
    assert uncapped.abs().max() > 1 and logits.abs().max() <= 0.5
    plain = cross_entropy_sum(logits, labels)
    plain_grads = torch.autograd.grad(plain, params)
    fused = model(ids, labels=labels)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    for (n, _), g, ref in zip(model.named_parameters(), torch.autograd.grad(fused, params), plain_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    per_token = model(ids, labels=labels, per_token=True)
    torch.testing.assert_close(per_token, label_log_probs(model(ids), labels), rtol=1e-5, atol=1e-5)
