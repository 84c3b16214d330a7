"""Data at scale: true streaming (flat memory, exact resume), weighted mixtures, the datasets map cache,
configurable tokenizers and their special tokens."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3train.data import DataConfig, DataError, build_dataloader, build_tokenizer
from k3train.data import datasets as data_files
from k3train.data.config import SourceConfig
from k3train.data.loader import row_sources
from k3train.data.tokenizers import check_special_ids
from test_data import check_batch_invariants

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    return tmp_path / "cache"


def write_jsonl(path: Path, letter: str, n: int, seed: int) -> list[str]:
    """n documents of 5..60 words made of one letter (so a token tells its source)."""
    rng = np.random.default_rng(seed)
    texts = [
        " ".join(letter * int(rng.integers(1, 6)) + str(i) for _ in range(int(rng.integers(5, 60)))) for i in range(n)
    ]
    path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return texts


def cfg_(**kw) -> DataConfig:
    return DataConfig(**{"source": "files", "seq_len": 32, "micro_batch": 4, "eval_fraction": 0.0, **kw})


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "cu_seqlens"))


def resumes_exactly(cfg, tok, *, before: int, after: int, **kw) -> None:
    """A loader saved after `before` micro-batches and rebuilt from its JSON state gives the next `after` ones."""
    a = build_dataloader(cfg, tok, vocab_size=512, **kw)
    for _ in range(before):
        next(a)
    sd = json.loads(json.dumps(a.state_dict()))  # the checkpoint holds it as JSON
    expect = [next(a) for _ in range(after)]
    b = build_dataloader(cfg, tok, vocab_size=512, **kw)
    b.load_state_dict(sd)
    assert all(same(e, next(b)) for e in expect)


# ------------------------------------------------------------------------------------------------ streaming


def test_streaming_reads_in_order_and_resumes_exactly(tmp_path):
    tok = build_tokenizer(DataConfig())
    texts = []
    for i in range(3):
        texts += write_jsonl(tmp_path / f"part{i}.jsonl", "abc"[i], 40, seed=i)
    cfg = cfg_(paths=[str(tmp_path / "part*.jsonl")], streaming=True)
    loader = build_dataloader(cfg, tok, vocab_size=512)
    b = next(loader)
    check_batch_invariants(b, bos_id=tok.bos_id, seq_len=32, rows=4)
    stream = [t for x in texts for t in [tok.bos_id, *tok.encode(x), tok.eos_id]]
    assert b["input_ids"].reshape(-1).tolist() == stream[:128]  # file order, the same packing as the whole corpus
    # Mid-epoch, across a tokenized batch boundary, and past the end of the data (the next epoch).
    total_rows = len(stream) // 32
    resumes_exactly(cfg, tok, before=3, after=3)
    resumes_exactly(cfg, tok, before=total_rows // 4 - 1, after=4)
    # Two data-parallel ranks read disjoint shards (whole files here: 3 files, 3 ranks); each resumes its own.
    ranks = [
        build_dataloader(cfg_(paths=cfg.paths, streaming=True, micro_batch=2), tok, dp_rank=r, dp_world=3)
        for r in range(3)
    ]
    firsts = [next(r)["input_ids"] for r in ranks]
    for r, f in enumerate(firsts):
        assert tok.decode(f[0].tolist()).lstrip()[0] == "abc"[r]
    resumes_exactly(cfg_(paths=cfg.paths, streaming=True, micro_batch=2), tok, before=5, after=2, dp_rank=1, dp_world=3)
    sd = ranks[0].state_dict()
    with pytest.raises(DataError, match="dp_world"):
        build_dataloader(cfg_(paths=cfg.paths, streaming=True, micro_batch=6), tok).load_state_dict(sd)


def test_streaming_eval_split_and_errors(tmp_path):
    tok = build_tokenizer(DataConfig())
    write_jsonl(tmp_path / "d.jsonl", "a", 60, seed=0)
    cfg = cfg_(paths=[str(tmp_path / "d.jsonl")], streaming=True, eval_fraction=0.3)
    ev = build_dataloader(cfg, tok, split="eval")
    first, again = [x["input_ids"] for x in ev], [x["input_ids"] for x in ev]
    assert len(first) == len(ev) and all(torch.equal(x, y) for x, y in zip(first, again))
    train_docs = {tok.decode(r.tolist()) for r in next(build_dataloader(cfg, tok))["input_ids"]}
    assert not any(tok.decode(r.tolist()) in train_docs for r in first[0])
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": " "}) + "\n")
    with pytest.raises(DataError, match="no train documents"):
        next(build_dataloader(cfg_(paths=[str(tmp_path / "blank.jsonl")], streaming=True), tok))
    with pytest.raises(DataError, match="exceeds the model vocab_size 120"):
        build_dataloader(cfg, tok, vocab_size=120)


@pytest.mark.slow
def test_streaming_memory_is_flat_as_the_corpus_grows_10x():
    sys.path.insert(0, str(TOOLS))
    import bench_data_memory

    r = bench_data_memory.main(["--mb", "1", "--factor", "10", "--seq-len", "512"])
    added = r["sizes_bytes"][1] - r["sizes_bytes"][0]
    grown = r["peak_growth_bytes"][1] - r["peak_growth_bytes"][0]
    # Holding the tokens would take at least 2 bytes per added corpus byte (uint16 ids); streaming holds none.
    assert grown < 0.1 * added, r
    assert r["rows"][1] > 9 * r["rows"][0]


# ------------------------------------------------------------------------------------------------ mixtures


def _mixture(tmp_path, **kw) -> DataConfig:
    write_jsonl(tmp_path / "a.jsonl", "a", 50, seed=1)
    write_jsonl(tmp_path / "b.jsonl", "b", 30, seed=2)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": "c" * (20 + i)}) + "\n" for i in range(40)))
    sources = [
        SourceConfig(name="a", weight=3.0, paths=[str(tmp_path / "a.jsonl")]),
        SourceConfig(name="b", weight=1.0, paths=[str(tmp_path / "b.jsonl")]),
        SourceConfig(name="c", weight=1.0, paths=[str(tmp_path / "c.jsonl")], text_field="body"),
    ]
    return cfg_(sources=sources, **kw)


def _row_letter(tok, row) -> str:
    return next(ch for ch in tok.decode(row.tolist()) if ch in "abc")


@pytest.mark.parametrize("streaming", [False, True])
def test_mixture_resumes_exactly_and_counts_tokens(tmp_path, streaming):
    tok = build_tokenizer(DataConfig())
    cfg = _mixture(tmp_path, streaming=streaming)
    resumes_exactly(cfg, tok, before=7, after=4)
    loader = build_dataloader(cfg, tok, vocab_size=512)
    seen = {"a": 0, "b": 0, "c": 0}
    for _ in range(10):
        for row in next(loader)["input_ids"]:
            seen[_row_letter(tok, row)] += 32
    assert loader.metrics() == {f"data/tokens/{k}": v for k, v in seen.items()}
    if not streaming:  # the mixture shards like a single stream: two ranks together give one process's rows
        halves = [build_dataloader(_mixture(tmp_path, micro_batch=2), tok, dp_rank=r, dp_world=2) for r in range(2)]
        one = build_dataloader(cfg, tok)
        for _ in range(3):
            assert torch.equal(torch.cat([next(h)["input_ids"] for h in halves]), next(one)["input_ids"])


def test_mixture_proportions_within_binomial_error(tmp_path):
    weights = np.array([3.0, 1.0, 1.0])
    n = 40_000
    cum = np.cumsum(weights / weights.sum())[:-1]
    counts = np.bincount(row_sources(7, 1000, n, cum), minlength=3)
    p = weights / weights.sum()
    assert np.all(np.abs(counts - n * p) < 4 * np.sqrt(n * p * (1 - p))), counts
    assert not np.array_equal(row_sources(7, 0, 64, cum), row_sources(8, 0, 64, cum))  # the seed matters
    # Through the loader: rows drawn from each source.
    tok = build_tokenizer(DataConfig())
    loader = build_dataloader(_mixture(tmp_path, micro_batch=50, seq_len=16), tok)
    got = np.zeros(3)
    for _ in range(20):
        for row in next(loader)["input_ids"]:
            got["abc".index(_row_letter(tok, row))] += 1
    m = got.sum()
    assert np.all(np.abs(got - m * p) < 4 * np.sqrt(m * p * (1 - p))), got


def test_mixture_refusals(tmp_path):
    from k3train.config import ConfigError, load_config

    cfg = _mixture(tmp_path)
    tok = build_tokenizer(DataConfig())
    with pytest.raises(DataError, match="not both"):
        build_dataloader(DataConfig(**{**cfg.__dict__, "paths": [str(tmp_path / "a.jsonl")]}), tok)
    (tmp_path / "t.txt").write_text("plain text")
    mixed = SourceConfig(paths=[str(tmp_path / "a.jsonl"), str(tmp_path / "t.txt")])
    with pytest.raises(DataError, match="mixes formats"):
        build_dataloader(cfg_(sources=[mixed]), tok)
    for override, match in (
        (["data.source=files", "data.paths=[x.jsonl]", "+data.sources=[{paths: [y.jsonl]}]"], "not both"),
        (["data.source=files", "+data.sources=[{paths: [y.jsonl], weight: 0}]"], "weight"),
        (["data.source=files", "+data.sources=[{paths: []}]"], "paths"),
        (["data.streaming=true"], "streaming"),
        (["data.num_proc=0"], "num_proc"),
        (["data.source=files", "data.paths=[x.jsonl]", "data.streaming=true", "data.num_proc=2"], "num_proc"),
        (["data.tiktoken_pattern=x"], "tiktoken_pattern"),
        (
            [
                "data.source=files",
                "data.paths=[x.jsonl]",
                "data.streaming=true",
                "data.eval_fraction=0",
                "train.eval_interval=10",
            ],
            "no document would reach eval",
        ),
        (["+model.overrides.vocab_size=260", "data.special_tokens=['<a>','<b>']"], "vocab"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config("tiny_cpu", override)


# ------------------------------------------------------------------------------------------------ map cache


def test_map_cache_is_read_on_the_second_run(tmp_path, cache, monkeypatch):
    tok = build_tokenizer(DataConfig())
    texts = write_jsonl(tmp_path / "d1.jsonl", "a", 30, seed=3) + write_jsonl(tmp_path / "d2.jsonl", "b", 30, seed=4)
    src = SourceConfig(name="d", paths=[str(tmp_path / "d*.jsonl")])
    first = data_files.build_source_docs(cfg_(), src, tok, progress=False)
    assert [tok.decode(first.tokens[first.offsets[i] : first.offsets[i + 1]].tolist()) for i in range(60)] == texts
    assert list(cache.rglob("cache-*.arrow"))
    with monkeypatch.context() as m:  # the second build must come from the map cache, without tokenizing
        m.setattr(data_files.Tokenize, "__call__", lambda *a: pytest.fail("tokenized again"))
        second = data_files.build_source_docs(cfg_(), src, tok, progress=False)
    assert np.array_equal(first.tokens, second.tokens) and np.array_equal(first.doc_hash, second.doc_hash)
    # Two tokenizing processes give the same documents.
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "cache2"))
    two = data_files.build_source_docs(cfg_(num_proc=2), src, tok, progress=False)
    assert np.array_equal(first.tokens, two.tokens) and np.array_equal(first.offsets, two.offsets)
    assert list((tmp_path / "cache2").rglob("cache-*_00001_of_00002.arrow"))  # written by the second process


# ------------------------------------------------------------------------------------------------ tokenizers


def _ranks_file(path: Path) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for t in (b"ab", b"abc", b" a", b"12", b"123"):
        ranks[t] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_pattern_and_special_tokens(tmp_path):
    import tiktoken

    ranks = _ranks_file(tmp_path / "t.tiktoken")
    pattern = r"\d|[^\d\s]+|\s+"  # one digit at a time, unlike the default's groups of three
    texts = ["abc ab 12345 abcabc", "  a1 23\n", "x y 123"]
    ref = tiktoken.Encoding(name="ref", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    tok = build_tokenizer(
        DataConfig(
            tokenizer="tiktoken",
            tokenizer_path=str(tmp_path / "t.tiktoken"),
            tiktoken_pattern=pattern,
            special_tokens=["<|image|>", "<|/image|>"],
        )
    )
    assert [a.tolist() for a in tok.encode_batch(texts)] == [ref.encode_ordinary(t) for t in texts]
    default = build_tokenizer(DataConfig(tokenizer="tiktoken", tokenizer_path=str(tmp_path / "t.tiktoken")))
    assert default.encode("12345") != tok.encode("12345") and default.fingerprint != tok.fingerprint
    n = len(ranks)
    assert tok.special_ids == {"bos": n, "eos": n + 1, "pad": n + 2, "<|image|>": n + 3, "<|/image|>": n + 4}
    assert tok.vocab_size == n + 5
    check_special_ids(tok, n + 5)
    with pytest.raises(DataError, match="outside the model vocabulary"):
        check_special_ids(tok, n + 4)
    with pytest.raises(DataError, match="tiktoken_pattern"):
        build_tokenizer(
            DataConfig(tokenizer="tiktoken", tokenizer_path=str(tmp_path / "t.tiktoken"), tiktoken_pattern="(unclosed")
        )
    with pytest.raises(DataError, match="distinct"):
        build_tokenizer(DataConfig(special_tokens=["<a>", "<a>"]))
    assert build_tokenizer(DataConfig(special_tokens=["<a>"])).special_ids["<a>"] == 259


def test_hf_special_tokens_from_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(
        ["hello world, the start and the end"] * 10,
        trainers.BpeTrainer(
            vocab_size=300,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<s>", "</s>"],
            show_progress=False,
        ),
    )
    t.save(str(tmp_path / "tokenizer.json"))
    plain = build_tokenizer(DataConfig(tokenizer="hf", tokenizer_path=str(tmp_path / "tokenizer.json")))
    assert (plain.bos_id, plain.eos_id) == (0, 1)  # the file's conventional spellings; PAD added after its ids
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": {"content": "<|start|>"}, "eos_token": "</s>", "additional_special_tokens": ["<|image|>"]}
        )
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|fill|>"}))
    tok = build_tokenizer(
        DataConfig(tokenizer="hf", tokenizer_path=str(tmp_path / "tokenizer.json"), special_tokens=["<|/image|>"])
    )
    ids = tok.special_ids
    assert ids["eos"] == 1 and ids["bos"] == plain.pad_id and len(set(ids.values())) == 5
    assert set(ids) == {"bos", "eos", "pad", "<|image|>", "<|/image|>"}
    assert ids["<|image|>"] in tok.encode("see <|image|> here") and tok.fingerprint != plain.fingerprint
    assert tok.vocab_size == max(ids.values()) + 1
