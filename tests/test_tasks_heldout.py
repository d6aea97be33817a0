"""The held-out task families (issue 74): their templates occur in no training generator, their genres have no
training split, training configs refuse them, and each item is answerable exactly as it is asked."""

import re

import pytest

from retention.tasks import HELD_OUT_TASKS, TASKS, generate
from retention.tasks.haystack import debian_available, documents
from retention.tasks.image_items import IMAGE_TASKS
from retention.train.config import ConfigError, load_config

QUESTIONED = [t for t in HELD_OUT_TASKS if not t.startswith("fidelity")]
TRAINABLE = [t for t in TASKS if t not in HELD_OUT_TASKS and t not in IMAGE_TASKS and t != "fidelity"]
# RULER's intro, which our in-distribution needles were written after ("Some special magic numbers are hidden within
# the following text. Make sure to memorize them."): the one stretch a held-out family shares with training text
RULER_SHARED = "hidden within the following text. Make sure to memorize"



def _parts(item):
    """The item's own words (context, turns, question, answer prefix), without the chat template's."""
    return [item.context, item.question, item.answer_prefix] + [m["content"] for m in item.messages or []]


def _grams(texts, n=8):
    out = set()
    for text in texts:
        words = text.split()
        out |= {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}
    return out


def test_no_held_out_template_occurs_in_a_training_generator(tok):
    """No run of 8 words of a held-out item (intro, fact sentences, records, turns, question, answer prefix, genre)
    occurs in the items of any generator a training config may name, drawn from the training haystacks."""
    trained = set()
    for task in TRAINABLE:
        # package_records reads only the Debian files (where this machine has them); the others, both haystacks
        sources = ("debian",) * debian_available() if task == "package_records" else ("sotu", "pydoc")
        for source in sources:
            for item in generate(task, tok, 768, 2, seed=5, split="train", source=source):
                trained |= _grams(_parts(item))
    allowed = _grams([RULER_SHARED])
    for task in QUESTIONED:
        shared = set()
        for item in generate(task, tok, 768, 4, seed=5):
            shared |= _grams(_parts(item)) & trained
        if task == "ruler_niah":
            assert shared <= allowed, (task, sorted(shared)[:5])
        else:
            assert not shared, (task, sorted(shared)[:5])


@pytest.mark.parametrize("task", QUESTIONED)
def test_items_ask_what_their_text_states_once(task, tok):
    """The answer is in the conversation as it is asked (case and all), once where the family promises a unique
    key: a reply copied from the text is right, and no other place in the text is a second right answer."""
    for item in generate(task, tok, 1024, 4, seed=7):
        text = "\n".join(_parts(item)[:1] + _parts(item)[3:])
        assert item.question and len(item.answers) == 1
        answer = item.answers[0]
        assert answer in text, (task, answer)
        if task in ("ruler_niah", "span_cloze"):  # a record's value may repeat in another row: its key tells them apart
            assert len(re.findall(rf"(?<![\w-]){re.escape(answer)}(?![\w-])", text)) == 1, (task, answer)
        assert answer not in item.question


def test_items_are_reproducible_and_independent_of_n(tok):
    for task in HELD_OUT_TASKS:
        a = generate(task, tok, 768, 3, seed=2)
        assert [_parts(x) for x in a] == [_parts(x) for x in generate(task, tok, 768, 3, seed=2)]
        assert _parts(a[0]) == _parts(generate(task, tok, 768, 1, seed=2)[0])
        assert _parts(a[0]) != _parts(generate(task, tok, 768, 1, seed=3)[0])
        assert a[0].task == task and a[0].id.startswith(f"{task}-")


def test_prose_facts_states_each_fact_and_asks_one(tok):
    item = generate("prose_facts", tok, 1024, 1, seed=0, facts=4)[0]
    text = item.messages[0]["content"]
    assert len(set(item.meta["facts"])) == 4 and all(f in text for f in item.meta["facts"])
    assert sum(item.answers[0] in f for f in item.meta["facts"]) >= 1
    assert not any(w in text.lower() for w in ("memorize", "remember", "special magic"))  # no warning line
    assert item.messages[-1]["role"] == "assistant"  # the question comes in a later turn of its own


def test_records_cycle_through_three_formats_with_one_record_of_its_kind(tok):
    """Roster, config file and log in turn; the asked record is the one row with a note, the one section with
    max_connections, the one ERROR line, and it holds the answer."""
    items = generate("records", tok, 1024, 6, seed=0)
    assert [i.meta["format"] for i in items] == ["table", "config", "log"] * 2
    for item in items:
        lines = item.messages[0]["content"].splitlines()
        marker = {"table": lambda x: x.startswith("| ") and not x.endswith("| - |") and "|---|" not in x
                  and not x.startswith("| name"),
                  "config": lambda x: x.startswith("max_connections = "),
                  "log": lambda x: " ERROR " in x}[item.meta["format"]]
        (record,) = [x for x in lines if marker(x)]
        assert item.answers[0] in record.split()[-2:] or record.endswith(item.answers[0]), (record, item.answers)


def test_quoting_prefixes_lead_up_to_the_answer_once(tok):
    """late_recall and span_cloze replies start with the words before the answer in the text (RULER's answer
    prefixes do the same): those words occur once in the document, followed by the answer."""
    for task, quote in (("late_recall", 'You said: "'), ("span_cloze", 'The article says: "')):
        for item in generate(task, tok, 1024, 4, seed=3):
            lead = item.answer_prefix.removeprefix(quote)
            assert item.answer_prefix.startswith(quote) and lead
            text = item.messages[0]["content"]
            assert text.count(lead) == 1 and f"{lead} {item.answers[0]}" in text, (task, lead, item.answers)
            assert lead not in item.question


def test_late_recall_states_the_detail_first_and_asks_it_last(tok):
    item = generate("late_recall", tok, 2048, 1, seed=1)[0]
    assert item.meta["said"] in item.messages[0]["content"]
    assert not any(item.meta["said"] in m["content"] for m in item.messages[1:])
    assert len(item.messages) >= 8


def test_ruler_niah_keys_and_values(tok):
    uuids = generate("ruler_niah", tok, 1024, 2, seed=0, keys=6, value_type="uuids")
    for item in uuids:
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", item.answers[0])
        assert item.context.count("One of the special magic uuids for ") == 6
    with pytest.raises(ValueError, match="value_type must be one of"):
        generate("ruler_niah", tok, 1024, 1, value_type="words")
    with pytest.raises(ValueError, match="keys must be a whole number"):
        generate("ruler_niah", tok, 1024, 1, keys=0)


def test_held_out_genres_have_no_training_split():
    for genre in ("news", "wiki"):
        assert len(documents("eval", genre)) > 50
        with pytest.raises(ValueError, match="held-out genre: it has no training split"):
            documents("train", genre)
    assert not {d.text for d in documents("eval", "news")} & {d.text for d in documents("eval", "sotu")}


def test_wiki_markup_is_stripped():
    text = " ".join(d.text for d in documents("eval", "wiki")[:20])
    for markup in ("{{", "}}", "[[", "]]", "<ref", "'''", "{|"):
        assert markup not in text, markup


@pytest.mark.parametrize("task", HELD_OUT_TASKS)
def test_training_configs_refuse_held_out_families(task, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("budget:\n  tokens_per_head: 8\ndata:\n  seq_len: 1024\n  sources:\n"
                 f"    - {{kind: synthetic, path: {task}, max_docs: 2, length: 512}}\n")
    with pytest.raises(ConfigError, match=rf"data.sources.0.path = '{task}' \(.*line 6\): a held-out task family"):
        load_config(p)


@pytest.mark.parametrize("haystack", ["news", "wiki", "poems"])
def test_training_configs_refuse_held_out_or_unknown_haystacks(haystack, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("budget:\n  tokens_per_head: 8\ndata:\n  seq_len: 1024\n  sources:\n"
                 f"    - {{kind: synthetic, path: varied_facts, max_docs: 2, length: 512, haystack: {haystack}}}\n")
    why = "a held-out genre" if haystack != "poems" else "not a haystack"
    with pytest.raises(ConfigError, match=rf"data.sources.0.haystack = '{haystack}' \(.*line 6\): {why}"):
        load_config(p)


def test_a_synthetic_source_builds_its_items_in_the_haystack_it_names(tok, tmp_path):
    """Two fidelity sources of the mixture recipe, one per genre: the items are built from that genre's text."""
    from retention.tasks.haystack import sentences
    from retention.train.data import synthetic_items
    from retention.train.schema import SourceConfig

    for genre in ("sotu", "pydoc"):
        src = SourceConfig(kind="synthetic", path="fidelity", max_docs=1, length=256, seed=4, haystack=genre)
        (item,) = synthetic_items(src, tok, 512)
        first = item.context.split(". ")[0]
        assert any(first in s for s in sentences("train", genre)), (genre, first)
    with pytest.raises(ConfigError, match="length, params and haystack apply to kind: synthetic only"):
        p = tmp_path / "c.yaml"
        p.write_text("budget:\n  tokens_per_head: 8\ndata:\n  sources:\n"
                     "    - {kind: text, path: sotu, haystack: pydoc}\n")
        load_config(p)


def test_varied_facts_states_its_facts_in_many_frames_and_asks_one(tok):
    """The training fact source: 1-4 facts in many frames, in contexts and dialogues; the asked one is stated."""
    items = generate("varied_facts", tok, 768, 12, seed=1, split="train")
    assert {bool(i.messages) for i in items} == {True, False}  # both shapes
    assert len({len(i.meta["facts"]) for i in items}) > 1
    frames = set()
    for item in items:
        text = item.context or item.messages[0]["content"]
        assert all(f in text for f in item.meta["facts"])
        assert sum(item.answers[0] in f for f in item.meta["facts"]) >= 1
        frames |= {f.split()[0] for f in item.meta["facts"]}
    assert len(frames) >= 6  # many sentence frames, not one template
    with pytest.raises(ValueError, match="facts must be a whole number from 0 to 4"):
        generate("varied_facts", tok, 768, 1, facts=5)


@pytest.mark.skipif(not debian_available(), reason="no Debian changelog / copyright files under /usr/share/doc")
def test_package_records_ask_one_record_of_real_debian_files_by_its_own_key(tok):
    """The training records source: whole changelog entries and copyright stanzas under their file paths, in both
    shapes; the asked record is in the text, its key is nowhere else, and the answer is one of its fields."""
    items = generate("package_records", tok, 1024, 12, seed=2, split="train")
    assert {bool(i.messages) for i in items} == {True, False}
    assert {i.meta["field"] for i in items} >= {"signer", "day", "license"}
    for item in items:
        text = item.context or item.messages[0]["content"]
        record = item.meta["record"]
        assert text.count(record) == 1 and item.answers[0] in record
        assert f"==> {item.meta['file']} <==" in text
        first = record.splitlines()[0]
        if item.meta["field"] == "license":  # asked by the stanza's file pattern
            assert first.removeprefix("Files:").strip() in item.question
        else:  # "<package> (<version>)": the entry's own header, once in the text, asked as "<package> <version>"
            package, version = first.split(")")[0].split(" (")
            assert text.count(f"{package} ({version})") == 1 and f"{package} {version}" in item.question
    assert {i.meta["file"].split("/")[-1] for i in items} == {"changelog.Debian", "copyright"}
    train = {d.title.split("/")[0] for d in documents("train", "debian")}
    assert train and not train & {d.title.split("/")[0] for d in documents("eval", "debian")}
    with pytest.raises(ValueError, match="its haystack is debian"):
        generate("package_records", tok, 1024, 1, source="sotu")


def test_the_committed_held_out_item_list_is_what_the_generators_draw(tok):
    """experiments/generalization/items/heldout-4096-seed0.jsonl (the held-out set the rule scores once per
    candidate) equals what the generators draw now: a generator changed after the list was committed fails here,
    before any score is compared across the change. Rewrite with ``python experiments/generalization/items.py``."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "experiments" / "generalization" / "items.py"
    spec = importlib.util.spec_from_file_location("heldout_items", script)
    items = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(items)
    committed = [json.loads(line) for line in items.path(0).read_text().splitlines()]
    assert len(committed) == 10 * len(items.KEPT)
    assert items.rows(tok, 0) == committed


def test_the_candidates_study_scores_the_general_configs_items_into_its_output():
    """experiments/generalization/candidates.yaml shares eval/configs/smollm2-general.yaml's rows (its full-cache and
    shipped-gate rows are scored once for both), so everything a row's key and settings depend on must agree."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    general = yaml.safe_load((root / "eval" / "configs" / "smollm2-general.yaml").read_text())
    study = yaml.safe_load((root / "experiments" / "generalization" / "candidates.yaml").read_text())
    assert study["tasks"][:len(HELD_OUT_TASKS)] == list(HELD_OUT_TASKS)  # held-out first: scored first
    shared = ("model", "gates", "output", "tasks", "lengths", "budgets", "items", "seed", "protocol", "prefill",
              "max_new_tokens")
    assert {k: study.get(k) for k in shared} == {k: general.get(k) for k in shared}
    labels = {m.get("label", m["name"]): m for m in general["methods"]}
    for m in study["methods"]:  # a label both name is the same method, or one would move the other's rows aside
        label = m.get("label", m["name"])
        assert label not in labels or labels[label] == m
