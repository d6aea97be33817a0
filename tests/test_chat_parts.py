"""Multimodal turns as Qwen3-VL users write them: content parts in order, image sources as load_image takes them,
the modality of each cache entry seen by policies, and the text + image split of the entries kept."""

import base64
import io
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from retention.chat import ChatInputError, RetentionChat
from tiny_vl import photos, tiny_qwen3_vl_for, tiny_qwen3_vl_processor


def _chat(model, proc, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        return RetentionChat(model, proc, **{"budget_tokens": None, "max_new_tokens": 3, "min_new_tokens": 3,
                                             **kwargs})


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_image_parts_sit_where_they_stand_and_the_transcript_keeps_their_order(tmp_path):
    """An image part between two texts: its tokens come between them (images= put every image first), the cache holds
    what one forward over the conversation computes, and a saved transcript resumes to the same ids and keys."""
    from transformers import DynamicCache

    from retention.compat import cache_kwargs

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    a, b = photos(2)
    image_id = model.config.image_token_id
    chat = _chat(model, proc)
    chat.send([{"type": "text", "text": "Compare"}, {"type": "image", "image": a}, {"type": "text", "text": "with"},
               {"type": "image", "image": b}, "Which is red?"])
    chat.send("Say more.")
    text = proc.tokenizer.decode(chat.ids[0])
    assert text.index("Compare") < text.index("<|image_pad|>") < text.index("with") < text.rindex("<|image_pad|>")
    assert text.rindex("<|image_pad|>") < text.index("Which is red?")
    assert chat.messages[0]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"},
                                           {"type": "text", "text": "with"}, {"type": "image"},
                                           {"type": "text", "text": "Which is red?"}]
    first = _chat(model, proc)
    first.send("Compare with Which is red?", images=[a, b])  # images=: as before, every image first
    t = proc.tokenizer.decode(first.ids[0])
    assert t.rindex("<|image_pad|>") < t.index("Compare")
    # the cache holds what one forward over the whole conversation with its images in order computes
    n = chat.cache.get_seq_length()
    ids = chat.ids[:, :n]
    pixels = proc.image_processor(images=[a, b], return_tensors="pt")
    again = _chat(model, proc, chunk_size=8)
    again.resume(chat.save(tmp_path / "chat.json"))
    assert torch.equal(again.ids, chat.ids)
    model.retention.detach()
    reference = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
              image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == image_id).int(),
              **cache_kwargs(reference), use_cache=True)
    for layer in range(len(reference.layers)):
        want = reference.layers[layer].keys[0]  # (H, n, D)
        for c in (chat, again):
            got = c.cache.store.gather_layer(layer).keys.reshape(want.shape[0], -1, want.shape[-1])[:, :n]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_image_sources_as_load_image_takes_them(tmp_path, monkeypatch):
    """A path, a PIL image, a data URI, bare base64 and an http URL (a local server) give the same RGB pixels, as
    open_rgb reads the file; a bad source is a ChatInputError naming its part; a video part is refused first."""
    import http.server
    import threading

    from retention.images import ImageSourceError, load_rgb, open_rgb

    pixels = np.zeros((12, 10, 4), "uint8")
    pixels[..., 0], pixels[..., 3] = 200, 90  # half transparent: white beneath
    png = _png(Image.fromarray(pixels))
    path = tmp_path / "a.png"
    path.write_bytes(png)
    want = np.array(open_rgb(path))

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path != "/a.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/a.png"
    b64 = base64.b64encode(png).decode()
    try:
        for source in (path, str(path), Image.open(path), f"data:image/png;base64,{b64}", b64, url):
            got = load_rgb(source)
            assert got.mode == "RGB" and np.array_equal(np.array(got), want), source
        for bad, words in ((str(tmp_path / "none.png"), "no image file"), (url[:-5] + "b.png", "cannot download"),
                           ("data:text/plain;base64,aGk=", "data URI"), (base64.b64encode(b"x" * 40).decode(),
                                                                           "no image"), (3, "got a int")):
            with pytest.raises(ImageSourceError, match=words):
                load_rgb(bad)
        proc = tiny_qwen3_vl_processor()
        model = tiny_qwen3_vl_for(proc)
        chat = _chat(model, proc)
        chat.send(["Look:", {"type": "image", "url": url}, {"type": "image", "path": str(path)},
                   {"type": "image", "base64": b64}])
        assert [np.array_equal(np.array(im), want) for im in chat._image_turns[0]["images"]] == [True] * 3
    finally:
        server.shutdown()
    monkeypatch.setattr(RetentionChat, "_encode_turn", lambda *a: pytest.fail("went on to the model"))
    for parts, words in (([{"type": "image", "image": str(tmp_path / "no.png")}], "part 0 .*cannot be read"),
                         (["hi", {"type": "video", "video": "clip.mp4"}], "part 1 is a video.*extract frames"),
                         (["hi", {"type": "image"}], "part 1 .an image. must give its image"),
                         (["hi", {"type": "audio"}], "part 1 has type 'audio'"), ([], "empty list"),
                         (["hi", 5], "part 1 is a int")):
        with pytest.raises(ChatInputError, match=words):
            chat.send(parts)
    with pytest.raises(ChatInputError, match="images= goes with a text message"):
        chat.send(["hi"], images=[path])


def test_a_policy_sees_which_entries_are_image_tokens_and_the_report_splits_text_and_image():
    """EntryView.is_image is set exactly on the entries of image tokens (brute force over the kept positions); a
    policy that ranks image entries last keeps none under a tight budget; memory() and the CLI line split the kept
    entries as text + image as a count over every kept entry finds."""
    from retention.chat_cli import _memory_line
    from retention.policies import GlobalGatesPolicy

    seen = []

    class NoImages(GlobalGatesPolicy):
        def score(self, entries):
            seen.append((entries.pos.clone(), entries.valid.clone(), entries.seq.clone(), entries.is_image))
            s = super().score(entries)
            return torch.where(entries.is_image, torch.full_like(s, -1e9), s)

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc)
    chat = _chat(model, proc, budget_tokens=16, chunk_size=8, policy=NoImages(sink=0))
    a, b = photos(2)
    for turn in (["What is", {"type": "image", "image": a}, "here?"], "Say more about it.",
                 [{"type": "image", "image": b}, "and this?"], "ok then, tell me a long story about both of them."):
        chat.send(turn)
        image = chat.ids[0] == model.config.image_token_id
        report = chat.memory()
        kept_image = kept_text = 0
        for layer in range(3):
            view = chat.cache.store.gather_layer(layer)
            for p in view.pos[0][view.valid[0]].tolist():
                kept_image += int(image[p])
                kept_text += int(not image[p])
        assert (report["kept_text_entries"], report["kept_image_entries"]) == (kept_text, kept_image)
        assert f"kept: {kept_text:,} text + {kept_image:,} image entries of" in _memory_line(report)
    assert seen and chat.cache.evictions
    image = chat.ids[0] == model.config.image_token_id
    for pos, valid, _, flags in seen:
        assert flags is not None and flags.shape == pos.shape
        want = image[pos.clamp(0, len(image) - 1)] & (pos >= 0) & (pos < len(image))
        assert torch.equal(flags, want)
    assert any(bool(f.any()) for *_, f in seen)  # image entries were scored
    assert chat.memory()["kept_image_entries"] == 0  # ranked last, none kept under the budget


def test_a_text_model_view_has_no_modality():
    """A text model's chat marks no modality (is_image None) and takes a list of text parts as their joined text."""
    from retention.models import load_model
    from retention.policies import GlobalGatesPolicy

    seen = []

    class Look(GlobalGatesPolicy):
        def score(self, entries):
            seen.append(entries.is_image)
            return super().score(entries)

    model, tok = load_model("smollm2-135m")
    chat = _chat(model, tok, budget_tokens=8, chunk_size=8, policy=Look())
    chat.send(["Hello there,", "a list of text parts works on a text model too."])
    assert seen and all(f is None for f in seen)
    assert "Hello there, a list of text parts" in chat.messages[0]["content"]
