"""The lm_eval extension against the real harness and real transformers, on a random tiny Llama.

The model is made in Hugging Face format, converted to a toolkit checkpoint (`convert_from_hf`) and
exported back (`convert_to_hf`): the toolkit model runs in process through `ToolkitLM`, the export
through lm-evaluation-harness's own Hugging Face backend (`HFLM`), on the same requests.
"""

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lm_eval.evaluator import evaluate as lm_eval_loop  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from extensions.lm_eval.evaluate import TASKS_DIR, evaluate, make_task_manager  # noqa: E402
from extensions.lm_eval.model import ToolkitLM  # noqa: E402

ASSETS = REPO / "tests" / "assets"
LAMBADA = ASSETS / "eval" / "lambada_test.jsonl"  # the first 40 documents of the LAMBADA test set
TOKENIZER = ASSETS / "tokenizers" / "llama2"
BLOCK_SIZE = 128  # short enough that long LAMBADA documents are truncated and need several windows
PROG = "python -m extensions.lm_eval"


def _lambada_texts() -> list[str]:
    return [json.loads(line)["text"] for line in LAMBADA.read_text().splitlines()]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Toolkit checkpoints of one random Llama in float32 and bfloat16, and their `convert_to_hf` exports."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.convert import convert_from_hf, convert_to_hf

    root = tmp_path_factory.mktemp("lm_eval_models")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=BLOCK_SIZE, bos_token_id=1, eos_token_id=2,
    )
    hf_model = LlamaForCausalLM(config)
    out = {"root": root}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf_dir = root / f"hf_{name}"
        hf_model.to(dtype).save_pretrained(hf_dir)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(TOKENIZER / file, hf_dir / file)
        convert_from_hf(hf_dir, root / name)
        convert_to_hf(root / name, root / f"export_{name}")
        out[name], out[f"export_{name}"] = root / name, root / f"export_{name}"
    return out


@pytest.fixture(scope="module")
def lambada_file(models) -> Path:
    """The 40 LAMBADA documents; in every other one the last word is replaced by the single-token
    word the Hugging Face model predicts greedily, so that accuracy is not zero for a random model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["export_fp32"])
    model = AutoModelForCausalLM.from_pretrained(models["export_fp32"], dtype=torch.float32).eval()
    lines = []
    for index, text in enumerate(_lambada_texts()):
        if index % 2:
            context = " ".join(text.split(" ")[:-1])
            ids = tokenizer(context, return_tensors="pt").input_ids[:, -BLOCK_SIZE:]
            with torch.no_grad():
                piece = tokenizer.convert_ids_to_tokens(int(model(ids).logits[0, -1].argmax()))
            if piece.startswith("\u2581") and piece[1:].isalpha():
                text = f"{context} {piece[1:]}"
        lines.append(json.dumps({"text": text}))
    path = models["root"] / "lambada_greedy.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


DOCUMENTS = 16  # per task
TASKS = ["local_lambada", "local_perplexity", "lambada_generated"]


def _own_tasks(root: Path) -> Path:
    """A generative task of the user's own (--include_path): local_lambada's documents, answered by generation."""
    folder = root / "own_tasks"
    folder.mkdir(exist_ok=True)
    (folder / "lambada_generated.yaml").write_text(
        f"include: {TASKS_DIR / 'local_lambada.yaml'}\ntask: lambada_generated\noutput_type: generate_until\n"
        "generation_kwargs: {until: ['.'], max_gen_toks: 6, do_sample: false}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n"
    )
    return folder


def _cli_args(models, lambada_file) -> list[str]:
    return [
        str(models["fp32"]), "--tasks", ",".join(TASKS), "--include_path", str(_own_tasks(models["root"])),
        "--data_files", json.dumps({"local_lambada": str(lambada_file), "local_perplexity": str(LAMBADA)}),
        "--precision", "32-true", "--batch_size", "4", "--log_samples", "true", "--bootstrap_iters", "0",
        "--limit", str(DOCUMENTS),
    ]


@pytest.fixture(scope="module")
def one_process(models, lambada_file) -> dict:
    """`python -m extensions.lm_eval` on the three tasks, run in this process on one thread (as each
    process of a distributed run has): the results file it writes next to the checkpoint, and its output."""
    from toolkit.cli import run_function

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    capture = io.StringIO()
    try:
        with contextlib.redirect_stdout(capture):
            assert run_function(PROG, evaluate, _cli_args(models, lambada_file)) == 0
    finally:
        torch.set_num_threads(threads)
    return {"results": _read_run(models["fp32"] / "eval"), "stdout": capture.getvalue()}


def _read_run(out_dir: Path, index: int = -1) -> dict:
    """The results of a run (the last one by default) in `out_dir`, with the samples from its samples files."""
    files = sorted(out_dir.glob("results_*.json"))
    results = json.loads(files[index].read_text())
    date = files[index].stem.removeprefix("results_")
    results["samples"] = {}
    for task in results["results"]:
        path = out_dir / f"samples_{task}_{date}.jsonl"
        if path.exists():
            results["samples"][task] = [json.loads(line) for line in path.read_text().splitlines()]
    return results


def _harness(lm, data_files: dict, tasks: list[str], include_path=None, limit=None) -> dict:
    """The harness's evaluation loop, as simple_evaluate runs it (zero-shot) minus the collection of
    environment details for the report, which takes seconds."""
    manager = make_task_manager(tasks, {k: str(v) for k, v in data_files.items()}, include_path)
    loaded = manager.load(tasks)
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
    return lm_eval_loop(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=True)


def _responses(results: dict, task: str) -> list:
    return [sample["resps"][0][0] for sample in results["samples"][task]]


def _compare_offline_tasks(ours: dict, theirs: dict) -> None:
    for (ll, greedy), (ll_hf, greedy_hf) in zip(_responses(ours, "local_lambada"), _responses(theirs, "local_lambada"), strict=True):
        assert abs(ll - ll_hf) < 1e-4 and greedy == greedy_hf
    lambada, lambada_hf = ours["results"]["local_lambada"], theirs["results"]["local_lambada"]
    assert lambada["acc,none"] == lambada_hf["acc,none"] > 0.1, lambada  # the greedy words are found
    assert lambada["perplexity,none"] == pytest.approx(lambada_hf["perplexity,none"], rel=1e-4)

    rolling = _responses(ours, "local_perplexity")
    assert max(abs(a - b) for a, b in zip(rolling, _responses(theirs, "local_perplexity"), strict=True)) < 1e-4
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["local_perplexity"][metric] == pytest.approx(theirs["results"]["local_perplexity"][metric], rel=1e-5)


def test_the_command_gives_the_numbers_of_the_harness_hugging_face_backend(models, lambada_file, one_process):
    hf = HFLM(pretrained=str(models["export_fp32"]), device="cpu", dtype="float32", batch_size=4)
    files = {"local_lambada": lambada_file, "local_perplexity": LAMBADA}
    theirs = _harness(hf, files, TASKS, include_path=_own_tasks(models["root"]), limit=DOCUMENTS)
    ours = one_process["results"]
    _compare_offline_tasks(ours, theirs)
    assert _responses(ours, "lambada_generated") == _responses(theirs, "lambada_generated")  # greedy generation
    assert "|local_lambada" in one_process["stdout"]  # the table


def test_a_bfloat16_checkpoint_at_the_default_precision_gives_the_numbers_of_the_hugging_face_backend(models, lambada_file):
    files, documents = {"local_lambada": lambada_file, "local_perplexity": LAMBADA}, 10
    ours = _harness(ToolkitLM(models["bf16"], device="cpu", batch_size=4), files, list(files), limit=documents)
    hf = HFLM(pretrained=str(models["export_bf16"]), device="cpu", dtype="float32", batch_size=4)
    _compare_offline_tasks(ours, _harness(hf, files, list(files), limit=documents))


def _requests(kind: str, arguments: list) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_shared_prefixes_run_once_and_score_as_the_hugging_face_backend(models):
    contexts = [" ".join(text.split(" ")[:25]) for text in _lambada_texts()[:3]]
    choices = [" the cat sat down", " a dog", " it", " and then she left the room", " it"]  # " it" twice: a duplicate
    requests = _requests("loglikelihood", [(context, choice) for context in contexts for choice in choices])
    lm = ToolkitLM(models["fp32"], device="cpu", precision="32-true", batch_size=8)
    tokens = []
    hook = lm.model.embed.register_forward_pre_hook(lambda module, args: tokens.append(args[0].numel()))
    try:
        ours = lm.loglikelihood(requests)
    finally:
        hook.remove()
    theirs = HFLM(pretrained=str(models["export_fp32"]), device="cpu", dtype="float32", batch_size=8).loglikelihood(requests)
    for (ll, greedy), (ll_hf, greedy_hf) in zip(ours, theirs, strict=True):
        assert abs(ll - ll_hf) < 1e-4 and greedy == greedy_hf
    # Each context ran once for its four distinct continuations, not four times.
    separate = sum(len(lm.tok_encode(c + x)) - 1 for c in contexts for x in dict.fromkeys(choices))
    context_tokens = sum(len(lm.tok_encode(c)) for c in contexts)
    assert sum(tokens) < separate - 2 * context_tokens


def test_rolling_windows_with_a_stride_score_each_token_once_with_more_context(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    document = " ".join(_lambada_texts()[:3])
    L, stride = 64, 16
    tokenizer = AutoTokenizer.from_pretrained(models["export_fp32"])
    hf = AutoModelForCausalLM.from_pretrained(models["export_fp32"], dtype=torch.float32).eval()
    full = [tokenizer.bos_token_id] + tokenizer(document).input_ids  # the prefix token, then the document

    def logprobs(window: list[int]) -> torch.Tensor:  # log p(window[i + 1] | window[: i + 1]), (len - 1,)
        with torch.no_grad():
            logits = hf(torch.tensor([window])).logits[0, :-1].log_softmax(-1)
        return logits.gather(1, torch.tensor(window[1:])[:, None])[:, 0]

    n = len(full) - 1  # tokens to predict
    expected = float(logprobs(full[: L + 1]).sum())  # the first window predicts tokens 1..L
    for start in range(L, n, stride):  # then blocks of `stride`, each after the L - 1 tokens before its end
        end = min(start + stride, n)
        expected += float(logprobs(full[end - L : end + 1])[-(end - start):].sum())
    assert n > 3 * L

    request = _requests("loglikelihood_rolling", [(document,)])
    strided = ToolkitLM(models["fp32"], device="cpu", precision="32-true", max_length=L, stride=stride).loglikelihood_rolling(request)
    assert strided[0] == pytest.approx(expected, abs=1e-3)
    disjoint = ToolkitLM(models["fp32"], device="cpu", precision="32-true", max_length=L).loglikelihood_rolling(request)
    hf_disjoint = HFLM(pretrained=str(models["export_fp32"]), device="cpu", dtype="float32", max_length=L).loglikelihood_rolling(request)
    assert disjoint[0] == pytest.approx(hf_disjoint[0], abs=1e-3)
    assert abs(strided[0] - disjoint[0]) > 0.1  # more context changes the numbers (rounding stays below 1e-3)


def test_generate_until_equals_transformers_greedy_generation_cut_at_stop_strings(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["export_fp32"])
    hf = AutoModelForCausalLM.from_pretrained(models["export_fp32"], dtype=torch.float32).eval()
    prompts = [" ".join(text.split(" ")[:20]) for text in _lambada_texts()[:4]]
    greedy = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = hf.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
        greedy.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    # Stop strings taken from the middle of two of the generations, so that they cut them short.
    stops = [[greedy[0][len(greedy[0]) // 2 : len(greedy[0]) // 2 + 3]], ["\n\n"], [greedy[2][-4:], "never there"], []]
    expected = [text.split(stop[0])[0] if stop else text for text, stop in zip(greedy, stops)]
    assert expected[0] != greedy[0] and expected[2] != greedy[2]

    lm = ToolkitLM(models["fp32"], device="cpu", precision="32-true")
    kwargs = [{"until": stop, "max_gen_toks": 12, "do_sample": False} for stop in stops]
    assert lm.generate_until(_requests("generate_until", list(zip(prompts, kwargs)))) == expected


def test_chat_prompts_are_rendered_as_the_hugging_face_backend_renders_them(models, tmp_path):
    from toolkit.data.chat_template import CHAT_TEMPLATES

    history = [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another one?"},
    ]
    prefilled = [*history, {"role": "assistant", "content": "Blue, or "}]  # the model continues this message
    # Like Gemma's: no system role. The harness then drops the system message and renders again.
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + CHAT_TEMPLATES["chatml"]
    for index, template in enumerate((CHAT_TEMPLATES["llama-3"], refusing)):
        folders = {}
        for name in ("fp32", "export_fp32"):
            folders[name] = shutil.copytree(models[name], tmp_path / f"{name}_{index}")
            config_file = folders[name] / "tokenizer_config.json"
            config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": template}))
        ours = ToolkitLM(folders["fp32"], device="cpu", precision="32-true")
        theirs = HFLM(pretrained=str(folders["export_fp32"]), device="cpu", dtype="float32")
        for messages, open_turn in ((history, True), (prefilled, False)):
            assert ours.apply_chat_template(messages, open_turn) == theirs.apply_chat_template(messages, open_turn)
        assert ours.apply_chat_template(prefilled, False).rstrip().endswith("Blue, or")  # left open


def _write_adapter(models, out: Path) -> Path:
    """A LoRA adapter folder as `finetune_lora` writes it, with random (non-zero) adapter weights."""
    from dataclasses import asdict

    from peft import get_peft_model
    from safetensors.torch import save_file

    from toolkit.finetune.lora import ADAPTER_FILE, LORA_META, adapter_key, is_adapter_weight, write_peft_adapter
    from toolkit.models.adapters import LoRAArgs
    from toolkit.models.config import Config
    from toolkit.models.gpt import GPT

    lora = LoRAArgs(r=4, alpha=8, targets=("query", "value", "mlp"))
    config = Config.from_file(models["fp32"])
    torch.manual_seed(1)
    model = get_peft_model(GPT(config), lora.peft_config())
    adapters = {adapter_key(k): torch.randn_like(v) * 0.1 for k, v in model.state_dict().items() if is_adapter_weight(k)}
    out.mkdir()
    save_file(adapters, str(out / ADAPTER_FILE))
    (out / LORA_META).write_text(json.dumps({"base_checkpoint": str(models["fp32"]), "lora": asdict(lora), "quantize": None}))
    config.save(out)
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(models["fp32"] / file, out / file)
    assert write_peft_adapter(out, adapters, lora, config) is None
    return out


def test_a_lora_adapter_is_evaluated_unmerged_as_merged_and_as_peft_in_the_hugging_face_backend(models, tmp_path):
    from toolkit.finetune.lora import merge_lora

    run_dir = tmp_path / "lora"
    adapter = _write_adapter(models, run_dir.parent / "lora_final")
    run_dir.mkdir()
    shutil.move(str(adapter), run_dir / "final")  # a run folder: the adapter sits in final/
    merged = merge_lora(run_dir, tmp_path / "merged")
    texts = _lambada_texts()[:6]
    requests = _requests("loglikelihood", [(" ".join(t.split(" ")[:-1]), " " + t.split(" ")[-1]) for t in texts])

    unmerged = ToolkitLM(run_dir, device="cpu", precision="32-true").loglikelihood(requests)
    as_merged = ToolkitLM(merged, device="cpu", precision="32-true").loglikelihood(requests)
    peft_hf = HFLM(pretrained=str(models["export_fp32"]), peft=str(run_dir / "final"), device="cpu", dtype="float32").loglikelihood(requests)
    base = ToolkitLM(models["fp32"], device="cpu", precision="32-true").loglikelihood(requests)
    for (a, _), (m, _), (h, _), (b, _) in zip(unmerged, as_merged, peft_hf, base, strict=True):
        assert abs(a - m) < 1e-4 and abs(a - h) < 1e-4
        assert abs(a - b) > 1e-3  # the adapter is not a no-op


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_exactly_the_results_of_one(models, lambada_file, one_process, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "extensions.lm_eval", *_cli_args(models, lambada_file), "--devices", "2", "--out_dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    two = _read_run(tmp_path)
    one = one_process["results"]
    assert one["results"] == two["results"]
    for task in TASKS:
        assert [s["resps"] for s in one["samples"][task]] == [s["resps"] for s in two["samples"][task]]
    assert one["config"]["devices"] == 1 and two["config"]["devices"] == 2


def _one_line_error(capsys, args: list[str], *fragments: str) -> None:
    from toolkit.cli import run_function

    assert run_function(PROG, evaluate, args) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_input_is_one_line_and_writes_nothing(models, tmp_path, capsys, monkeypatch):
    data = ["--data_files", json.dumps({"local_lambada": str(LAMBADA)}), "--out_dir", str(tmp_path / "out")]
    checkpoint = str(models["fp32"])
    # A misspelled name is looked up among the harness's own tasks too (indexing them takes seconds).
    _one_line_error(capsys, [checkpoint, "--tasks", "hellaswg"], "Unknown task 'hellaswg'", "Did you mean: hellaswag")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--data_files", "{local_lambada: nowhere.jsonl}"],
                    "nowhere.jsonl does not exist")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada"], "reads a local file", "--data_files")
    _one_line_error(capsys, [str(tmp_path), "--tasks", "local_lambada", *data], "is not a toolkit checkpoint")
    _one_line_error(capsys, [checkpoint, *data], "--tasks")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--stride", "0", *data], "--stride must be between 1 and")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--chat_template", "chatlm", "--apply_chat_template", "true", *data],
                    "unknown chat template", "chatml")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--chat_template", "chatml", *data],
                    "--chat_template lays out prompts only with --apply_chat_template true")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--gen_kwargs", "max_gen_tok=5", *data],
                    "unknown setting 'max_gen_tok'", "Did you mean: max_gen_toks")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--batch_size", "big", *data], "a number or 'auto'")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--sharded", "true", *data], "needs more than one device")
    for limit in ("0", "-5", "2.5"):
        _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--limit", limit, *data], f"--limit must be a number of documents")
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--num_fewshot", "-1", *data], "--num_fewshot must be 0 or more")
    for text in ("", " \n\t\n"):  # perplexity per word of no words divided by zero
        (tmp_path / "empty.txt").write_text(text)
        _one_line_error(capsys, [checkpoint, "--tasks", "local_perplexity", "--data_files",
                                 json.dumps({"local_perplexity": str(tmp_path / "empty.txt")})], "empty.txt holds no text")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", "--data_files", json.dumps({"local_lambada": str(broken)})],
                    "broken.jsonl, line 2")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    _one_line_error(capsys, [checkpoint, "--tasks", "local_lambada", *data], "lm_eval is not installed", "requirements.txt")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- issue 23: the evaluation gaps
def test_batched_generation_equals_transformers_greedy_generate_token_for_token(models):
    """Prompts of 3 to 120+ tokens decode left-padded in batches of 5 (and alone); each row's new
    tokens are those of transformers' greedy `generate` on that prompt alone, the long ones cut on
    the left to max_length - max_gen_toks as the harness cuts them."""
    from transformers import AutoModelForCausalLM

    lm = ToolkitLM(models["fp32"], device="cpu", precision="32-true", batch_size=5)
    hf = AutoModelForCausalLM.from_pretrained(models["export_fp32"], dtype=torch.float32).eval()
    words = " ".join(_lambada_texts()).split(" ")
    contexts = [" ".join(words[30 * i : 30 * i + 2 + 14 * i]) for i in range(11)]  # 2 to 142 words
    max_new = 16
    jobs = [lm.generation_job(i, context, {"until": [], "max_gen_toks": max_new}, None) for i, context in enumerate(contexts)]
    assert any(job.truncated for job in jobs) and min(len(job.prompt) for job in jobs) < 8
    expected = []
    for job in jobs:
        ids = torch.tensor([job.prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    ordered = sorted(jobs, key=lambda job: -len(job.prompt))
    batched = [row for start in range(0, len(ordered), 5) for row in lm.decode_batch(ordered[start:start + 5])]
    assert {job.index: row for job, row in zip(ordered, batched)} == dict(enumerate(expected))
    assert [lm.decode_batch([job])[0] for job in jobs] == expected  # alone: the same tokens


def test_auto_batch_size_halves_from_the_largest_until_a_forward_pass_fits(models):
    from extensions.lm_eval.model import largest_batch_that_fits

    tried = []

    def run(size: int) -> None:  # a device on which 20 sequences fit
        tried.append(size)
        if size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert largest_batch_that_fits(run, 64) == 16 and tried == [64, 32, 16]
    tried.clear()
    assert largest_batch_that_fits(run, 48) == 16 and tried == [48, 32, 16]
    with pytest.raises(ValueError):  # anything but running out of memory is not swallowed
        largest_batch_that_fits(lambda size: (_ for _ in ()).throw(ValueError("bad")), 8)
    lm = ToolkitLM(models["fp32"], device="cpu", precision="32-true", batch_size="auto", max_batch_size=6)
    assert lm.batch_size == 6 and lm.batch_sizes == {"auto": 6}  # a CPU with room for the largest


def _cli(capsys, args: list[str]) -> tuple[int, str, str]:
    from toolkit.cli import run_function

    code = run_function(PROG, evaluate, args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_group_and_a_tag_of_the_users_own_run_the_tasks_they_name(models, lambada_file, one_process, capsys, tmp_path):
    """--include_path with a group over the offline tasks and a tag on a task of the user's: --tasks
    names the group and the tag, --data_files the files of the tasks inside them; each task scores as
    when named alone, and the group's acc is its one acc-bearing task's. A file that no task inside
    them reads is refused in one line."""
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "my_suite.yaml").write_text(
        "group: my_suite\ntask: [local_lambada, local_perplexity]\n"
        "aggregate_metric_list: [{metric: acc, aggregation: mean, weight_by_size: true}]\n"
    )
    (folder / "lambada_tagged.yaml").write_text(f"include: {TASKS_DIR / 'local_lambada.yaml'}\ntask: lambada_tagged\ntag: my_tag\n")
    files = {"local_lambada": str(lambada_file), "local_perplexity": str(LAMBADA)}
    common = [str(models["fp32"]), "--include_path", str(folder), "--precision", "32-true", "--batch_size", "4",
              "--bootstrap_iters", "0", "--limit", str(DOCUMENTS), "--log_samples", "true", "--out_dir", str(tmp_path / "out")]
    code, stdout, err = _cli(capsys, [*common, "--tasks", "my_suite,my_tag", "--data_files", json.dumps(files)])
    assert code == 0, err
    run, alone = _read_run(tmp_path / "out"), one_process["results"]
    for task in ("local_lambada", "local_perplexity"):
        assert _responses(run, task) == _responses(alone, task)
    assert _responses(run, "lambada_tagged") == _responses(alone, "local_lambada")
    assert run["groups"]["my_suite"]["acc,none"] == alone["results"]["local_lambada"]["acc,none"] > 0.1
    assert "my_suite" in stdout  # the groups' table
    # The tag's task reads local_lambada's file only.
    _one_line_error(capsys, [*common, "--tasks", "my_tag", "--data_files", json.dumps(files)],
                    "--data_files names 'local_perplexity', which no task of --tasks my_tag reads")


def _generation_tasks(root: Path) -> Path:
    """Two tasks of the user's: one that leaves max_gen_toks to the model (256 by default, more than
    the test model's context) and one marked unsafe_code whose metric executes the answer."""
    folder = root / "generation_tasks"
    folder.mkdir(exist_ok=True)
    (folder / "unsafe_metric.py").write_text(
        "def run_answer(doc, results):\n"
        "    try:\n"
        "        exec(compile(results[0], '<answer>', 'exec'), {})  # what HumanEval's metric does with a program\n"
        "        return {'runs': 1.0}\n"
        "    except Exception:\n"
        "        return {'runs': 0.0}\n"
    )
    base = f"include: {TASKS_DIR / 'local_lambada.yaml'}\noutput_type: generate_until\n"
    (folder / "open_generation.yaml").write_text(
        base + "task: open_generation\ngeneration_kwargs: {until: ['.'], do_sample: false}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n"
    )
    (folder / "unsafe_generation.yaml").write_text(
        base + "task: unsafe_generation\nunsafe_code: true\ndoc_to_target: '1'\n"
        "generation_kwargs: {until: ['\\n'], max_gen_toks: 4, do_sample: false}\n"
        "process_results: !function unsafe_metric.run_answer\n"
        "metric_list: [{metric: runs, aggregation: mean, higher_is_better: true}]\n"
    )
    return folder


def test_unsafe_code_gen_kwargs_auto_batch_and_timestamped_files(models, lambada_file, one_process, capsys, tmp_path):
    tasks = _generation_tasks(models["root"])
    out = tmp_path / "out"
    common = [str(models["fp32"]), "--include_path", str(tasks), "--precision", "32-true", "--bootstrap_iters", "0",
              "--data_files", json.dumps({"local_lambada": str(lambada_file)}), "--limit", "6", "--out_dir", str(out)]

    # A task that runs the model's code is refused in one line, before anything runs or is written.
    code, _, err = _cli(capsys, [*common, "--tasks", "local_lambada,unsafe_generation"])
    assert code != 0 and len(err.strip().splitlines()) == 1 and "unsafe_generation is marked unsafe_code" in err, err
    assert "--confirm_run_unsafe_code true" in err and not out.exists()
    # 256 tokens by default do not fit a context of 128: one line that names --gen_kwargs.
    code, _, err = _cli(capsys, [*common, "--tasks", "local_lambada,open_generation"])
    assert code != 0 and len(err.strip().splitlines()) == 1 and "--gen_kwargs max_gen_toks=N" in err, err

    args = [*common, "--tasks", "local_lambada,open_generation,unsafe_generation", "--confirm_run_unsafe_code", "true",
            "--gen_kwargs", "max_gen_toks=5", "--batch_size", "auto", "--max_batch_size", "16", "--log_samples", "true"]
    code, stdout, err = _cli(capsys, args)
    assert code == 0, err
    first = _read_run(out)
    assert first["results"]["unsafe_generation"]["runs,none"] in (0.0, 1.0 / 6, 2.0 / 6, 0.5, 4.0 / 6, 5.0 / 6, 1.0)
    assert first["configs"]["open_generation"]["generation_kwargs"]["max_gen_toks"] == 5
    assert first["config"]["batch_size"] == "auto" and first["config"]["batch_sizes"] == [16]
    # Each request asked for 5 tokens and got the answer of the model decoding 5 tokens alone.
    lm = ToolkitLM(models["fp32"], device="cpu", precision="32-true", batch_size=1)
    arguments = [tuple(s["arguments"][0]) for s in first["samples"]["open_generation"]]
    assert all(kwargs["max_gen_toks"] == 5 for _, kwargs in arguments)
    answers = lm.generate_until(_requests("generate_until", arguments))
    assert [s["resps"][0][0] for s in first["samples"]["open_generation"]] == answers and any(answers)
    # The same log-likelihoods as the batch of 4 of the first run (same shapes per row, other batches).
    ours = [s["resps"][0][0][0] for s in first["samples"]["local_lambada"]]
    theirs = [s["resps"][0][0][0] for s in one_process["results"]["samples"]["local_lambada"][:6]]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4

    # A second run writes new files beside the first (results and one samples file per task).
    assert _cli(capsys, args)[0] == 0
    assert len(list(out.glob("results_*.json"))) == 2 and len(list(out.glob("samples_open_generation_*.jsonl"))) == 2
    assert _read_run(out, 0)["samples"] == _read_run(out, 1)["samples"] == first["samples"]
    assert f"Results: {sorted(out.glob('results_*.json'))[0]}" in stdout


def test_context_truncation_is_warned_once_per_request_list(models, capsys, caplog, tmp_path):
    args = [str(models["fp32"]), "--tasks", "local_lambada", "--data_files", json.dumps({"local_lambada": str(LAMBADA)}),
            "--max_length", "24", "--limit", "8", "--bootstrap_iters", "0", "--out_dir", str(tmp_path)]
    code, _, err = _cli(capsys, args)
    assert code == 0, err
    lines = [r.getMessage() for r in caplog.records if "Left truncation applied" in r.getMessage()]
    assert len(lines) == 1 and "to 8 of 8 requests" in lines[0] and "(24)" in lines[0], lines
    caplog.clear()
    code, _, err = _cli(capsys, [*args[:-8], "--limit", "2", "--bootstrap_iters", "0", "--out_dir", str(tmp_path)])
    assert code == 0 and not [r for r in caplog.records if "Left truncation" in r.getMessage()]  # 2 documents fit in 128


def test_an_error_found_after_launch_is_one_line_for_two_processes(models, tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    # The whole document as the continuation: longer than --max_length, found when the requests exist.
    (folder / "whole_text.yaml").write_text(f"include: {TASKS_DIR / 'local_lambada.yaml'}\ntask: whole_text\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "extensions.lm_eval", str(models["fp32"]), "--tasks", "local_lambada,whole_text",
               "--include_path", str(folder), "--data_files", json.dumps({"local_lambada": str(LAMBADA)}), "--limit", "4",
               "--max_length", "16", "--devices", "2", "--out_dir", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1 and "does not fit in --max_length 16" in errors[0], result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_a_sharded_two_process_run_equals_the_one_process_run(models, lambada_file, one_process, tmp_path):
    """--sharded: the trainers' FSDP2 engine on 2 gloo processes, each holding half of every weight."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("LOCAL_RANK", None)
    command = [sys.executable, "-m", "extensions.lm_eval", *_cli_args(models, lambada_file), "--devices", "2",
               "--sharded", "true", "--out_dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sharded, one = _read_run(tmp_path), one_process["results"]
    for task in TASKS:  # log-likelihoods, rolling log-likelihoods and greedy generations
        assert [s["resps"] for s in sharded["samples"][task]] == [s["resps"] for s in one["samples"][task]], task
    assert sharded["results"] == one["results"]
    total, held = sharded["config"]["model_num_parameters"], sharded["config"]["parameters_per_process"]
    assert total == one["config"]["model_num_parameters"] and len(held) == 2 and sum(held) == total
    assert max(held) < 0.51 * total and sharded["config"]["sharded"] is True
