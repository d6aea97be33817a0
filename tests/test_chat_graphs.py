"""RetentionChat(cuda_graphs=True): replies, greedy or sampled, decode through GraphDecoder. On the CPU the same
planned steps run eagerly (``_graph_replay = False``), which is what these tests check against the chat's generate
path on the real SmolLM2; the replayed graphs run in test_gpu_kernels.py."""

import warnings

import pytest
import torch

from retention import load_model
from retention.chat import ChatSetupError, RetentionChat

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _planned(chat: RetentionChat) -> RetentionChat:
    chat.cuda_graphs, chat._graph_replay = True, False  # the graph path, its steps eager (no GPU here)
    return chat


def _kept(cache) -> list[list[int]]:
    s = cache.store
    view = s.gather(torch.arange(s.num_streams), with_kv=False)
    return [view.pos[r][view.valid[r]].tolist() for r in range(s.num_streams)]


def test_replies_through_the_planned_steps_are_generates(smollm2):
    """Turn for turn, through chunked prefills and evictions: the same replies, ids, messages, kept entries and
    ends as the generate path, with min_new_tokens, a list of eos ids and streaming too."""
    model, tok = smollm2
    settings = dict(budget_tokens=24, max_new_tokens=30, chunk_size=16)
    plain, planned = RetentionChat(model, tok, **settings), _planned(RetentionChat(model, tok, **settings))
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("!")]
    script = [("Say hello.", dict(eos_token_id=stops)),  # ends on its first "!"
              ("Say hello.", dict(eos_token_id=stops, min_new_tokens=16)),  # not before its sixteenth token
              ("My name is Ada and I live in Paris.", {}), ("Tell me one fact about rivers.", {}),
              ("What is my name?", {})]
    replies, ended = [], []
    for turn, kwargs in script:
        replies.append(planned.send(turn, **kwargs))
        assert replies[-1] == plain.send(turn, **kwargs)
        ended.append(plain._last_reply_ended)
        assert planned._last_reply_ended == ended[-1]
    first = len(tok(replies[0])["input_ids"])
    assert replies[0].endswith("!") and ended[0] and first < 16 <= len(tok(replies[1])["input_ids"])
    assert list(planned.stream("Count to three.")) == list(plain.stream("Count to three."))
    assert torch.equal(planned.ids, plain.ids) and planned.messages == plain.messages
    assert planned.cache.evictions == plain.cache.evictions > 0 and _kept(planned.cache) == _kept(plain.cache)
    assert planned._decoder is not None and planned._decoder.cache is planned.cache
    assert planned.cache.get_seq_length() == planned.ids.shape[1] - 1  # the last token goes with the next turn


def test_given_eos_ids_replace_the_models_as_in_generate(smollm2):
    """eos_token_id=[...] replaces the generation config's eos (as generate reads it): a reply that would end on
    <|im_end|> runs on to max_new_tokens when only <|endoftext|> stops it."""
    model, tok = smollm2
    plain, planned = (RetentionChat(model, tok, budget_tokens=None, max_new_tokens=40) for _ in range(2))
    _planned(planned)
    assert planned.send("Say hello.") == plain.send("Say hello.") and plain._last_reply_ended  # ends on <|im_end|>
    plain.reset(), planned.reset()
    assert planned.send("Say hello.", eos_token_id=[0]) == plain.send("Say hello.", eos_token_id=[0])
    assert torch.equal(planned.ids, plain.ids) and tok.eos_token_id in plain.ids[0, -40:-1].tolist()


def _same_draws(plain: RetentionChat, planned: RetentionChat, text: str, seed: int, **kwargs) -> str:
    torch.manual_seed(seed)
    reply = plain.send(text, **kwargs)
    torch.manual_seed(seed)
    assert planned.send(text, **kwargs) == reply
    return reply


@pytest.mark.slow  # 65 s; the greedy twin above runs by default, this one with `make test-slow`
def test_sampled_replies_through_the_planned_steps_are_generates(smollm2, monkeypatch):
    """From the same seed the planned steps draw generate's tokens: each sampling warper alone and all together with
    a repetition penalty and min_new_tokens (eos kept out before top-k, as generate orders them), and the model's
    generation-config settings where the call gives none. Different seeds draw different replies, so the draws are
    really sampled."""
    model, tok = smollm2
    settings = dict(budget_tokens=24, max_new_tokens=20, chunk_size=16)
    plain, planned = RetentionChat(model, tok, **settings), _planned(RetentionChat(model, tok, **settings))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no reply falls back to generate
        replies = [_same_draws(plain, planned, "Tell me about the sea.", 0, do_sample=True, temperature=1.3, top_k=0),
                   _same_draws(plain, planned, "Name a colour.", 1, do_sample=True, top_k=5),
                   _same_draws(plain, planned, "Name an animal.", 2, do_sample=True, top_p=0.7, top_k=0),
                   _same_draws(plain, planned, "Name a city.", 3, do_sample=True, min_p=0.1, top_k=0),
                   _same_draws(plain, planned, "Write a poem.", 4, do_sample=True, temperature=0.9, top_k=3,
                               top_p=0.95, min_p=0.02, repetition_penalty=1.3, min_new_tokens=12),
                   _same_draws(plain, planned, "Say hi.", 5, repetition_penalty=1.5)]  # greedy, penalised
        monkeypatch.setattr(model.generation_config, "temperature", 1.5)
        monkeypatch.setattr(model.generation_config, "top_k", 0)
        replies.append(_same_draws(plain, planned, "Describe a forest.", 6, do_sample=True))
    assert torch.equal(planned.ids, plain.ids) and planned.cache.evictions == plain.cache.evictions > 0
    assert len(tok(replies[4])["input_ids"]) >= 12
    assert replies[0] != RetentionChat(model, tok, **settings).send("Tell me about the sea.")  # sampled, not greedy
    for bad in (dict(top_k=-1), dict(temperature=0.0), dict(min_p=2.0)):  # refused as generate refuses them ...
        for chat in (plain, planned):
            with pytest.raises(ValueError):
                chat.send("Again.", do_sample=True, **bad)
    assert planned.send("Name a river.") == plain.send("Name a river.")  # ... with the cache as it was
    assert planned.cache.get_seq_length() == planned.ids.shape[1] - 1


def test_a_reply_stopped_early_on_the_planned_steps_is_kept(smollm2):
    model, tok = smollm2
    chat = _planned(RetentionChat(model, tok, budget_tokens=64, max_new_tokens=40))
    prompt = "Write a long story about a lighthouse keeper."
    stream = chat.stream(prompt)
    next(stream)
    stream.close()
    n_prompt = len(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
    assert 1 <= chat.ids.shape[1] - n_prompt < 40  # cut where it was stopped, not run to max_new_tokens
    assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1 and chat.messages[-1]["role"] == "assistant"
    assert isinstance(chat.send("Now name her cat.", max_new_tokens=6), str)


def test_what_graphs_cannot_decode_goes_through_generate_or_is_refused(smollm2, monkeypatch, capsys):
    model, tok = smollm2
    chat = _planned(RetentionChat(model, tok, budget_tokens=64, max_new_tokens=4))
    with pytest.warns(UserWarning, match=r"decodes with generate, since typical_p given"):
        chat.send("Hi.", do_sample=True, typical_p=0.9)
    with pytest.warns(UserWarning, match=r"since no_repeat_ngram_size given"):
        chat.send("Hi again.", no_repeat_ngram_size=2)
    monkeypatch.setattr(model.generation_config, "no_repeat_ngram_size", 3)
    with pytest.warns(UserWarning, match=r"the model's generation config sets \{'no_repeat_ngram_size': 3\}"):
        chat.send("And again.")
    monkeypatch.setattr(model.generation_config, "no_repeat_ngram_size", None)
    monkeypatch.setattr(model.generation_config, "typical_p", 0.9)  # a warper the graph path lacks, when sampling
    with pytest.warns(UserWarning, match=r"the model's generation config sets \{'typical_p': 0.9\}"):
        chat.send("Once more.", do_sample=True)
    monkeypatch.setattr(model.generation_config, "typical_p", None)
    monkeypatch.setattr(model.generation_config, "stop_strings", ["."])  # stopped by generate, with the tokenizer
    with pytest.warns(UserWarning, match=r"the model's generation config sets \{'stop_strings': \['.'\]\}"):
        assert chat.send("Say two sentences.", max_new_tokens=30).count(".") <= 1
    with pytest.raises(ChatSetupError, match="cuda_graphs.*on the CPU"):
        RetentionChat(model, tok, cuda_graphs=True)

    import retention.models
    from retention.cli import main

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["chat", "--cuda-graphs", "--device", "cpu"]) == 2
    assert "--cuda-graphs needs a CUDA GPU" in capsys.readouterr().err


def test_a_vision_language_chat_through_the_planned_steps_is_generates():
    """Qwen3-VL (tiny, random): turns with photos, then text, decode through the planned steps with M-RoPE positions
    shifted by the model's rope_deltas, as generate places them: the same replies, ids and kept entries."""
    import warnings

    from tiny_vl import photos, tiny_qwen3_vl_for, tiny_qwen3_vl_processor

    proc = tiny_qwen3_vl_processor()
    model = tiny_qwen3_vl_for(proc).eval()
    imgs = photos(2)
    settings = dict(budget_tokens=24, max_new_tokens=6, min_new_tokens=6, chunk_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained gates, on purpose
        plain, planned = RetentionChat(model, proc, **settings), _planned(RetentionChat(model, proc, **settings))
    for text, images in (("What is this?", [imgs[0]]), ("Say more.", None), ("And this one?", [imgs[1]]),
                         ("Which is brighter?", None)):
        assert planned.send(text, images=images) == plain.send(text, images=images)
    assert torch.equal(planned.ids, plain.ids) and planned._decoder is not None
    assert planned.cache.evictions == plain.cache.evictions > 0 and _kept(planned.cache) == _kept(plain.cache)
