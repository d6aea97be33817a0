"""The sweep on multimodal dialogues (MMDU's format) with a tiny random Qwen3-VL and photos that ship in packages:
the full cache answers as one prompt over the whole dialogue does, budgets keep to their size with text and image
entries counted, and bad input fails before the model loads."""

import warnings

import pytest
import torch

from retention.eval.config import EvalConfigError, load_eval_config
from retention.eval.loaders import load_mmdu
from retention.eval.method_specs import make_method
from retention.eval.multimodal import kept_image_entries, run_chat_item_budgets
from retention.eval.budgets import parse_budget
from retention.eval.runner import read_results, run_sweep
from tiny_vl import mmdu_benchmark as _benchmark, tiny_qwen3_vl_for, tiny_qwen3_vl_processor, vl_dialogue_rows_on


@pytest.fixture(scope="module")
def vl():
    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc).eval()
    from retention import attach_gates

    attach_gates(model, None, mode="score")  # untrained gates: the plumbing is what is tested
    return model, proc


def test_the_full_cache_answers_as_one_prompt_over_the_whole_dialogue(vl, tmp_path):
    """Turns fed one by one (each turn's photo, its text, the reference reply), then the question: the reply equals
    plain generate over the whole dialogue rendered by the processor in one prompt with both photos."""
    from PIL import Image

    model, proc = vl
    item = load_mmdu(_benchmark(tmp_path), limit=1, max_new_tokens=6)[0]  # MMDU's own: 512
    rows = run_chat_item_budgets(model, proc, item, make_method({"name": "full"}), [None], max_new_tokens=6)
    pictures = [Image.open(tmp_path / p).convert("RGB") for p in item.meta["images"]]
    messages = []
    for k, m in enumerate(item.messages):
        if m["role"] == "user":
            shown = [{"type": "image"}] if k in (0, 2) else []
            messages.append({"role": "user", "content": shown + [{"type": "text", "text": m["content"]}]})
        else:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": m["content"]}]})
    messages.append({"role": "user", "content": [{"type": "text", "text": item.question}]})
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    x = proc(text=[text], images=pictures, return_tensors="pt")
    with torch.no_grad(), model.retention.use_mode("teacher"):
        out = model.generate(**x, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = proc.tokenizer.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)
    (row,) = rows
    assert row["reply"] == want
    L, H = model.config.text_config.num_hidden_layers, model.config.text_config.num_key_value_heads
    ends = (x["input_ids"][0] == proc.tokenizer.convert_tokens_to_ids("<|im_end|>")).nonzero().flatten()
    context = int(ends[3]) + 1  # the history: four turns, through the last reply's stop token
    assert row["context_tokens"] == context
    images = int((x["input_ids"][0, :context] == model.config.image_token_id).sum())
    assert row["image_tokens"] == images > 0
    assert row["kept_image_entries"] == images * L * H  # nothing evicted: every image entry kept
    assert row["kept_entries"] == (context - 1) * L * H  # the context's last token goes with the question


def test_budgets_keep_to_their_size_and_count_the_image_entries_they_keep(vl, tmp_path):
    """Each budget compresses its own copy of one prefill: the same rows as separate runs, kept entries within the
    budget, and the image entries kept are those a count over every kept entry's token finds."""
    model, proc = vl
    item = load_mmdu(_benchmark(tmp_path), limit=1, max_new_tokens=4)[0]
    method = make_method({"name": "global_gates"})
    streams = model.config.text_config.num_hidden_layers * model.config.text_config.num_key_value_heads
    budgets = [parse_budget(0.25), parse_budget(0.5)]
    together = run_chat_item_budgets(model, proc, item, method, budgets, max_new_tokens=4)
    alone = [None, run_chat_item_budgets(model, proc, item, method, budgets[1:], max_new_tokens=4)[0]]
    assert together[1] == alone[1]  # the second budget's copy of the prefill: as if it had run alone
    for a in together:
        assert 0 < a["kept_entries"] <= a["budget_entries"]
        assert 0 <= a["kept_image_entries"] <= min(a["image_tokens"] * streams, a["kept_entries"])
    assert together[0]["kept_entries"] < together[1]["kept_entries"]

    streamed = run_chat_item_budgets(model, proc, item, method, [parse_budget({"tokens": 8})], prefill_mode="streaming",
                                     chunk=8, max_new_tokens=4)[0]
    assert streamed["kept_entries"] <= streamed["budget_entries"] == 8 * streams

    class Cache:  # the counter against brute force over a fake store of two layers
        class store:
            num_layers = 2

            @staticmethod
            def gather_layer(layer):
                from types import SimpleNamespace

                pos = torch.tensor([[[0, 1, 2, 3], [4, 5, 0, 0]]]) + layer
                return SimpleNamespace(pos=pos, valid=torch.tensor([[[1, 1, 1, 0], [1, 1, 0, 0]]], dtype=torch.bool))

    ids = torch.tensor([[7, 9, 9, 7, 9, 7, 7]])
    want = sum(int(ids[0, p] == 9) for layer in range(2)
               for p, v in zip(Cache.store.gather_layer(layer).pos.flatten().tolist(),
                               Cache.store.gather_layer(layer).valid.flatten().tolist()) if v)
    assert kept_image_entries(Cache, ids, 9) == want == 5


def test_a_sweep_over_mmdu_writes_rows_and_resumes(vl, tmp_path):
    model, proc = vl
    data = _benchmark(tmp_path)
    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"), model="tiny-qwen3-vl",
                           tasks=[{"name": "mmdu", "params": {"data_files": str(data), "max_new_tokens": 4}}],
                           lengths=[1024, 2048], items=2,
                           methods=[{"name": "full"}, {"name": "global_gates"}, {"name": "streamingllm"},
                                    {"name": "snapkv"}], budgets=[0.25], max_new_tokens=4)
    path = run_sweep(cfg, (model, proc), progress=False)
    rows = read_results(path)
    assert len(rows) == 2 * 4  # two dialogues, run once (the first length), four methods
    assert {r["length"] for r in rows} == {1024} and {r["task"] for r in rows} == {"mmdu"}
    full = {r["item"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        assert (r["metric"] == "rouge_l" and 0 <= r["score"] <= 100
                and r["image_tokens"] == full[r["item"]]["image_tokens"])
        if r["method"] != "full":
            assert (r["kept_entries"] <= r["budget_entries"]
                    and r["kept_image_entries"] < full[r["item"]]["kept_image_entries"])
    assert run_sweep(cfg, (model, proc), progress=False) == path and len(read_results(path)) == len(rows)
    from retention.eval.report import markdown_table

    table = markdown_table(rows).splitlines()
    assert "| image share |" in table[0]
    share = {line.split(" | ")[2]: line.split(" | ")[7] for line in table[2:]}  # method -> image share
    want = sum(r["kept_image_entries"] / r["kept_entries"] for r in full.values()) / len(full)
    assert share["full"] == f"{want:.0%}" and "| image share |" not in markdown_table(
        [{k: v for k, v in r.items() if k != "kept_image_entries"} for r in rows]).splitlines()[0]


def test_mmdu_inputs_that_cannot_run_fail_before_the_model_loads(tmp_path, monkeypatch):
    import retention.eval.models

    data = _benchmark(tmp_path)
    (tmp_path / "second.png").unlink()
    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"),
                           tasks=[{"name": "mmdu", "params": {"data_files": str(data)}}], methods=[{"name": "full"}])
    from retention.eval.loaders import DatasetUnavailableError

    with pytest.raises(DatasetUnavailableError, match="image .*second.png not found.*image_root"):
        run_sweep(cfg, progress=False)
    with pytest.raises(EvalConfigError, match="streaming prefill.*tokens: N"):
        load_eval_config("tiny.yaml", tasks=["mmdu"], prefill="streaming", budgets=[0.1])
    with pytest.raises(EvalConfigError, match="query-agnostic only"):
        load_eval_config("tiny.yaml", tasks=["mmdu"], protocol="query_aware")


@pytest.mark.parametrize("model, task", [("tiny-llama-random", "mmdu"), ("smollm2-135m", "mmdu"), ("given", "mmdu"),
                                         ("smollm2-135m", "image_memory")])
def test_a_text_only_model_is_refused_before_it_loads(tmp_path, monkeypatch, model, task):
    """Read from the model's config (the embedded model's, a tiny one's name, or the model given), not its weights."""
    import retention.eval.models
    from retention.eval.models import load_eval_model

    data = _benchmark(tmp_path)
    given = load_eval_model("tiny-llama-random") if model == "given" else None
    monkeypatch.setattr(retention.eval.models, "load_eval_model", lambda *a, **k: pytest.fail("loaded the model first"))
    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"), model="tiny-llama-random" if given else model,
                           tasks=[{"name": "mmdu", "params": {"data_files": str(data)}} if task == "mmdu" else task],
                           methods=[{"name": "full"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(EvalConfigError, match=f"text-only model.*{task}.*vision-language"):
            run_sweep(cfg, given, progress=False)
    assert read_results(tmp_path / "sweep" / "results.jsonl") == []


def test_image_memory_items_are_reproducible_and_their_photos_differ(tmp_path, monkeypatch):
    """Generated from the seed: the same items (and photo files, by name and bytes) in a fresh cache folder; each photo
    of an item carries another number, the answer is one of them, and the text before the question fits ``length``."""
    from retention.eval.models import tiny_tokenizer
    from retention.tasks import generate
    from retention.tasks.base import count_tokens, render_chat

    tok = tiny_tokenizer()
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "a"))
    items = generate("image_memory", tok, 400, 3, seed=1, images=3, size=224)
    folder = tmp_path / "a" / "eval-images"
    first = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "b"))
    again = generate("image_memory", tok, 400, 3, seed=1, images=3, size=224)
    assert again == [type(it)(**{**it.__dict__, "meta": {**it.meta, "image_root": str(tmp_path / "b" / "eval-images")}})
                     for it in items]
    assert {p.name: p.read_bytes() for p in (tmp_path / "b" / "eval-images").iterdir()} == first
    for it in items:
        assert len(set(it.meta["images"])) == 3 and [m["content"].startswith(f"<image {k}>") for k, m in
                                                      zip((1, 2, 3), it.messages[0:6:2])] == [True] * 3
        assert it.answers[0].isdigit() and len(it.answers[0]) == 4
        assert count_tokens(tok, render_chat(tok, it.messages)) <= 400
    assert len({it.answers[0] for it in items}) == 3  # items differ
    train = generate("image_memory", tok, 400, 1, seed=1, split="train", images=3, size=224)[0]
    assert train.messages[6:] != items[0].messages[6:]  # the training split talks about other passages
    with pytest.raises(ValueError, match="images must be 1 to 8"):
        generate("image_memory", tok, 400, 1, images=0)


def test_image_memory_runs_through_the_sweep(vl, tmp_path, monkeypatch):
    model, proc = vl
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    cfg = load_eval_config("tiny.yaml", output=str(tmp_path / "sweep"), model="tiny-qwen3-vl",
                           tasks=[{"name": "image_memory", "params": {"images": 2, "size": 112}}], lengths=[256],
                           items=1, methods=[{"name": "full"}, {"name": "global_gates"}], budgets=[0.3])
    rows = {r["method"]: r for r in read_results(run_sweep(cfg, (model, proc), progress=False))}
    full, gated = rows["full"], rows["global_gates"]
    streams = model.config.text_config.num_hidden_layers * model.config.text_config.num_key_value_heads
    assert full["image_tokens"] > 0 and full["kept_image_entries"] == full["image_tokens"] * streams
    assert gated["kept_entries"] <= gated["budget_entries"] and full["metric"] == "recall"
    assert 0 < full["image_tokens"] < full["context_tokens"]


def test_methods_that_share_one_fed_history_score_as_if_each_fed_its_own(vl, tmp_path):
    """The sweep feeds a dialogue's history once for the full cache and every policy that reads no queries: each
    then scores as it does from a history of its own (same kept entries, image entries and reply). A policy that reads
    the queries as they are fed (SnapKV) feeds its own."""
    from retention.eval.multimodal import shared_history, shares_history

    model, proc = vl
    item = load_mmdu(_benchmark(tmp_path), limit=1, max_new_tokens=4)[0]
    history = shared_history(model, proc, item, chunk=512)
    budgets = [parse_budget(0.2), parse_budget(0.5)]
    for spec in ({"name": "full"}, {"name": "global_gates"}, {"name": "streamingllm"}):
        method = make_method(spec)
        assert shares_history(method, "one_shot") and not shares_history(method, "streaming")
        uses = budgets if method.uses_budget else [None]
        shared = run_chat_item_budgets(model, proc, item, method, uses, history=history)
        own = run_chat_item_budgets(model, proc, item, method, uses)
        assert shared == own, spec["name"]
    snapkv = make_method({"name": "snapkv"})
    assert not shares_history(snapkv, "one_shot")
    with pytest.raises(ValueError, match="cannot start from a shared history"):
        run_chat_item_budgets(model, proc, item, snapkv, budgets, history=history)


def test_the_dialogue_helper_the_gpu_test_shares(tmp_path):
    """tests/test_gpu_kernels.py runs this helper on CUDA: the full cache keeps every entry of the dialogue's history,
    the budgeted policy a quarter of them, with the same image tokens in the context."""
    full, gated = vl_dialogue_rows_on("cpu", tmp_path)
    assert full["device"] == gated["device"] == "cpu" and full["image_tokens"] == gated["image_tokens"] > 0
    assert gated["kept_entries"] <= gated["budget_entries"] < full["kept_entries"]
    assert isinstance(full["reply"], str) and isinstance(gated["reply"], str)


def test_a_dialogue_past_the_models_positions_is_said_per_item_and_marked(vl, tmp_path, monkeypatch):
    """A dialogue longer than the model's positions: one warning naming the item (not the chat's, which points a chat
    user to /reset), and its rows marked past_positions; within the positions, no mark."""
    model, proc = vl
    item = load_mmdu(_benchmark(tmp_path), limit=1, max_new_tokens=3)[0]
    budgets = [parse_budget(0.25), parse_budget(0.5)]
    method = make_method({"name": "global_gates"})
    rows = run_chat_item_budgets(model, proc, item, method, budgets, max_new_tokens=3)
    assert not any("past_positions" in r for r in rows)
    limit = rows[0]["context_tokens"] // 2
    monkeypatch.setattr(model.config.text_config, "max_position_embeddings", limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = run_chat_item_budgets(model, proc, item, method, budgets, max_new_tokens=3)
    said = [str(w.message) for w in caught if "positions" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"{item.id}: ") and f"past the model's {limit:,} positions" in said[0]
    assert all(r["past_positions"] is True for r in rows) and len(rows) == 2


def test_image_memory_photo_pool_is_fixed_and_photos_option_replaces_it(tmp_path, monkeypatch):
    """The default pool is matplotlib's two photos whatever else is installed (a package that happens to be present
    once changed every item's images); ``photos`` lists the files to crop instead, checked before any item."""
    import sys
    import types

    from retention.eval.models import tiny_tokenizer
    from retention.tasks import generate
    from retention.tasks.image_memory import photo_sources

    tok = tiny_tokenizer()
    monkeypatch.setenv("RETENTION_CACHE", str(tmp_path / "cache"))
    assert [p.name for p in photo_sources()] == ["grace_hopper.jpg", "Minduka_Present_Blue_Pack.png"]
    before = generate("image_memory", tok, 300, 2, seed=3, images=2, size=64)
    fake = tmp_path / "skimage"
    (fake / "data").mkdir(parents=True)
    for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg"):
        (fake / "data" / name).write_bytes(b"")
    monkeypatch.setitem(sys.modules, "skimage", types.SimpleNamespace(__file__=str(fake / "__init__.py")))
    assert generate("image_memory", tok, 300, 2, seed=3, images=2, size=64) == before

    # one file named as one of matplotlib's but showing something else: its crops get other names
    from PIL import Image

    other = tmp_path / "mine" / "grace_hopper.jpg"
    other.parent.mkdir()
    Image.new("RGB", (80, 60), (10, 200, 30)).save(other)
    mine = generate("image_memory", tok, 300, 2, seed=3, images=2, size=64, photos=[str(other)])
    assert [it.answers for it in mine] == [it.answers for it in before]
    assert not set(mine[0].meta["images"]) & {n for it in before for n in it.meta["images"]}
    with pytest.raises(ValueError, match="do not exist: .*nope.png"):
        generate("image_memory", tok, 300, 1, photos=[str(tmp_path / "nope.png")])
    with pytest.raises(ValueError, match="non-empty list"):
        generate("image_memory", tok, 300, 1, photos=str(other))
