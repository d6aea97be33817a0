"""RetentionChat with a tiny random Qwen3-VL: a three-turn chat with real photos, offline."""

import pytest

from retention.chat import RetentionChat
from tiny_vl import photos, tiny_qwen3_vl_for, tiny_qwen3_vl_processor, vl_chat_on


def test_three_turn_chat_with_images_stays_within_budget():
    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    with pytest.warns(UserWarning, match="untrained"):
        chat = RetentionChat(model, proc, budget_tokens=48, max_new_tokens=5)
    streams = 3 * 2
    budget = 48 * streams
    imgs = photos(2)
    seen = []
    for text, images in (("What is this?", [imgs[0]]), ("And this one?", [imgs[1]]), ("Compare them.", None)):
        reply = chat.send(text, images=images)
        assert isinstance(reply, str) and reply
        mem = chat.memory()
        seen.append(mem["tokens_seen"])
        assert mem["kept_entries"] <= budget + chat.cache.slack + 256 * streams
    # each image adds 16 merged vision tokens (112 x 112 pixels) on top of the text
    assert seen[0] > 16 and seen[1] - seen[0] > 16 and seen == sorted(seen)
    last = chat.memory()
    assert last["tokens_seen"] * streams > budget + chat.cache.slack
    assert last["kept_entries"] < last["full_cache_entries"]


def test_a_vl_chat_keeps_its_ids_and_cache_in_step():
    """Two turns (a photo, then text): the cache holds every id but the last reply's last token (fed with the next
    turn), on the model's device (the same helper runs on a GPU in tests/test_gpu_kernels.py)."""
    out = vl_chat_on("cpu")
    assert out["cache_length"] == out["ids"].shape[1] - 1 and out["device"] == out["model_device"] == "cpu"


def _chat_and_reference(plan: list, **chat_kwargs):
    """Run ``plan`` (text, images, and a reply to add with add_turn() rather than generate) through a RetentionChat on
    a tiny Qwen3-VL; return the chat, the number of cached tokens ``n`` and the DynamicCache of one forward over the
    conversation's first ``n`` ids with all its images."""
    import warnings

    import torch
    from transformers import DynamicCache

    from retention.compat import cache_kwargs

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        chat = RetentionChat(model, proc, **chat_kwargs)
    for text, images, *given in plan:
        if given:
            chat.add_turn(text, given[0], images=images)
        else:
            chat.send(text, images=images)
    n = chat.cache.get_seq_length()
    ids = chat.ids[:, :n]
    pixels = proc.image_processor(images=[im for _, images, *_ in plan for im in images or []], return_tensors="pt")
    chat.model.retention.detach()
    reference = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
              image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == model.config.image_token_id).int(),
              **cache_kwargs(reference), use_cache=True)
    return chat, n, reference


@pytest.mark.parametrize("turns", ["image, text, image", "image, image", "given image, given text, image"])
def test_the_cache_holds_what_one_forward_over_the_whole_conversation_computes(turns):
    """Every turn fed incrementally (images with their M-RoPE positions continued from the cache) leaves the same keys
    as one forward over the whole conversation with all its images. An image turn after the first one had its tokens'
    positions one token off (the last reply's last token, fed with the turn, was not counted)."""
    import torch

    imgs = photos(2)
    plan = {"image, text, image": [("What is this?", [imgs[0]]), ("Say more.", None), ("And this one?", [imgs[1]])],
            "image, image": [("What is this?", [imgs[0]]), ("And this one?", [imgs[1]])],
            "given image, given text, image": [("What is this?", [imgs[0]], "A photo."),
                                               ("Say more.", None, "It is red."),
                                               ("And this one?", [imgs[1]])]}[turns]
    chat, n, reference = _chat_and_reference(plan, budget_tokens=None, max_new_tokens=4, min_new_tokens=4)
    for layer in range(len(reference.layers)):
        want = reference.layers[layer].keys[0]  # (H, n, D)
        got = chat.cache.store.gather_layer(layer).keys.reshape(want.shape[0], -1, want.shape[-1])[:, :n]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_under_a_budget_every_kept_entry_sits_at_its_true_position():
    """Five turns (three photos) under a budget small enough to evict during image turns: each kept entry of layer 0
    (whose keys depend on the token and its position only) equals the key one forward over the whole conversation
    computes at the position the cache recorded for it."""
    import torch

    imgs = photos(3)
    plan = [("What is this?", [imgs[0]]), ("Say more about its colours.", None), ("And this one?", [imgs[1]]),
            ("Both?", [imgs[2]]), ("ok", None)]
    chat, n, reference = _chat_and_reference(plan, budget_tokens=16, max_new_tokens=6, min_new_tokens=6, chunk_size=8)
    assert chat.cache.evictions >= 3
    want = reference.layers[0].keys[0]  # (H, n, D)
    view = chat.cache.store.gather_layer(0)
    kept = 0
    for h in range(want.shape[0]):
        valid = view.valid[0, h]
        pos = view.pos[0, h][valid]
        kept += len(pos)
        torch.testing.assert_close(view.keys[0, h][valid], want[h, pos], atol=1e-4, rtol=1e-4)
    assert 0 < kept < n * want.shape[0]  # some entries were evicted, some kept

def test_a_saved_conversation_with_photos_resumes_with_its_images(tmp_path, monkeypatch, capsys):
    """The transcript keeps each image turn's pixels: resumed in a new chat, the cache holds the same keys (images at
    their M-RoPE positions) and the next reply is the original chat's; saving the resumed chat keeps the images.
    `retention chat --resume` refuses it for a text-only model before that model loads."""
    import json
    import warnings

    import torch

    import retention.models
    from retention.cli import main

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        live = RetentionChat(model, proc, budget_tokens=None, max_new_tokens=4, min_new_tokens=4)
        again = RetentionChat(model, proc, budget_tokens=None, max_new_tokens=4, min_new_tokens=4, chunk_size=8)
    imgs = photos(2)
    for text, images in (("What is this?", [imgs[0]]), ("Say more.", None), ("And this one?", [imgs[1]])):
        live.send(text, images=images)
    path = live.save(tmp_path / "chat.json")
    again.resume(path)
    assert torch.equal(again.ids, live.ids)
    for layer in range(model.config.text_config.num_hidden_layers):
        torch.testing.assert_close(again.cache.store.gather_layer(layer).keys,
                                   live.cache.store.gather_layer(layer).keys, atol=1e-4, rtol=1e-4)
    assert again.send("Which one is brighter?") == live.send("Which one is brighter?")
    saved = json.loads(again.save(tmp_path / "again.json").read_text())
    assert ([t["images"] for t in saved["image_turns"]]
            == [t["images"] for t in json.loads(path.read_text())["image_turns"]])
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["chat", "--resume", str(path)]) == 2  # the embedded model by default: text only
    assert "smollm2-135m is a text-only model" in capsys.readouterr().err


def test_a_turns_images_are_read_once_and_saved_as_shown(tmp_path):
    """save() read image files again, so a file changed after its turn was saved with pixels the model never saw (and
    a deleted one made the chat unsavable); a transparent image was laid on white live but on black when saved; a
    Path, a bare image and a bad entry were raw library errors."""
    import warnings

    import numpy as np
    from PIL import Image

    from retention.chat import ChatInputError
    from retention.images import as_rgb

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    shown = photos(1)[0]
    clear = np.array(shown.convert("RGBA"))
    clear[..., 3] = 60  # mostly transparent: white shows through as the processor composites it
    clear = Image.fromarray(clear)
    path = tmp_path / "a.png"
    shown.save(path)

    def chat():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
            return RetentionChat(model, proc, budget_tokens=None, max_new_tokens=3, min_new_tokens=3)

    live, ref = chat(), chat()
    live.send("Look.", images=path)  # a bare Path, not in a list
    live.send("And this?", images=[clear])
    ref.send("Look.", images=[shown])
    ref.send("And this?", images=[as_rgb(clear)])
    Image.new("RGB", shown.size, (0, 200, 30)).save(path)  # the file changes after its turn...
    saved = live.save(tmp_path / "chat.json")
    path.unlink()  # ...then goes: the conversation still saves
    live.save(tmp_path / "again.json")
    resumed = chat()
    resumed.resume(saved)
    assert resumed.send("Well?") == ref.send("Well?")
    assert np.array_equal(np.array(resumed._image_turns[1]["images"][0]), np.array(as_rgb(clear)))
    assert np.array(as_rgb(clear)).mean() > np.array(clear.convert("RGB")).mean() + 50  # white, not black, beneath
    for bad, words in (([tmp_path / "nowhere.png"], "image 0 .*nowhere.png. cannot be read as an image"),
                       ([str(tmp_path / "chat.json")], "cannot be read as an image"),
                       ([None], "image 0 is a NoneType"), ([np.zeros((8, 8, 3), "uint8")], "is a ndarray"),
                       (5, "images must be a list")):
        with pytest.raises(ChatInputError, match=words):
            live.send("x", images=bad)


def test_the_memory_report_counts_the_image_entries_kept():
    """A vision-language chat's memory report says how many image entries it keeps: all of them without a budget,
    fewer under one (images compete with text), as a count over every kept entry's token finds."""
    import warnings

    from retention.chat_cli import _memory_line

    imgs = photos(2)
    plan = [("What is this?", [imgs[0]]), ("Say more.", None), ("And this one?", [imgs[1]])]
    for budget in (None, 16):
        proc = tiny_qwen3_vl_processor()
        model = tiny_qwen3_vl_for(proc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            chat = RetentionChat(model, proc, budget_tokens=budget, max_new_tokens=3, chunk_size=8)
        for text, images in plan:
            chat.send(text, images=images)
        report = chat.memory()
        image = chat.ids[0] == model.config.image_token_id
        streams = 3 * 2
        want = 0
        for layer in range(3):
            view = chat.cache.store.gather_layer(layer)
            want += sum(int(image[p]) for p in view.pos[0][view.valid[0]].tolist())
        assert report["image_tokens"] == int(image.sum()) > 0 and report["kept_image_entries"] == want
        if budget is None:
            assert want == report["image_tokens"] * streams
        else:
            assert 0 <= want < report["image_tokens"] * streams
        assert report["kept_text_entries"] + want == report["kept_entries"]
        assert "image entries:" in str(report)
        assert (f"kept: {report['kept_entries'] - want:,} text + {want:,} image entries of "
                f"{report['full_cache_entries']:,};" in _memory_line(report))


def test_two_chats_on_one_model_keep_their_own_image_positions():
    """The model holds one M-RoPE offset (rope_deltas): two chats on it, their turns interleaved, used to place each
    other's text after the wrong images. Each now keeps its own: the same replies as each chat alone."""
    import warnings

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    imgs = photos(2)
    plans = {"a": [("What is this?", [imgs[0]]), ("Say more.", None), ("And this one?", [imgs[1]]), ("Which?", None)],
             "b": [("Look.", [imgs[1]]), ("And this?", [imgs[0]]), ("Go on.", None), ("Done?", None)]}

    def chat():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
            return RetentionChat(model, proc, budget_tokens=None, max_new_tokens=4, min_new_tokens=4)

    alone = {}
    for name, plan in plans.items():
        c = chat()
        alone[name] = [c.send(text, images=images) for text, images in plan]
    together = {name: chat() for name in plans}
    replies = {name: [] for name in plans}
    for turns in zip(plans["a"], plans["b"]):
        for name, (text, images) in zip(plans, turns):
            replies[name].append(together[name].send(text, images=images))
    assert replies == alone


def test_a_failed_turn_with_a_photo_leaves_no_entries_behind():
    """A turn with a photo that fails after its images are prefilled: the next turn warns, feeds the conversation
    (its earlier photo at its M-RoPE positions) again, and replies as a chat that never had the failed turn does."""
    import warnings

    import torch
    from transformers import StoppingCriteria

    class Fails(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            raise RuntimeError("failed on the first token")

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    imgs = photos(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        live, clean = (RetentionChat(model, proc, budget_tokens=None, max_new_tokens=4, min_new_tokens=4)
                       for _ in range(2))
    assert live.send("What is this?", images=[imgs[0]]) == clean.send("What is this?", images=[imgs[0]])
    with pytest.raises(RuntimeError, match="first token"):
        live.send("And this one?", images=[imgs[1]], stopping_criteria=[Fails()])
    with pytest.warns(UserWarning, match="the last turn failed midway"):
        reply = live.send("Say more.")
    assert reply == clean.send("Say more.") and torch.equal(live.ids, clean.ids)
    assert live.memory()["image_tokens"] == clean.memory()["image_tokens"] > 0
    assert live.cache.get_seq_length() == live.ids.shape[1] - 1
