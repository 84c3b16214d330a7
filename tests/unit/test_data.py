"""Data pipeline: tokenizers, packing, sharding, resume, splits, files, built-in corpus, recall."""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k3train.data import DataConfig, DataError, build_dataloader, build_tokenizer, recall_accuracy
from k3train.data import datasets as data_files
from k3train.data.builtin_corpus import build_builtin_corpus, list_builtin_files, stdlib_dir
from k3train.data.datasets import build_file_corpus
from k3train.data.packing import IGNORE_INDEX, PackedStream, TokenizedDocs, check_vocab, pack_rows_reference, text_hash
from k3train.data.recall import RecallSource, recall_row_reference, sample_recall

SMALL = 200_000  # built-in corpus cap for tests


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own token cache (and tiktoken file cache)."""
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    return tmp_path / "cache"


def cfg_(**kw) -> DataConfig:
    base = dict(builtin_max_bytes=SMALL, seq_len=32, micro_batch=4)
    base.update(kw)
    return DataConfig(**base)


def docs_from_lists(lists: list[list[int]]) -> TokenizedDocs:
    lengths = np.array([len(x) for x in lists], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.array([t for x in lists for t in x], dtype=np.uint16)
    hashes = np.array([text_hash(str(x) + str(i)) for i, x in enumerate(lists)], dtype=np.uint64)
    return TokenizedDocs(tokens=tokens, offsets=offsets, doc_hash=hashes)


def check_batch_invariants(b: dict, *, bos_id: int, seq_len: int, rows: int):
    inp, lab, cu = b["input_ids"], b["labels"], b["cu_seqlens"]
    assert inp.shape == lab.shape == (rows, seq_len) and inp.dtype == lab.dtype == torch.int64
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == rows * seq_len
    assert bool((cu[1:] > cu[:-1]).all())
    starts = set(cu[:-1].tolist())
    flat = inp.reshape(-1)
    for r in range(rows):
        assert r * seq_len in starts  # every row boundary is a segment boundary
    bos_pos = set(torch.nonzero(flat == bos_id).flatten().tolist())
    assert starts == bos_pos | {r * seq_len for r in range(rows)}
    # Within a row a label is the next input, or -100 exactly where the next input is a BOS.
    nxt = inp[:, 1:]
    assert bool(torch.where(nxt == bos_id, lab[:, :-1] == IGNORE_INDEX, lab[:, :-1] == nxt).all())
    assert bool((lab != bos_id).all())


# ------------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer(DataConfig())
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    text = "héllo, wörld ✓ — \n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert [a.tolist() for a in tok.encode_batch([text, "x"])] == [ids, [120]]


def _train_hf(tmp_path, specials: list[str]) -> tuple[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials
    )
    t.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["héllo wörld"], trainer=trainer)
    path = str(tmp_path / "tokenizer.json")
    t.save(path)
    return path, t.get_vocab_size()


def test_hf_tokenizer_adds_specials_after_vocab(tmp_path):
    path, n = _train_hf(tmp_path, [])
    tok = build_tokenizer(DataConfig(tokenizer="hf", tokenizer_path=path))
    assert sorted([tok.bos_id, tok.eos_id, tok.pad_id]) == [n, n + 1, n + 2] and tok.vocab_size == n + 3
    text = "the lazy héllo fox\nnew line"
    ids = tok.encode(text)
    assert max(ids) < n and len(ids) < len(text.encode())  # merges were applied
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text


def test_hf_tokenizer_reuses_its_own_specials(tmp_path):
    path, n = _train_hf(tmp_path, ["<pad>", "<s>", "</s>"])
    tok = build_tokenizer(DataConfig(tokenizer="hf", tokenizer_path=path))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.vocab_size == n


def test_tiktoken_tokenizer(tmp_path):
    merges = [b"th", b"the", b" the", b"me", b"theme"]
    lines = [base64.b64encode(bytes([i])) + b" " + str(i).encode() for i in range(256)]
    lines += [base64.b64encode(m) + b" " + str(256 + i).encode() for i, m in enumerate(merges)]
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(b"\n".join(lines) + b"\n")
    tok = build_tokenizer(DataConfig(tokenizer="tiktoken", tokenizer_path=str(path)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (261, 262, 263, 264)
    ids = tok.encode("the theme")
    # Pieces "the" | " theme"; BPE applies merges by rank: " theme" -> " the" + "me" ("theme" never forms).
    assert ids == [257, 258, 259]
    assert tok.encode("a the") == [97, 258]  # " the" is one token
    text = "héllo ✓ 123456 the  end\n\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([tok.bos_id] + tok.encode("the") + [tok.eos_id]) == "the"


@pytest.mark.parametrize("name", ["hf", "tiktoken"])
def test_missing_tokenizer_path(tmp_path, name):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(DataError, match="nope.json"):
        build_tokenizer(DataConfig(tokenizer=name, tokenizer_path=missing))
    with pytest.raises(DataError, match="tokenizer_path"):
        build_tokenizer(DataConfig(tokenizer=name))
    with pytest.raises(DataError, match="unknown data.tokenizer"):
        build_tokenizer(DataConfig(tokenizer="sentencepiece"))


# ------------------------------------------------------------------------------------------------ packing


def test_packing_matches_reference_and_invariants():
    rng = np.random.default_rng(0)
    lists = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(0, 40, size=23)]
    docs = docs_from_lists(lists)
    L = 16
    ps = PackedStream(docs, np.arange(len(lists)), bos_id=256, eos_id=257, seq_len=L, seed=3)
    order, _ = ps.epoch_order(0)
    assert ps.epoch_len == sum(len(x) + 2 for x in lists)
    n_rows = ps.rows_per_pass()
    b = ps.rows(0, n_rows)
    ref = pack_rows_reference(lists, order.tolist(), bos_id=256, eos_id=257, seq_len=L, first_row=0, n_rows=n_rows)
    for key in ("input_ids", "labels", "cu_seqlens"):
        assert b[key].tolist() == ref[key]
    check_batch_invariants(b, bos_id=256, seq_len=L, rows=n_rows)
    # Every token of the stream is an input once: splitting the inputs at BOS gives the documents in order.
    flat = b["input_ids"].reshape(-1).tolist()
    pieces, cur = [], None
    for t in flat:
        if t == 256:
            cur = []
            pieces.append(cur)
        elif t != 257:
            cur.append(t)
    full = len(pieces) if flat[-1] == 257 else len(pieces) - 1
    assert pieces[:full] == [lists[i] for i in order.tolist()][:full]
    assert full >= len(lists) - 2
    # A middle window equals the same rows cut from the larger batch.
    mid = ps.rows(3, 4)
    assert torch.equal(mid["input_ids"], b["input_ids"][3:7]) and torch.equal(mid["labels"], b["labels"][3:7])


def test_packing_across_epochs():
    lists = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    docs = docs_from_lists(lists)
    ps = PackedStream(docs, np.arange(4), bos_id=300, eos_id=301, seq_len=5, seed=1)
    E = ps.epoch_len
    ids, is_bos = ps.window(0, 3 * E)
    for e in range(3):
        order, _ = ps.epoch_order(e)
        expect = [t for d in order for t in [300] + lists[d] + [301]]
        assert ids[e * E : (e + 1) * E].tolist() == expect
    assert is_bos.sum() == 12 and bool((ids[is_bos] == 300).all())
    orders = {tuple(ps.epoch_order(e)[0]) for e in range(6)}
    assert len(orders) > 1  # each epoch reshuffles
    b = ps.rows(0, (3 * E - 1) // 5)
    check_batch_invariants(b, bos_id=300, seq_len=5, rows=(3 * E - 1) // 5)


# ------------------------------------------------------------------------------------------------ loader


def test_dp_sharding_union_equals_single_process():
    tok = build_tokenizer(DataConfig())
    single = build_dataloader(cfg_(micro_batch=6), tok, vocab_size=512)
    ranks = [build_dataloader(cfg_(micro_batch=2), tok, dp_rank=r, dp_world=3, vocab_size=512) for r in range(3)]
    seen = []
    for _ in range(4):
        s = next(single)
        parts = [next(rk) for rk in ranks]
        assert torch.equal(torch.cat([p["input_ids"] for p in parts]), s["input_ids"])
        assert torch.equal(torch.cat([p["labels"] for p in parts]), s["labels"])
        cu = torch.cat(
            [parts[0]["cu_seqlens"][:-1]]
            + [p["cu_seqlens"][:-1] + i * 2 * 32 for i, p in enumerate(parts) if i]
            + [s["cu_seqlens"][-1:]]
        )
        assert torch.equal(cu, s["cu_seqlens"])
        for p in parts:
            check_batch_invariants(p, bos_id=tok.bos_id, seq_len=32, rows=2)
        seen.append(s)
    # Consecutive rows (also across global batches) are consecutive stretches of one stream: a row's last label
    # is the next row's first input, or -100 when that input is a BOS.
    inp = torch.cat([s["input_ids"] for s in seen])
    last = torch.cat([s["labels"] for s in seen])[:-1, -1]
    first = inp[1:, 0]
    assert bool(torch.where(last == IGNORE_INDEX, first == tok.bos_id, last == first).all())


def test_exact_resume_mid_stream():
    tok = build_tokenizer(DataConfig())
    a = build_dataloader(cfg_(), tok, vocab_size=512)
    it = iter(a)
    for _ in range(3):
        next(it)
    sd = a.state_dict()
    expect = [next(it) for _ in range(4)]
    b = build_dataloader(cfg_(), tok, vocab_size=512)
    b.load_state_dict(sd)
    for e, got in zip(expect, b):
        for key in e:
            assert torch.equal(e[key], got[key])
    # Same global batch on two ranks: rank 1 resumes on its half of the rows the single process would read next.
    r1 = build_dataloader(cfg_(micro_batch=2), tok, dp_rank=1, dp_world=2, vocab_size=512)
    r1.load_state_dict(sd)
    assert torch.equal(next(r1)["input_ids"], expect[0]["input_ids"][2:])
    with pytest.raises(DataError, match="seq_len"):
        build_dataloader(cfg_(seq_len=64), tok, vocab_size=512).load_state_dict(sd)
    with pytest.raises(DataError, match="multiple"):
        build_dataloader(cfg_(micro_batch=5), tok, vocab_size=512).load_state_dict(sd)


def test_eval_split_deterministic_and_disjoint(cache, monkeypatch):
    tok = build_tokenizer(DataConfig())
    cfg = cfg_(eval_fraction=0.2)
    ev = build_dataloader(cfg, tok, split="eval", vocab_size=512)
    tr = build_dataloader(cfg, tok, split="train", vocab_size=512)
    first = [b["input_ids"] for b in ev]
    second = [b["input_ids"] for b in ev]
    assert len(first) == len(ev) >= 1 and all(torch.equal(x, y) for x, y in zip(first, second))
    ev_ids, tr_ids = set(ev.source.doc_ids.tolist()), set(tr.source.doc_ids.tolist())
    assert ev_ids and tr_ids and not ev_ids & tr_ids and len(ev_ids | tr_ids) == len(ev.source.docs)
    assert 0.05 < len(ev_ids) / len(ev_ids | tr_ids) < 0.5
    # Edge cases of the hash split: both sides non-empty from two documents on; a single document trains.
    ten = docs_from_lists([[i] for i in range(10)])
    assert len(ten.split_ids("eval", 1e-12)) == 1 and len(ten.split_ids("train", 1 - 1e-12)) == 1
    assert len(ten.split_ids("train", 0.0)) == 10
    one = docs_from_lists([[7, 8]])
    assert one.split_ids("train", 0.99).tolist() == [0]
    with pytest.raises(DataError, match="no eval documents"):
        one.split_ids("eval", 0.99)
    # The split is a function of document content: a fresh build (new cache) gives the same eval stream.
    monkeypatch.setenv("K3TRAIN_CACHE", str(cache) + "_other")
    again = build_dataloader(cfg, tok, split="eval", vocab_size=512)
    assert all(torch.equal(x, b["input_ids"]) for x, b in zip(first, again))
    check_batch_invariants(next(iter(ev)), bos_id=tok.bos_id, seq_len=32, rows=4)


def test_builtin_corpus_deterministic_and_cached(cache, monkeypatch):
    tok = build_tokenizer(DataConfig())
    cfg = cfg_()
    files = list_builtin_files(SMALL)
    assert sum(s for _, s in files) <= SMALL and [f for f, _ in files] == sorted(f for f, _ in files)
    d1 = build_builtin_corpus(cfg, tok, progress=False)
    assert len(os.listdir(cache / "tokens")) == 1
    with monkeypatch.context() as m:  # the second build must come from the cache, without tokenizing
        m.setattr(data_files.Tokenize, "__call__", lambda *a: pytest.fail("tokenized again"))
        d2 = build_builtin_corpus(cfg, tok, progress=False)
    monkeypatch.setenv("K3TRAIN_CACHE", str(cache) + "_fresh")
    d3 = build_builtin_corpus(cfg, tok, progress=False)
    for d in (d2, d3):
        assert np.array_equal(d1.tokens, d.tokens) and np.array_equal(d1.offsets, d.offsets)
        assert np.array_equal(d1.doc_hash, d.doc_hash)
    assert d1.tokens.dtype == np.uint16 and 0 < d1.tokens.size <= SMALL and len(d1) >= 5
    with open(os.path.join(stdlib_dir(), files[0][0]), encoding="utf-8") as f:
        assert tok.decode(d1.tokens[d1.offsets[0] : d1.offsets[1]].tolist()) == f.read()


# ------------------------------------------------------------------------------------------------ files


def _texts():
    return ["first document\nwith two lines", "second one: héllo", "third\n\nwith a blank line", "fourth"]


def _decoded(docs, tok):
    return [tok.decode(docs.tokens[docs.offsets[i] : docs.offsets[i + 1]].tolist()) for i in range(len(docs))]


def test_files_text_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = build_tokenizer(DataConfig())
    texts = _texts()
    for i, t in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(t, encoding="utf-8")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts, "n": list(range(4))}), tmp_path / "d.parquet")

    got_text = build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "doc*.txt")]), tok, progress=False)
    assert _decoded(got_text, tok) == texts  # one document per file, blank lines kept
    for name in ("d.jsonl", "d.parquet"):
        c = cfg_(source="files", paths=[str(tmp_path / name)], text_field="body")
        assert _decoded(build_file_corpus(c, tok, progress=False), tok) == texts
    # The loader over files: packed rows obey the invariants and decode to the documents' text.
    c = cfg_(source="files", paths=[str(tmp_path / "d.jsonl")], text_field="body", seq_len=8, eval_fraction=0.0)
    b = next(build_dataloader(c, tok, vocab_size=259))
    check_batch_invariants(b, bos_id=tok.bos_id, seq_len=8, rows=4)
    order, _ = build_dataloader(c, tok, vocab_size=259).source.epoch_order(0)
    stream = [t for i in order for t in [tok.bos_id] + tok.encode(texts[i]) + [tok.eos_id]]
    assert b["input_ids"].reshape(-1).tolist() == stream[:32]


def test_file_errors(tmp_path):
    tok = build_tokenizer(DataConfig())
    with pytest.raises(DataError, match="data.paths"):
        build_file_corpus(cfg_(source="files", paths=[]), tok)
    with pytest.raises(DataError, match="missing.jsonl"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "missing.jsonl")]), tok)
    with pytest.raises(DataError, match="matches no files"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "*.parquet")]), tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty.txt"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "empty.txt")]), tok, progress=False)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(DataError, match="no documents"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "blank.jsonl")]), tok, progress=False)
    (tmp_path / "x.jsonl").write_text(json.dumps({"content": "abc"}) + "\n")
    with pytest.raises(DataError, match=r"'text'.*x\.jsonl"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "x.jsonl")]), tok, progress=False)
    (tmp_path / "data.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="data.format"):
        build_file_corpus(cfg_(source="files", paths=[str(tmp_path / "data.bin")]), tok, progress=False)


def test_vocab_errors(tmp_path):
    tok = build_tokenizer(DataConfig())
    with pytest.raises(DataError, match="exceeds the model vocab_size 200"):
        build_dataloader(cfg_(), tok, vocab_size=200)
    docs = docs_from_lists([[1, 2, 290], [5]])
    fake = SimpleNamespace(vocab_size=259)
    with pytest.raises(DataError, match="290 is outside the model vocabulary"):
        check_vocab(docs.tokens, fake, 280, "test docs")
    check_vocab(docs.tokens, fake, 300, "test docs")  # fits: no error
    with pytest.raises(DataError, match="seq_len"):
        build_dataloader(cfg_(seq_len=0), tok)
    with pytest.raises(DataError, match="data.source"):
        build_dataloader(cfg_(source="web"), tok)


# ------------------------------------------------------------------------------------------------ recall


def test_recall_format_labels_and_reference():
    tok = build_tokenizer(DataConfig())
    cfg = DataConfig(source="recall", seq_len=40, micro_batch=8, recall_pairs=6, recall_queries=4, recall_vocab=20)
    loader = build_dataloader(cfg, tok, vocab_size=512)
    b = next(loader)
    src = loader.source
    sep = int(src.ids[-1])
    assert b["cu_seqlens"].tolist() == list(range(0, 8 * 40 + 1, 40))
    for inp, lab in zip(b["input_ids"].tolist(), b["labels"].tolist()):
        keys, vals = inp[0:12:2], inp[1:12:2]
        assert inp[12] == sep and len(set(keys)) == 6 and max(inp[:21]) < 21 and sep not in inp[:12]
        table = dict(zip(keys, vals))
        qs = inp[13:21:2]
        assert len(set(qs)) == 4 and all(q in table for q in qs)
        assert inp[14:21:2] == [table[q] for q in qs]
        assert [lab[p] for p in range(13, 21, 2)] == [table[q] for q in qs]
        assert sum(x != IGNORE_INDEX for x in lab) == 4
        assert inp[21:] == [tok.pad_id] * 19
    keys, values, qpos = sample_recall(0, "train", np.arange(8), pairs=6, queries=4, vocab=20)
    for r in range(8):
        inp, lab = recall_row_reference(keys[r], values[r], qpos[r], ids=src.ids, pad_id=tok.pad_id, seq_len=40)
        assert inp == b["input_ids"][r].tolist() and lab == b["labels"][r].tolist()
    # Values are spread over the symbol set; examples differ.
    assert len(set(b["input_ids"][:, 1].tolist())) > 2
    # Eval: fixed, re-iterable, different rows from train; train shards and resumes like the packed sources.
    ev = build_dataloader(cfg, tok, split="eval", vocab_size=512)
    e1, e2 = [x["input_ids"] for x in ev], [x["input_ids"] for x in ev]
    assert len(e1) == 256 // 8 and all(torch.equal(x, y) for x, y in zip(e1, e2))
    assert not torch.equal(e1[0], b["input_ids"])
    halves = [
        build_dataloader(DataConfig(**{**cfg.__dict__, "micro_batch": 4}), tok, dp_rank=r, dp_world=2) for r in range(2)
    ]
    assert torch.equal(torch.cat([next(h)["input_ids"] for h in halves]), b["input_ids"])
    sd = loader.state_dict()
    nxt = next(loader)
    fresh = build_dataloader(cfg, tok, vocab_size=512)
    fresh.load_state_dict(sd)
    assert torch.equal(next(fresh)["labels"], nxt["labels"])


def test_recall_errors():
    tok = build_tokenizer(DataConfig())
    with pytest.raises(DataError, match="seq_len is 16"):
        RecallSource(DataConfig(source="recall", seq_len=16), tok, split="train", vocab_size=None)
    low_specials = SimpleNamespace(vocab_size=259, bos_id=0, eos_id=1, pad_id=2)
    with pytest.raises(DataError, match="vocabulary has only 40"):
        RecallSource(DataConfig(source="recall", recall_vocab=64), low_specials, split="train", vocab_size=40)
    src = RecallSource(DataConfig(source="recall", recall_vocab=36), low_specials, split="train", vocab_size=40)
    assert src.ids.tolist() == list(range(3, 40))  # 36 symbols + SEP, skipping the specials
    with pytest.raises(DataError, match="PAD id 258"):
        RecallSource(DataConfig(source="recall", recall_vocab=16), tok, split="train", vocab_size=100)
    with pytest.raises(DataError, match="cannot exceed"):
        RecallSource(DataConfig(source="recall", recall_queries=9), tok, split="train", vocab_size=None)


def test_recall_accuracy():
    labels = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX, 5], [1, IGNORE_INDEX, 2, IGNORE_INDEX]])
    logits = torch.zeros(2, 4, 8)
    logits[0, 1, 3] = 1.0  # right
    logits[0, 3, 4] = 1.0  # wrong
    logits[1, 0, 1] = 1.0  # right
    logits[1, 2, 7] = 1.0  # wrong
    logits[0, 0, 6] = 5.0  # unlabelled: must not count
    assert recall_accuracy(logits, labels) == pytest.approx(0.5)
    logits[1, 2, 2] = 9.0
    assert recall_accuracy(logits, labels) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="no labelled"):
        recall_accuracy(logits, torch.full((2, 4), IGNORE_INDEX))
