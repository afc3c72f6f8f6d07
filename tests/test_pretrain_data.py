"""Pretraining data through real litdata: batches, caching, concurrency, interruption, resume, mixes, errors."""

import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from toolkit.data import StreamMix, TextFiles
from toolkit.data.streams import _publish, _stream_stats, collate_blocks, optimize_text_to_stream
from toolkit.errors import UserError
from toolkit.tokenizer import Tokenizer

BLOCK = 65  # max_seq_length 64 + 1
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(assets) -> Tokenizer:
    return Tokenizer(assets / "tokenizers" / "gpt-neox-20b")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, assets) -> dict:
    """Small real corpora: a ~50 KB Shakespeare slice (.txt) and 60 C4 documents (.jsonl)."""
    root = tmp_path_factory.mktemp("corpora")
    txt = root / "shakespeare.txt"
    txt.write_text((assets / "tinyshakespeare.txt").read_text()[:50_000])
    jsonl = root / "c4.jsonl"
    lines = (assets / "pretrain" / "c4_demo.jsonl").read_text().splitlines()[:60]
    jsonl.write_text("\n".join(lines) + "\n")
    return {"txt": txt, "jsonl": jsonl}


def _assert_batch(batch: dict, batch_size: int) -> None:
    assert set(batch) == {"input_ids", "labels"}
    for key in ("input_ids", "labels"):
        assert batch[key].shape == (batch_size, BLOCK - 1) and batch[key].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def _tokenized_dirs(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def test_collate_blocks_shifts_labels():
    blocks = [torch.arange(5, dtype=torch.int32), torch.arange(10, 15, dtype=torch.int32)]
    batch = collate_blocks(blocks)
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert batch["labels"].dtype == torch.int64


def test_text_file_batches(tmp_path, tok, corpora):
    data = TextFiles(train_path=corpora["txt"], cache_dir=tmp_path / "cache")
    data.prepare(tok, BLOCK, tmp_path)
    loader = data.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=1)
    batches = list(loader)
    assert len(batches) == len(loader) > 10
    for batch in batches:
        _assert_batch(batch, 4)
    source = corpora["txt"].read_text()
    # Train blocks are real, contiguous text (only a block across a held-out piece would not be).
    decoded = [tok.decode(row) for row in batches[0]["input_ids"]]
    assert sum(text in source for text in decoded) >= 3
    val = list(data.val_dataloader(micro_batch_size=2, block_size=BLOCK))
    assert val and all(b["input_ids"].shape[1] == BLOCK - 1 for b in val)
    assert sum(len(b["input_ids"]) for b in val) == _stream_stats(data.data_dir / "val", BLOCK)[1]  # every block
    assert tok.decode(val[0]["input_ids"][0]) in source  # one held-out piece: contiguous
    # Same seed, same order; another seed, another order.
    again = next(iter(data.train_dataloader(4, BLOCK, seed=1)))
    other = next(iter(data.train_dataloader(4, BLOCK, seed=2)))
    assert torch.equal(again["input_ids"], batches[0]["input_ids"])
    assert not torch.equal(other["input_ids"], batches[0]["input_ids"])


@pytest.mark.parametrize("block", [BLOCK, 33])
def test_ranks_read_the_blocks_of_one_process_whatever_the_block_count(tmp_path, tok, corpora, block):
    """2 ranks reading global micro-batches of 2 x 2 blocks take, between them, exactly the blocks one
    process takes in micro-batches of 2, batch after batch, for the whole epoch. The block counts
    here are odd, so whole batches of 2 and of 4 keep different numbers of blocks: litdata's
    shuffle, which permutes the blocks it keeps, must see all of them."""
    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache")
    data.prepare(tok, block, tmp_path)
    assert _stream_stats(data.data_dir / "train", block)[1] % 2 == 1
    one = [b["input_ids"] for b in data.train_dataloader(2, block, seed=3)]
    ranks = [data.train_dataloader(2, block, seed=3, rank=r, world_size=2) for r in range(2)]
    assert all(len(loader) == len(one) // 2 for loader in ranks)
    two = [torch.cat(pair) for pair in zip(*([b["input_ids"] for b in loader] for loader in ranks))]
    assert len(two) == len(one) // 2 and len(two) > 10
    for step, rows in enumerate(two):
        assert torch.equal(rows, torch.cat(one[2 * step : 2 * step + 2])), step


@pytest.mark.parametrize("name", ["gpt-neox-20b", "llama2"])
def test_jsonl_keeps_every_document(tmp_path, corpora, assets, name):
    tok = Tokenizer(assets / "tokenizers" / name)
    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache", val_fraction=0.1)
    start_method = multiprocessing.get_start_method(allow_none=True)
    ctrl_c = signal.getsignal(signal.SIGINT)
    data.prepare(tok, BLOCK, tmp_path)
    # litdata's global side effects are undone.
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # litdata's ends the process with exit code 0
    assert multiprocessing.get_start_method(allow_none=True) == start_method
    assert not [k for k in os.environ if k.startswith("DATA_OPTIMIZER_")]
    _assert_batch(next(iter(data.train_dataloader(8, BLOCK, seed=0))), 8)
    meta = json.loads((data.data_dir / "meta.json").read_text())
    texts = [json.loads(line)["text"] for line in corpora["jsonl"].read_text().splitlines()]
    # Each record is one document: BOS (llama2 only, as its tokenizer adds one) + text + EOS.
    expected = sum(len(tok.encode(t, eos=True)) for t in texts)
    assert meta["train_tokens"] + meta["val_tokens"] == expected
    assert 0 < meta["val_tokens"] < meta["train_tokens"]


def test_folder_and_val_path(tmp_path, tok, corpora, assets):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(corpora["txt"].read_text()[:20_000])
    (folder / "sub" / "b.jsonl").write_text(corpora["jsonl"].read_text())
    (folder / "notes.md").write_text("ignored: not .txt or .jsonl")
    val = tmp_path / "val.txt"
    stories = (assets / "pretrain" / "tinystories_train_head_197k.txt").read_text()
    val.write_text(stories[:3_000])  # under 4 KB: a single piece, so its tokens equal one encode()
    data = TextFiles(train_path=folder, val_path=val, cache_dir=tmp_path / "cache")
    data.prepare(tok, BLOCK, tmp_path)
    meta = json.loads((data.data_dir / "meta.json").read_text())
    assert meta["val_tokens"] == len(tok.encode(val.read_text(), eos=True))
    batch = next(iter(data.val_dataloader(2, BLOCK)))
    assert tok.decode(batch["input_ids"][0]) in val.read_text()


def test_corpus_files_for_tokenizer_training(tmp_path, corpora):
    assert TextFiles(train_path=corpora["txt"]).corpus_files(tmp_path) == [corpora["txt"]]
    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache")
    (text_file,) = data.corpus_files(tmp_path)
    assert text_file.parent == tmp_path / "cache" and text_file.suffix == ".txt"
    first = json.loads(corpora["jsonl"].read_text().splitlines()[0])["text"]
    assert text_file.read_text().startswith(first + "\n\n")
    assert data.corpus_files(tmp_path) == [text_file]  # made once
    with pytest.raises(UserError, match="pass --tokenizer_dir"):
        StreamMix(train_streams=["s3://bucket/a"]).corpus_files(tmp_path)


def test_preparation_prints_the_toolkit_lines_only(tmp_path, tok, corpora, capfd, caplog):
    """litdata's banners, worker messages and progress bars stay out of the output (any process)."""
    caplog.set_level(logging.INFO, logger="toolkit.data.streams")
    TextFiles(train_path=corpora["txt"], num_workers=2).prepare(tok, BLOCK, tmp_path)
    captured = capfd.readouterr()
    own = {record.getMessage() for record in caplog.records}  # the toolkit's own lines, through its logger
    assert any(line.startswith("tokenized data ready at") for line in own)
    stray = [line for line in (captured.out + captured.err).splitlines() if line.strip() and line not in own]
    assert stray == []


def test_long_preparations_report_progress_and_time_left(tok, caplog):
    from toolkit.data.streams import _ProgressReport, _TokenizeItems

    fn = _TokenizeItems([], tok, "text")
    caplog.set_level(logging.INFO, logger="toolkit.data.streams")
    with _ProgressReport(fn, total_bytes=4_000_000, what="train", interval=0.05):
        fn.progress.value = 1_000_000  # as a worker adds the bytes it has finished
        for _ in range(1000):  # the report thread writes a line every 0.05 s
            if "%" in caplog.text:
                break
            time.sleep(0.01)
    assert fn.progress is None  # the counter is not left behind for the next preparation
    line = caplog.records[0].getMessage()
    assert re.fullmatch(r"tokenizing train: 25% of 4.0 MB after \d+ s, about \d+ s left", line), line


def test_second_prepare_reuses_cache(tmp_path, tok, corpora, caplog):
    data = TextFiles(train_path=corpora["txt"])  # default cache: <work_dir>/data_cache
    data.prepare(tok, BLOCK, tmp_path)
    assert data.data_dir.parent == tmp_path / "data_cache"
    chunk = next((data.data_dir / "train").glob("*.bin"))
    before = (chunk.stat().st_ino, chunk.stat().st_mtime_ns)
    caplog.set_level(logging.INFO, logger="toolkit.data.streams")
    again = TextFiles(train_path=corpora["txt"])
    again.prepare(tok, BLOCK, tmp_path)
    assert "reusing tokenized data at" in caplog.text
    assert again.data_dir == data.data_dir
    assert (chunk.stat().st_ino, chunk.stat().st_mtime_ns) == before
    # Another rank only connects (no tokenizing) and finds the same data.
    other_rank = TextFiles(train_path=corpora["txt"])
    other_rank.connect(tok, BLOCK, tmp_path)
    assert other_rank.data_dir == data.data_dir
    # Changing the input makes a new entry.
    changed = tmp_path / "changed.txt"
    changed.write_text(corpora["txt"].read_text() + "\nEXTRA LINE\n")
    fresh = TextFiles(train_path=changed)
    fresh.prepare(tok, BLOCK, tmp_path)
    assert fresh.data_dir != data.data_dir
    assert len(_tokenized_dirs(tmp_path / "data_cache")) == 2


_PREPARE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from toolkit.data import TextFiles
    from toolkit.tokenizer import Tokenizer

    train, cache, tokenizer_dir = sys.argv[1:4]
    data = TextFiles(train_path=Path(train), cache_dir=Path(cache), num_workers=2)
    data.prepare(Tokenizer(tokenizer_dir), 65, Path(cache).parent)
    batch = next(iter(data.val_dataloader(1, 65)))
    print("RESULT " + json.dumps({"dir": str(data.data_dir), "ids": batch["input_ids"][0].tolist()}))
    """
)


def test_concurrent_preparations(tmp_path, tok, corpora, assets):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tokenizer_dir = str(assets / "tokenizers" / "gpt-neox-20b")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARE_SCRIPT, str(corpora[kind]), str(cache), tokenizer_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for kind in ("txt", "jsonl")
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    assert results[0]["dir"] != results[1]["dir"]
    assert len(_tokenized_dirs(cache)) == 2
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging folders left
    assert tok.decode(results[0]["ids"]) in corpora["txt"].read_text()
    # A block may span records: compare its longest piece between EOS tokens with the records' text.
    records = "\n".join(json.loads(line)["text"] for line in corpora["jsonl"].read_text().splitlines())
    pieces = tok.decode(results[1]["ids"], skip_special_tokens=False).split("<|endoftext|>")
    assert max(pieces, key=len) in records


def test_interrupted_preparation_is_redone(tmp_path, tok, corpora, caplog):
    cache = tmp_path / "cache"
    data = TextFiles(train_path=corpora["txt"], cache_dir=cache)
    data.connect(tok, BLOCK, tmp_path)
    entry = data.data_dir
    # What a killed run leaves: a half-written staging folder owned by a process that is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / f".{entry.name}.tmp-{socket.gethostname()}-{dead.pid}-abc123"
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "index.json").write_text("{broken")
    (stale / "meta.json").write_text("{}")
    caplog.set_level(logging.INFO, logger="toolkit.data.streams")
    data.prepare(tok, BLOCK, tmp_path)
    assert "reusing" not in caplog.text and "tokenizing" in caplog.text
    assert not stale.exists()
    assert (entry / "train" / "index.json").is_file()
    _assert_batch(next(iter(data.train_dataloader(2, BLOCK, seed=0))), 2)


def test_publish_loses_race_cleanly(tmp_path):
    final = tmp_path / "entry"
    (final / "train").mkdir(parents=True)
    staging = tmp_path / ".entry.tmp-x"
    (staging / "train").mkdir(parents=True)
    assert _publish(staging, final) is False
    assert not staging.exists() and final.exists()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_dict_resumes_at_the_same_batch(tmp_path, tok, corpora, num_workers):
    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache")
    data.prepare(tok, BLOCK, tmp_path)
    loader = data.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=7, num_workers=num_workers)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    fourth = next(iterator)
    resumed = data.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=7, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], fourth["input_ids"])


def test_a_loader_state_saved_with_drop_last_resumes_in_its_own_order(tmp_path, tok, corpora):
    """A TextFiles position saved by earlier versions, whose litdata dataset kept whole batches only
    (drop_last): the loader takes its setting back and continues with the batches it would have read."""
    from toolkit.data.streams import _global_view, _loader, _token_dataset

    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache")
    data.prepare(tok, BLOCK, tmp_path)
    earlier = _global_view(_token_dataset(str(data.data_dir / "train"), BLOCK, shuffle=True, seed=7, drop_last=True))
    loader = _loader(earlier, 4, 0, drop_last=True, global_view=True)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    assert state["dataset"]["drop_last"] is True
    expected = [next(iterator)["input_ids"] for _ in range(2)]
    resumed = data.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=7)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    for batch in expected:
        assert torch.equal(next(iterator)["input_ids"], batch)


def test_stream_mix(tmp_path, tok, corpora):
    streams = [optimize_text_to_stream([corpora[k]], tok, tmp_path / k) for k in ("txt", "jsonl")]
    assert all((s / "index.json").is_file() for s in streams)
    mix = StreamMix(train_streams=[str(s) for s in streams], weights=[1.0, 3.0], val_stream=str(streams[0]))
    mix.prepare(tok, BLOCK, tmp_path)
    loader = mix.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=3)
    batches = list(loader)
    assert len(batches) > 10
    for batch in batches:
        _assert_batch(batch, 4)
    _assert_batch(next(iter(mix.val_dataloader(2, BLOCK))), 2)
    # Resume works for the mix too (state holds each stream's position).
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    fourth = next(iterator)
    resumed = mix.train_dataloader(micro_batch_size=4, block_size=BLOCK, seed=3)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))["input_ids"], fourth["input_ids"])
    # Without weights every stream is read once, in proportion to its size.
    unweighted = StreamMix(train_streams=[str(s) for s in streams])
    assert unweighted.val_dataloader(2, BLOCK) is None
    assert sum(1 for _ in unweighted.train_dataloader(4, BLOCK, seed=0)) > len(batches)


def test_stream_mix_checks(tmp_path, tok):
    with pytest.raises(UserError, match="not a folder.*optimize_text_to_stream"):
        StreamMix(train_streams=[str(tmp_path / "missing")]).prepare(tok, BLOCK, tmp_path)
    with pytest.raises(UserError, match="no index.json.*litdata.optimize"):
        StreamMix(train_streams=[str(tmp_path)]).prepare(tok, BLOCK, tmp_path)
    with pytest.raises(UserError, match="2 train_streams but 1 weights"):
        StreamMix(train_streams=["s3://bucket/a", "s3://bucket/b"], weights=[1.0]).prepare(tok, BLOCK, tmp_path)
    StreamMix(train_streams=["s3://bucket/a"]).prepare(tok, BLOCK, tmp_path)  # remote: not checked
    text = tmp_path / "x.txt"
    text.write_text("hi")
    with pytest.raises(UserError, match="not an empty folder"):
        optimize_text_to_stream([text], tok, tmp_path)


def _prepare_error(tmp_path: Path, tok: Tokenizer, block_size: int = BLOCK, **kwargs) -> str:
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as info:
        TextFiles(cache_dir=cache, **kwargs).prepare(tok, block_size, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert not cache.exists()  # nothing written
    return message


def test_bad_inputs(tmp_path, tok, corpora):
    assert "does not exist" in _prepare_error(tmp_path, tok, train_path=tmp_path / "nope.txt")

    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    (empty_dir / "readme.md").write_text("not a corpus file")
    assert "no .txt or .jsonl files" in _prepare_error(tmp_path, tok, train_path=empty_dir)

    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    assert "has no text" in _prepare_error(tmp_path, tok, train_path=blank)

    binary = tmp_path / "model.txt"
    binary.write_bytes(b"PK\x03\x04\x00\x00binary")
    assert "model.txt is not a text file" in _prepare_error(tmp_path, tok, train_path=binary)

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("hello\n" * 10 + "caf\u00e9\n").encode("latin-1"))
    assert "latin1.txt is not UTF-8 text (bad byte on line 11" in _prepare_error(tmp_path, tok, train_path=latin1)

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    assert "bad.jsonl:3 is not valid JSON" in _prepare_error(tmp_path, tok, train_path=bad_json)

    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "fine"}\n{"content": "elsewhere"}\n')
    message = _prepare_error(tmp_path, tok, train_path=no_key)
    assert "nokey.jsonl:2 has no 'text' field" in message and "content" in message

    one_doc = tmp_path / "one.jsonl"
    one_doc.write_text('{"text": "just one document"}\n')
    assert "--data.val_path" in _prepare_error(tmp_path, tok, train_path=one_doc)

    assert "val_fraction" in _prepare_error(tmp_path, tok, train_path=corpora["txt"], val_fraction=1.5)


def test_corpus_too_small_for_one_block(tmp_path, tok, corpora):
    message = _prepare_error(tmp_path, tok, block_size=10_001, train_path=corpora["jsonl"])
    assert "the val split" in message and "too few for one block of 10001" in message
    tokens = int(message.split(" has ")[1].split(" tokens")[0])
    assert 0 < tokens < 10_001


def test_batch_larger_than_data(tmp_path, tok, corpora):
    data = TextFiles(train_path=corpora["jsonl"], cache_dir=tmp_path / "cache")
    data.prepare(tok, BLOCK, tmp_path)
    with pytest.raises(UserError, match="no full batch"):
        data.train_dataloader(micro_batch_size=100_000, block_size=BLOCK, seed=0)


def test_a_full_disk_while_tokenizing_is_one_line_and_a_failed_exit(tmp_path):
    """`toolkit pretrain` tokenizing into its cache (real litdata.optimize) where no file may grow past
    64 KB: RLIMIT_FSIZE in the child with SIGXFSZ ignored, so that the chunk write fails with an
    OSError as on a full disk. The run exits non-zero with one error line, and leaves no process
    behind; litdata 0.2.76 alone hung for good (its worker failed writing the last chunk)."""
    import resource

    from conftest import REPO, launch_env, tiny_pretrain_args

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "toolkit", *tiny_pretrain_args(out, 2)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=REPO, preexec_fn=small_files,
                               start_new_session=True)
    try:
        _, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and "File too large" in errors[0] and str(out.parent / "data_cache") in errors[0], err[-3000:]
    with pytest.raises(ProcessLookupError):  # the process group is gone: no worker or helper left waiting
        os.killpg(process.pid, 0)
    assert not list((out.parent / "data_cache").glob("*/index.json"))  # nothing half-written was published
