"""RetentionChat on the real SmolLM2: one cache across turns, bounded memory, clear errors."""

import re
import warnings

import pytest
import torch

from retention import load_model
from retention.cache import RetentionCache
from retention.chat import ChatInputError, ChatSetupError, RetentionChat
from retention.gates import GateConfig, RetentionGates
from chat_templates import QWEN3_LIKE_TEMPLATE, THINKING_SWITCH_TEMPLATE

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_first_reply_equals_plain_generate(smollm2):
    from safetensors.torch import load_file

    from retention.models import shipped_gates

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=8)  # the shipped gates by default
    shipped = load_file(str(shipped_gates("smollm2-135m") / "gates.safetensors"))
    assert all(torch.equal(v, shipped[k]) for k, v in chat.attachment.gates.state_dict().items())
    reply = chat.send("What is the capital of France?")
    chat.model.retention.detach()
    x = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**x, max_new_tokens=8, do_sample=False)
    assert reply == tok.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)


def test_three_turns_stay_within_budget_and_errors_leave_the_session_usable(smollm2):
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=64, max_new_tokens=12)
    streams = 30 * 3
    seen = []
    for turn in ("My name is Ada.", "Tell me one fact about rivers.", "What is my name?"):
        reply = "".join(chat.stream(turn))
        assert isinstance(reply, str)
        mem = chat.memory()
        seen.append(mem["tokens_seen"])
        assert mem["kept_entries"] <= 64 * streams + chat.cache.slack + 256 * streams
        if mem["tokens_seen"] * streams > 64 * streams + chat.cache.slack:  # past budget + slack: evicted
            assert mem["kv_bytes"] < mem["full_cache_bytes"]
    assert seen == sorted(seen) and seen[-1] > 64
    with pytest.raises(ChatInputError, match="text-only model"):
        chat.send("look", images=["not an image"])
    # a message or reply that is no string was a Jinja UndefinedError (None) or a TypeError in the template
    # (a list is content parts now, whose text parts a text-only model reads joined; a part that is no part is not)
    for call, words in ((lambda: chat.send(None), r"must be a str or a list of content parts .* got NoneType"),
                        (lambda: "".join(chat.stream([3])), "part 0 is a int"),
                        (lambda: chat.add_turn("hi", 3), "the reply must be a str, got int"),
                        (lambda: chat.add_turn(5, "hello"), r"the message must be a str or a list .* got int")):
        with pytest.raises(ChatInputError, match=words):
            call()
    before = chat.memory()["tokens_seen"]
    chat.send("Thanks!")  # still usable after the error
    assert chat.memory()["tokens_seen"] > before
    # a turn longer than the whole budget (a pasted document) is prefilled in chunks and compressed like the rest;
    # it used to be refused, so a document could never be asked about under a budget smaller than itself
    long_turn = "The river Nile flows north through eleven countries. " * 40
    n = len(tok(long_turn).input_ids)
    assert n > 5 * 64  # five times what the budget holds per head
    chat.chunk_size = 128
    peaks = []
    hook = model.model.layers[-1].register_forward_hook(lambda *a: peaks.append(int(chat.cache.store.lengths.sum())))
    try:
        chat.send(long_turn + "Which way does the Nile flow?")
    finally:
        hook.remove()
    mem = chat.memory()
    assert mem["tokens_seen"] > before + n and mem["kept_entries"] <= 64 * streams + chat.cache.slack
    assert max(peaks) <= 64 * streams + chat.cache.slack + 128 * streams  # bounded by a chunk, not by the turn
    chat.model.retention.detach()


def test_gates_for_another_model_are_a_setup_error(smollm2):
    model, tok = smollm2
    other = RetentionGates(GateConfig(num_layers=2, num_kv_heads=2, hidden_size=96))
    with pytest.raises(ChatSetupError, match="gates do not match this model"):
        RetentionChat(model, tok, other, budget_tokens=64)


@pytest.mark.parametrize("given,message", [
    (dict(budget_tokens=0), r"budget_tokens must be an integer >= 1 \(tokens per \(layer, KV head\)"),
    (dict(budget_tokens=-3), "budget_tokens must be an integer >= 1"),
    (dict(budget_tokens=2.5), "budget_tokens must be an integer >= 1 .*got 2.5"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(protected_window=-1), "protected_window must be an integer >= 0"),
    (dict(page_size=True), "page_size must be an integer >= 1"),
    (dict(system=5), "system must be a str, got int"),  # was a TypeError in the template at the first turn
    # generate refused them at the first turn ("model_kwargs are not used by the model")
    (dict(temprature=0.5), "unknown option.s. temprature: a chat's keyword arguments are generate...s"),
    (dict(sink=64), r"sink is an option of the eviction policy: pass policy=GlobalGatesPolicy\(\.\.\.\)"),
])
def test_counts_out_of_range_are_setup_errors_before_anything_attaches(smollm2, given, message):
    """A budget of 0 or -3 tokens used to fail inside the cache in entries ("got -270"), a chunk of 0 deep in a tensor
    split, and a float budget, a reply of 0 tokens or a negative window were taken: each now names its argument."""
    model, tok = smollm2
    with pytest.raises(ChatSetupError, match=message):
        RetentionChat(model, tok, **given)
    assert getattr(model, "retention", None) is None


def test_numpy_and_tensor_counts_are_taken_as_the_cache_takes_them(smollm2):
    """The chat read counts by ``isinstance(int)`` and refused ``numpy.int64(64)``, which RetentionCache and the
    eval take: one definition of a count now, and the chat keeps plain ints."""
    import numpy as np

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=np.int64(64), chunk_size=torch.tensor(32),
                         max_new_tokens=np.int32(2))
    try:
        assert (chat.budget_tokens, chat.chunk_size, chat.max_new_tokens) == (64, 32, 2)
        assert all(type(v) is int for v in (chat.budget_tokens, chat.chunk_size, chat.max_new_tokens))
        assert chat.cache.budget == RetentionCache.budget_for(model, 64)
    finally:
        chat.model.retention.detach()
    with pytest.raises(ChatSetupError, match="budget_tokens must be an integer >= 1"):
        RetentionChat(model, tok, budget_tokens=torch.tensor(2.0))


def test_a_budget_under_a_policy_that_never_evicts_is_named(smollm2):
    """``policy="full"`` keeps every entry whatever the budget (as the eval's reference): the chat says the budget it
    was given is not enforced, instead of holding the whole conversation silently."""
    model, tok = smollm2
    with pytest.warns(UserWarning, match="policy 'full' keeps every entry: budget_tokens=8 is not enforced"):
        chat = RetentionChat(model, tok, policy="full", budget_tokens=8, max_new_tokens=2)
    chat.model.retention.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RetentionChat(model, tok, policy="full", max_new_tokens=2).model.retention.detach()
        RetentionChat(model, tok, policy="snapkv", budget_tokens=8, max_new_tokens=2).model.retention.detach()


def test_untrained_gates_on_request(smollm2):
    model, tok = smollm2
    chat = RetentionChat(model, tok, "untrained", budget_tokens=64, max_new_tokens=4)
    b = chat.attachment.gates.state_dict()["b"]
    assert torch.equal(b, torch.full_like(b, GateConfig.for_model(model).bias_init))  # untrained: the initial bias
    # the same untrained gates in every process (seeded), whatever the global RNG: the same replies run to run
    assert chat.attachment.gates.fingerprint() == RetentionGates(GateConfig.for_model(model), seed=0).fingerprint()
    chat.model.retention.detach()


def test_demo_compares_with_the_shipped_gates(capsys):
    """`retention demo` (the README's main command ends with it): full cache, the gates asked for
    (untrained here) and the shipped checkpoint under the same budget; the shipped gates keep the code."""
    from retention.cli import main

    assert main(["demo", "--max-new-tokens", "14"]) == 0
    out = capsys.readouterr().out
    rows = {line[:22].strip(): line for line in out.splitlines() if line.startswith(("full ", "global", "  with"))}
    assert set(rows) == {"full", next(k for k in rows if k.startswith("global top-B")), "with shipped gates"}
    assert "4512" in rows["full"] and "4512" in rows["with shipped gates"]
    kept = {k: int(v[22:39].replace(",", "")) for k, v in rows.items()}  # fixed-width columns
    assert kept["with shipped gates"] < kept["full"] / 2
    budget = int(next(k for k in rows if k.startswith("global top-B")).split("B=")[1])
    note = re.search(r"more than B \+ ([\d,]+), one page", out)
    assert note, out
    slack = int(note.group(1).replace(",", ""))
    assert 0 < slack and all(budget <= kept[k] <= budget + slack for k in kept if k != "full")  # what the note says
    assert "shipped gates: " in out and "smollm2-135m-global" in out


@pytest.mark.parametrize("gates", ["checkpoints/smollm2-135m-global", "smollm2-135m-global"])
def test_demo_with_the_shipped_gates_named_runs_them_once(gates, capsys, monkeypatch, tmp_path):
    """Named by the shipped name (or run from another folder) the shipped gates did not match the path check, and the
    demo scored them twice; the gates are now compared by fingerprint."""
    from retention.cli import main

    monkeypatch.chdir(tmp_path)  # the checkout path is relative: from elsewhere it resolves through the shipped name
    assert main(["demo", "--gates", gates, "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "with shipped gates" not in out and f"gates: {gates} (global)" in out


@pytest.mark.parametrize("args", [["chat", "--budget", "0"], ["chat", "--budget", "-5"],
                                  ["chat", "--max-new-tokens", "0"], ["demo", "--budget", "x"],
                                  ["chat", "--chunk-size", "0"]])
def test_a_budget_or_length_below_one_is_a_usage_error(args, capsys):
    """`--budget 0` used to load the model, then fail with "budget of 0 entries cannot hold the protected window"
    (and -5 with "-450 entries")."""
    from retention.cli import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"retention {args[0]}: error: argument {args[1]}" in err


@pytest.mark.parametrize("command", ["chat", "demo"])
def test_a_device_or_dtype_this_machine_cannot_use_fails_before_the_model_loads(command, capsys, monkeypatch):
    """`retention chat/demo` loaded every model on the CPU in float32, GPU or not; --device / --dtype choose (default:
    cuda and bfloat16 when there is a GPU), and a bad choice is refused first."""
    import retention
    import retention.models
    from retention.cli import main

    for where in (retention.models, retention):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main([command, "--dtype", "bfloat17"]) == 2
    assert "--dtype 'bfloat17': choose one of float32, bfloat16, float16" in capsys.readouterr().err
    assert main([command, "--device", "tpu:what"]) == 2
    assert "is not a device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([command, "--device", "cuda"]) == 2
        assert "torch sees no CUDA GPU here" in capsys.readouterr().err


def test_chat_command_refuses_a_bad_window_before_loading_the_model(capsys, monkeypatch):
    """`retention chat --recent -1` / `--sink -2`: exit 2 with the flag named, and no model is loaded first."""
    import retention.models
    from retention.cli import main

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["chat", "--recent", "-1"]) == 2
    assert "recent must be >= 0" in capsys.readouterr().err
    assert main(["chat", "--sink", "-2"]) == 2
    assert "sink must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["chat", "demo"])
def test_a_missing_gates_folder_is_an_error_before_the_model_loads(command, capsys, monkeypatch, tmp_path):
    """`retention chat|demo --gates TYPO`: exit 2 with the problem and the fix, no traceback, no model loaded."""
    import retention
    import retention.models
    from retention.cli import main

    for where in (retention.models, retention):
        monkeypatch.setattr(where, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main([command, "--gates", str(tmp_path / "no-such-gates")]) == 2
    err = capsys.readouterr().err
    assert f"retention {command}: error: gate checkpoint" in err and "there is no such folder" in err
    assert "Traceback" not in err
    (tmp_path / "run").mkdir()  # a folder that is no checkpoint (a run's output): was a FileNotFoundError traceback
    assert main([command, "--gates", str(tmp_path / "run")]) == 2
    assert f"retention {command}: error: {tmp_path / 'run' / 'retention.json'} not found" in capsys.readouterr().err


def test_an_unknown_model_is_an_error_not_a_traceback(capsys, monkeypatch, tmp_path):
    from retention.cli import main

    assert main(["demo", "--model", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert ("retention demo: error: " in err and "there is no such folder" in err
            and "an embedded name (smollm2-135m)" in err)


def test_prompt_lookup_on_the_first_turn_only(smollm2):
    """Prompt-lookup decoding on the first turn gives the greedy reply under a budget that evicts; on a
    filled cache it is refused before anything changes (transformers would re-feed the earlier turns)."""
    model, tok = smollm2
    text = "Repeat after me: the quick brown fox jumps over the lazy dog. " * 6
    replies = []
    for lookup in (None, 4):
        chat = RetentionChat(model, tok, budget_tokens=116, max_new_tokens=24)  # the turn is 115 tokens
        replies.append(chat.send(text, prompt_lookup_num_tokens=lookup))
        assert chat.cache.evictions > 0
    assert replies[0] == replies[1] and "fox" in replies[1]
    seen = chat.memory()["tokens_seen"]
    with pytest.raises(ChatInputError, match="first turn only"):
        chat.send("Again.", prompt_lookup_num_tokens=4)
    assert chat.memory()["tokens_seen"] == seen and len(chat.messages) == 2
    assert isinstance(chat.send("Again."), str)


def test_a_byte_that_is_not_utf8_is_refused_and_the_chat_goes_on(smollm2, capsys, monkeypatch):
    """Issue 77: a byte that is not UTF-8 typed or piped into `retention chat` (Python reads it as a lone surrogate)
    ended the session with the tokenizer's `TypeError: TextEncodeInput must be Union[...]`, losing the conversation;
    through the API the same TypeError. It is a ChatInputError: the message is not sent, the chat goes on."""
    import io
    import sys

    import retention.chat_cli as chat_module
    import retention.models
    from retention.cli import main

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=4)
    with pytest.raises(ChatInputError, match=r"the message holds '\\udce9' at character 3, which is no character"):
        chat.send("caf\udce9 au lait")
    with pytest.raises(ChatInputError, match=r"the reply holds '\\ud800' at character 0.*type it again, or give"):
        chat.add_turn("hi", "\ud800")
    assert chat.messages == [] and chat.memory()["tokens_seen"] == 0
    model.retention.detach()

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\nHello!\n"), encoding="utf-8"))
    sent, loop = [], chat_module.chat_loop
    monkeypatch.setattr(chat_module, "chat_loop", lambda chat, lines: (loop(chat, lines), sent.extend(chat.messages)))
    assert main(["chat", "--budget", "32", "--max-new-tokens", "4"]) == 0
    model.retention.detach()
    err = capsys.readouterr().err
    assert "error: the message holds '\\udce9' at character 3" in err and "the message was not sent" in err
    assert [m["content"] for m in sent if m["role"] == "user"] == ["Hello!"]


class _ScriptedChat:
    """Stands in for RetentionChat in ``chat_loop``: records what reaches the model."""

    def __init__(self, multimodal: bool, refuse: str | None = None):
        self.multimodal, self.refuse, self.sent, self.resets = multimodal, refuse, [], 0
        self.model, self.messages = torch.nn.Linear(1, 1), []

    def stream(self, text, images):
        if text == self.refuse:
            raise ChatInputError("assisted decoding works on the first turn only")
        self.sent.append((text, len(images)))
        yield f"re: {text}"

    def memory(self):
        return {"kv_bytes": 2**20, "full_cache_bytes": 2**21, "kept_entries": 1234, "full_cache_entries": 2468,
                "tokens_seen": 7}

    def reset(self):
        self.resets += 1


def test_the_chat_loop_keeps_commands_and_messages_apart(tmp_path, capsys):
    """`retention chat` used to send a mistyped command to the model as a message, and took `/image` on a text-only
    model only to refuse the next message (which was then lost)."""
    from PIL import Image

    from retention.chat_cli import chat_loop

    photo = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(photo)
    text_only = _ScriptedChat(multimodal=False)
    chat_loop(text_only, ["/image " + str(photo), "hello", "/frob", "//etc is a folder", "/memory", "/reset", "/quit",
                          "after"])
    out, err = capsys.readouterr()
    assert text_only.sent == [("hello", 0), ("/etc is a folder", 0)] and text_only.resets == 1
    assert "text-only model: /image needs a vision-language model" in err and "unknown command /frob" in err
    assert "re: hello" in out and "[kv 1.00 MiB of 2.00 MiB full; kept: 1,234 entries of 2,468; 7 tokens seen]" in out

    vl = _ScriptedChat(multimodal=True, refuse="too long")
    chat_loop(vl, [f"/image {photo}", f"/image {tmp_path / 'missing.png'}", "/image", f"/image {photo}", "too long",
                   "what is this?", f"/image {photo}", "/reset", "and now?"])
    out, err = capsys.readouterr()
    # the refused message took its images with it; /reset drops
    assert vl.sent == [("what is this?", 0), ("and now?", 0)]
    assert "cannot open image" in err and "/image needs a path" in err
    assert "the message was not sent (its 2 image(s) dropped too: attach them again)" in err
    vl.refuse = None
    chat_loop(vl, [f"/image {photo}", f"/image {photo}", "compare them"])
    assert vl.sent[-1] == ("compare them", 2)


def test_retention_help_names_every_command_in_plain_text(capsys):
    from retention.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and all(c in out for c in ("demo", "chat", "push", "average", "eval"))
    import retention

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"retention {retention.__version__}"


@pytest.mark.parametrize("how", ["close", "ctrl-c"])
def test_a_reply_stopped_early_is_kept_and_the_chat_goes_on(smollm2, how):
    """Stopping a streamed reply (`break` / close(), or Ctrl-C while it waits) used to leave generation running into
    the cache in the background, out of step with the history. Now it ends the reply there: the same state as a reply
    cut by max_new_tokens at that length, and the next turn gives the same reply as from that state."""
    model, tok = smollm2
    prompt = "Write a long story about a lighthouse keeper and her cat."
    chat = RetentionChat(model, tok, budget_tokens=64, max_new_tokens=60)
    stream = chat.stream(prompt)
    first = next(stream)
    if how == "close":
        stream.close()
    else:
        with pytest.raises(KeyboardInterrupt):
            stream.throw(KeyboardInterrupt)
    n_prompt = len(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
    k = chat.ids.shape[1] - n_prompt
    assert 1 <= k < 60 and chat.messages[-1]["content"].startswith(first.strip())
    assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1  # the last token is fed with the next turn
    reference = RetentionChat(model, tok, budget_tokens=64, max_new_tokens=60)
    reference.send(prompt, max_new_tokens=k)
    assert torch.equal(reference.ids, chat.ids) and reference.messages == chat.messages
    assert chat.send("Now name the cat.", max_new_tokens=12) == reference.send("Now name the cat.", max_new_tokens=12)


def test_ctrl_c_in_the_chat_loop_stops_the_reply_not_the_chat(capsys):
    from retention.chat_cli import chat_loop

    class Interrupted(_ScriptedChat):
        def stream(self, text, images):
            self.sent.append((text, len(images)))
            yield "once upon"
            if text == "story":
                raise KeyboardInterrupt

    chat = Interrupted(multimodal=False)
    chat_loop(chat, ["story", "and then?"])
    out = capsys.readouterr().out
    assert [t for t, _ in chat.sent] == ["story", "and then?"] and "once upon [stopped]" in out


def test_a_turn_that_fails_midway_leaves_the_chat_loop_running(capsys):
    """Out of GPU memory mid-reply ended `retention chat` with a traceback, losing a conversation the chat itself
    repairs on the next turn (and /save could still write). The loop says the turn failed and goes on."""
    from retention.chat_cli import chat_loop

    class OutOfMemory(_ScriptedChat):
        def stream(self, text, images):
            self.sent.append((text, len(images)))
            yield "once"
            if text == "story":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    chat = OutOfMemory(multimodal=False)
    chat_loop(chat, ["story", "and then?"])
    err = capsys.readouterr().err
    assert [t for t, _ in chat.sent] == ["story", "and then?"]
    assert "the turn failed (OutOfMemoryError: CUDA out of memory." in err and "/save FILE keeps it" in err


def test_ctrl_c_shows_the_reply_as_kept(capsys):
    """The streamer holds back a word's start, and tokens made before the stop lands are kept as well: the screen
    showed "I [stopped]" where the history (and a /save) kept "In the". The loop now prints the rest of the kept reply
    before [stopped]."""
    from retention.chat_cli import chat_loop

    class Interrupted(_ScriptedChat):
        def stream(self, text, images):
            yield "I"
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "In the"}]
            raise KeyboardInterrupt

    chat_loop(Interrupted(multimodal=False), ["story"])
    assert "In the [stopped]" in capsys.readouterr().out


def test_no_turn_starts_while_a_stream_is_open(smollm2):
    """A send() while an earlier stream() was still open ran two generations on one cache (a shape error, or the
    process aborted), or committed the old reply after the newer turn. Every turn, reset and resume is now refused
    until the stream ends; closing it keeps the reply so far, in order."""
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=16, max_new_tokens=8)
    chat.send("My name is Ada.")
    stream = chat.stream("Tell me a story.")
    next(stream)
    for call, what in ((lambda: chat.send("What is my name?"), "a new turn"), (lambda: chat.add_turn("a", "b"),
                       "add_turn"), (chat.reset, "reset"), (lambda: chat.resume("x.json"), "resume")):
        with pytest.raises(ChatInputError, match=f"{what}.*an earlier stream.. is still open"):
            call()
    stream.close()
    assert chat.messages[-2]["content"] == "Tell me a story."
    assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1  # the cache holds the conversation, no more
    chat.send("What is my name?")
    assert [m["content"] for m in chat.messages[::2]] == ["My name is Ada.", "Tell me a story.", "What is my name?"]
    chat.reset()  # open again once the stream is done
    chat.model.retention.detach()


def test_untrained_means_untrained_whatever_is_attached(smollm2):
    """RetentionChat(model, tok, "untrained") on a model that already held trained gates kept them silently."""
    model, tok = smollm2
    trained = RetentionChat(model, tok, budget_tokens=8, max_new_tokens=2).attachment.gates
    chat = RetentionChat(model, tok, "untrained", budget_tokens=8, max_new_tokens=2)
    untrained = RetentionGates(GateConfig.for_model(model), seed=0).fingerprint()
    assert trained.fingerprint() != untrained and chat.attachment.gates.fingerprint() == untrained
    chat.model.retention.detach()


def test_typed_lines_prompt_until_ctrl_d(monkeypatch, capsys):
    from retention import chat_cli as chat_module

    typed = iter(["hello", "/quit"])

    def fake_input(prompt):
        assert prompt == "> "
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert list(chat_module._typed_lines()) == ["hello", "/quit"]


def test_a_template_that_rerenders_the_last_reply_still_chats_incrementally(smollm2):
    """Such templates (Qwen3) used to stop the chat at its second turn with a ChatSetupError. Now only the new turn
    is fed after the reply as generated: the ids are turn 1, reply 1, the new turn, reply 2, and reply 2 is what
    plain generate gives from those ids."""
    import copy

    from transformers import DynamicCache

    from retention.compat import cache_kwargs

    model, tok = smollm2
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=12)
    first = chat.send("My name is Ada.")
    n_first = chat.ids.shape[1]
    second = chat.send("What is my name?")
    text = tok.decode(chat.ids[0], skip_special_tokens=False)
    turn = "<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert text.count("What is my name?") == 1 and text.count("<think>") == 2  # turn 1's block stays as fed
    prompt_end = text.index(turn) + len(turn)
    before, after = text[: text.index(turn)], text[prompt_end:]
    assert before.count(first.strip()) == 1 and before.rstrip().endswith("<|im_end|>")  # reply 1 once, then closed
    assert after.strip().startswith(second.strip())
    n_prompt = len(tok(text[:prompt_end], add_special_tokens=False)["input_ids"])
    assert n_first < n_prompt < chat.ids.shape[1]
    chat.model.retention.detach()
    with torch.no_grad():
        out = model.generate(input_ids=chat.ids[:, :n_prompt], attention_mask=torch.ones(1, n_prompt, dtype=torch.long),
                             **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, n_prompt:], skip_special_tokens=True) == second


def test_chat_template_kwargs_reach_every_turn(smollm2, capsys, monkeypatch):
    """chat_template_kwargs={"enable_thinking": False} (`--chat-template-kwargs`): every reply opens with the empty
    <think> block the template adds for it, the first reply is generate's on the template's own rendering, and later
    turns keep the cache in step (the template drops the block from answered turns). Keys the chat sets itself and
    JSON that is no object are refused, on the command line before the model loads."""
    import copy

    import retention.models
    from retention.chat import ChatSetupError
    from retention.cli import main

    model, tok = smollm2
    tok = copy.deepcopy(tok)
    tok.chat_template = THINKING_SWITCH_TEMPLATE
    off = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=8,
                        chat_template_kwargs={"enable_thinking": False})
    on = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=8)
    first = off.send("Name a colour.")
    for turn in ("Name another.", "Thanks."):
        off.send(turn), on.send(turn)
    text = tok.decode(off.ids[0], skip_special_tokens=False)
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 3
    assert "<think>" not in tok.decode(on.ids[0], skip_special_tokens=False)
    assert off.cache.get_seq_length() == off.ids.shape[1] - 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                     enable_thinking=False, return_tensors="pt", return_dict=True)
    off.model.retention.detach()
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True) == first

    with pytest.raises(ChatSetupError, match="add_generation_prompt, which rendering sets itself"):
        RetentionChat(model, tok, chat_template_kwargs={"add_generation_prompt": False})  # before gates attach
    with pytest.raises(ChatSetupError, match="must be a mapping of template variable names"):
        RetentionChat(model, tok, chat_template_kwargs=[("enable_thinking", False)])
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    for given, message in (("{enable_thinking: false}", "--chat-template-kwargs is not JSON"),
                           ("[1]", "--chat-template-kwargs must be a JSON object"),
                           ('{"tokenize": true}', "--chat-template-kwargs sets tokenize, which rendering sets itself")):
        assert main(["chat", "--chat-template-kwargs", given]) == 2
        assert message in capsys.readouterr().err


def test_a_conversation_past_the_models_positions_is_warned_once(smollm2, capsys):
    """The cache keeps a long chat within its budget, but positions keep growing: past max_position_embeddings the
    model reads RoPE positions it never saw. Warned once per conversation, again after a reset."""
    import warnings

    from retention.chat_cli import chat_loop

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=64, max_new_tokens=4)
    assert chat.max_positions == model.config.max_position_embeddings == 8192
    chat.max_positions = 50  # a short window stands in for 8192 positions (the first turn fills 36)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chat.send("Hi.")  # 32 tokens with the system prompt, 36 with the reply: within 50
        assert not caught
        chat.send("Tell me about rivers and lakes.")
        chat.send("And mountains?")
        chat.reset()
        chat.send("Hi.")
        chat.send("Tell me about rivers and lakes.")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and all("past the model's 50 positions" in m and "/reset" in m for m in messages)
    chat.reset()
    chat_loop(chat, ["Hi.", "Tell me about rivers and lakes.", "And mountains?"])
    err = capsys.readouterr().err
    assert err.count("warning: this conversation may reach") == 1 and "UserWarning" not in err


@pytest.mark.parametrize("kwargs,words", [({"num_beams": 2}, "num_beams=2: a chat keeps one reply per turn"),
                                          ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
                                          ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
                                          ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer >= 1, got 2.5"),
                                          ({"do_sample": True, "temperature": 0.0}, "temperature must be above 0"),
                                          ({"do_sample": True, "top_k": -1}, "top_k must be an integer >= 0"),
                                          ({"do_sample": True, "top_p": float("nan")}, "top_p must be in"),
                                          ({"repetition_penalty": 0}, "repetition_penalty must be above 0"),
                                          ({"top_kk": 5}, "unknown option.s. top_kk"),
                                          ({"streamer": None}, r"streamer: the chat passes it to generate itself "
                                                               r"\(stream\(\) yields the reply"),
                                          ({"inputs": None}, "inputs: the chat passes it to generate itself"),
                                          ({"return_dict_in_generate": True, "output_scores": True},
                                           "return_dict_in_generate: a chat returns the reply's text")])
def test_generation_settings_a_chat_cannot_take_are_refused_before_anything_runs(smollm2, kwargs, words):
    """They failed inside generate's thread with transformers' streamer errors ("TextStreamer only supports batch
    size 1"); now they are named as the chat's, and the session goes on unchanged."""
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=64, max_new_tokens=4)
    chat.send("Hi.")
    seen, messages = chat.memory()["tokens_seen"], list(chat.messages)
    with pytest.raises(ChatInputError, match=words):
        chat.send("Again.", **kwargs)
    assert chat.memory()["tokens_seen"] == seen and chat.messages == messages
    assert chat.send("Again.")
    chat.model.retention.detach()


@pytest.mark.parametrize("kwargs,words", [({"num_beams": 2}, "num_beams=2: a chat keeps one reply per turn"),
                                          ({"num_return_sequences": 3, "do_sample": True}, "num_return_sequences=3"),
                                          ({"return_dict_in_generate": True}, "return_dict_in_generate: a chat")])
def test_a_chat_set_up_for_several_replies_is_refused_at_setup(smollm2, kwargs, words):
    """RetentionChat(..., num_beams=2) was accepted, then every send() refused it: the setting is the chat's, so
    the constructor refuses it, before the gates attach."""
    model, tok = smollm2
    before = getattr(model, "retention", None)
    with pytest.raises(ChatSetupError, match=words):
        RetentionChat(model, tok, budget_tokens=64, **kwargs)
    assert getattr(model, "retention", None) is before  # no gates attached or replaced


def test_chat_command_takes_a_baseline_policy(smollm2, capsys, monkeypatch):
    """`retention chat --policy streamingllm` compares a baseline in the same chat; the gates' own options are
    refused with another policy, before the model loads."""
    import retention.chat_cli as chat_module
    import retention.models
    from retention.cli import main

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["chat", "--policy", "streamingllm", "--sink", "2"]) == 2
    assert "--sink apply to --policy global_gates, not streamingllm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chat", "--policy", "snapkvv"])
    assert "invalid choice: 'snapkvv'" in capsys.readouterr().err

    used = {}
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(chat_module, "chat_loop", lambda chat, lines: used.update(policy=chat.cache.policy))
    for argv, name, sink in ((["--policy", "streamingllm"], "streamingllm", None), ([], "global_gates", 4),
                             (["--sink", "0"], "global_gates", 0)):
        assert main(["chat", "--budget", "32", *argv]) == 0
        assert used["policy"].name == name
        if name == "global_gates":  # the default sink is 4, as in GlobalGatesPolicy
            assert used["policy"].sink == sink
        smollm2[0].retention.detach()


def test_chat_command_samples_only_when_asked(smollm2, capsys, monkeypatch):
    """`retention chat --sample --temperature 0.7 --seed 3`: the chat samples with those settings and the seed makes
    its replies repeat; a sampling flag without --sample, or a value out of range, is refused before the model loads."""
    import retention.chat_cli as chat_module
    import retention.models
    from retention.cli import main

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    for argv, message in ((["--temperature", "0.7"], "--temperature apply when sampling: add --sample"),
                          (["--top-p", "0.9", "--seed", "1"], "--top-p, --seed apply when sampling: add --sample"),
                          (["--sample", "--temperature", "0"], "--temperature must be above 0"),
                          (["--sample", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
                          (["--sample", "--min-p", "-0.1"], "--min-p must be in [0, 1]"),
                          (["--repetition-penalty", "0"], "--repetition-penalty must be above 0")):
        assert main(["chat", *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["chat", "--sample", "--top-k", "-1"])
    assert "must be at least 0" in capsys.readouterr().err

    replies = []
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(chat_module, "chat_loop", lambda chat, lines: replies.append(
        (chat.generation_kwargs, chat.send("Write one line about the sea."))))
    sampled = ["--sample", "--temperature", "1.4", "--top-k", "0", "--top-p", "0.95", "--repetition-penalty", "1.1"]
    for argv in ([*sampled, "--seed", "3"], [*sampled, "--seed", "3"], [*sampled, "--seed", "4"], []):
        assert main(["chat", "--budget", "32", "--max-new-tokens", "16", *argv]) == 0
        smollm2[0].retention.detach()
    assert replies[0][0] == {"do_sample": True, "temperature": 1.4, "top_k": 0, "top_p": 0.95,
                             "repetition_penalty": 1.1}
    assert replies[3][0] == {"do_sample": False}  # greedy by default
    assert replies[0][1] == replies[1][1] and len({r for _, r in replies}) == 3  # the seed repeats; others differ


@pytest.mark.parametrize("graphs", [False, True], ids=["generate", "planned-steps"])
def test_a_turn_that_failed_midway_leaves_no_entries_behind(smollm2, graphs):
    """An error in the middle of a reply (here a stopping criterion that raises on the third token; out of GPU memory
    in life) leaves its prompt and tokens in the cache but not in the conversation: the next turn warns, feeds the
    conversation again, and replies as a chat that never had the failed turn does."""
    from transformers import StoppingCriteria

    class Fails(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kw):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("failed on the third token")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    model, tok = smollm2
    live, clean = (RetentionChat(model, tok, budget_tokens=None, max_new_tokens=12) for _ in range(2))
    if graphs:
        live.cuda_graphs, live._graph_replay = True, False  # the graph path's planned steps, eager (no GPU here)
    assert live.send("My name is Ada.") == clean.send("My name is Ada.")
    with pytest.raises(RuntimeError, match="third token"):
        live.send("Tell me a long story.", stopping_criteria=[Fails()])
    assert live.cache.get_seq_length() > live.ids.shape[1] - 1 and len(live.messages) == 2
    with pytest.warns(UserWarning, match=r"counts the entries of \+\d+ tokens .* failed midway"):
        live.memory()  # counted them silently
    ids, messages = live.ids, list(live.messages)
    feed = live._feed

    def feed_fails(*args):  # the repair's own feed fails once (out of memory again, say) ...
        live._feed = feed
        raise RuntimeError("the repair failed too")

    live._feed = feed_fails
    with pytest.warns(UserWarning, match="failed midway"), pytest.raises(RuntimeError, match="repair failed too"):
        live.send("What is my name?")
    assert torch.equal(live.ids, ids) and live.messages == messages  # ... and the conversation stays whole
    with pytest.warns(UserWarning, match=r"the last turn failed midway\): feeding the conversation's"):
        reply = live.send("What is my name?")
    assert reply == clean.send("What is my name?")
    assert torch.equal(live.ids, clean.ids) and live.messages == clean.messages
    assert live.cache.get_seq_length() == live.ids.shape[1] - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [live.memory()[k] for k in ("tokens_seen", "kept_entries")] == \
            [clean.memory()[k] for k in ("tokens_seen", "kept_entries")]


def test_a_saved_conversation_resumes_where_it_stopped(smollm2, tmp_path, monkeypatch):
    """save() then resume() in a new chat: the same ids, the same cache (keys of every layer), and the next reply equals
    the one the original chat gives; resumed under a budget, the cache keeps to it."""
    model, tok = smollm2
    live = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=10, system="You are brief.")
    for turn in ("My name is Ada and I live in Paris.", "Name one river in France."):
        live.send(turn)
    with pytest.raises(ChatInputError, match=r"is a folder: give the file to save to, e\.g\. .*chat\.json"):
        live.save(tmp_path)  # was an IsADirectoryError naming a temp file beside the folder
    monkeypatch.setenv("HOME", str(tmp_path))  # "/save ~/talk/chat.json" in the chat: no shell expands the ~
    path = live.save("~/talk/chat.json")
    assert path == tmp_path / "talk" / "chat.json" and path.is_file()
    again = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=10, chunk_size=16)
    again.send("Something else first.")  # resume replaces what the chat held
    again.resume("~/talk/chat.json")
    assert torch.equal(again.ids, live.ids) and again.messages == live.messages
    assert again.cache.get_seq_length() == live.cache.get_seq_length() == live.ids.shape[1] - 1
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(again.cache.store.gather_layer(layer).keys,
                                   live.cache.store.gather_layer(layer).keys, atol=1e-4, rtol=1e-4)
    assert again.send("Where do I live?") == live.send("Where do I live?")

    bounded = RetentionChat(model, tok, budget_tokens=16, max_new_tokens=10, chunk_size=16)
    bounded.resume(path)
    streams = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert bounded.cache.evictions > 0 and bounded.memory()["kept_entries"] <= 16 * streams + bounded.cache.slack
    assert isinstance(bounded.send("Where do I live?"), str)


def test_a_transcript_that_cannot_be_resumed_is_refused_and_the_chat_stays(smollm2, tmp_path):
    import json

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=4)
    chat.send("Hello.")
    good = json.loads(chat.save(tmp_path / "good.json").read_text())
    before = chat.ids.clone()
    cases = {
        "missing.json": (None, "no saved conversation at"),
        "junk.json": ("not json", r"is not a saved conversation \(not JSON"),
        "other.json": ({"format": "something"}, "is not a saved conversation"),
        "future.json": ({**good, "version": 99}, "version 99 transcript"),
        "partial.json": ({k: v for k, v in good.items() if k != "ids"}, "lacks ids"),
        "vocab.json": ({**good, "vocab": 1000, "ids": [1, 2]}, "its token ids mean other text here"),
        "damaged.json": ({**good, "ids": [len(tok) + 5]}, "outside its vocabulary"),
        "images.json": ({**good, "image_turns": [{"start": 0, "length": 2, "images": []}]}, "is a text-only model"),
        "turns.json": ({**good, "image_turns": [{"start": 0, "length": 10**6, "images": []}]},
                       "does not fit its token"),
        # the messages were read unchecked: a traceback (TypeError, a Jinja error) once the model had loaded
        "text.json": ({**good, "messages": "x"}, "messages that are no list"),
        "none.json": ({**good, "messages": []}, "messages that are no list"),
        "bare.json": ({**good, "messages": [{"role": "user"}]}, "messages that are no list"),
        "order.json": ({**good, "messages": good["messages"][:1]}, "do not go .system,. user, assistant"),
        "bot.json": ({**good, "messages": [{**m, "role": "bot"} for m in good["messages"]]}, "do not go"),
        "ended.json": ({**good, "reply_ended": "no"}, "reply_ended that is no true/false"),
        "bools.json": ({**good, "ids": [True, False]}, "outside its vocabulary"),
    }
    for name, (content, words) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ChatInputError, match=words):
            chat.resume(tmp_path / name)
        assert torch.equal(chat.ids, before)  # refused before anything changed
    with pytest.warns(UserWarning, match="was saved with someone/other-model"):
        (tmp_path / "renamed.json").write_text(json.dumps({**good, "model": "someone/other-model"}))
        chat.resume(tmp_path / "renamed.json")
    assert torch.equal(chat.ids, before)


def test_save_and_resume_from_the_command_line(smollm2, tmp_path, capsys, monkeypatch):
    """/save in the chat loop, then `retention chat --resume FILE`; a file that is no transcript fails before the
    model loads."""
    import retention.models
    from retention.chat_cli import chat_loop
    from retention.cli import main

    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6)
    chat_loop(chat, [f"/save {tmp_path / 'empty.json'}", "My name is Ada.", "/save", f"/save {tmp_path / 'c.json'}",
                     f"/save {tmp_path}"])
    out, err = capsys.readouterr()
    assert f"[saved 1 turn(s), {chat.ids.shape[1]} tokens to {tmp_path / 'c.json'}]" in out
    assert "nothing to save yet" in err and not (tmp_path / "empty.json").exists()
    assert "/save needs a file" in err and "cannot save" in err

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    (tmp_path / "x.json").write_text("{}")
    assert main(["chat", "--resume", str(tmp_path / "x.json")]) == 2
    assert "is not a saved conversation" in capsys.readouterr().err
    import retention.chat_cli as chat_module

    resumed = {}
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(chat_module, "chat_loop", lambda c, lines: resumed.update(ids=c.ids.clone()))
    assert main(["chat", "--resume", str(tmp_path / "c.json"), "--budget", "64"]) == 0
    assert torch.equal(resumed["ids"], chat.ids)
    assert f"[resumed 1 turn(s), {chat.ids.shape[1]} tokens from {tmp_path / 'c.json'}]" in capsys.readouterr().out
    import json

    saved = json.loads((tmp_path / "c.json").read_text())
    (tmp_path / "renamed.json").write_text(json.dumps({**saved, "model": "someone/other-model"}))
    assert main(["chat", "--resume", str(tmp_path / "renamed.json")]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "was saved with someone/other-model" in err and "UserWarning" not in err
    model.retention.detach()


def test_a_given_history_is_fed_as_the_template_renders_it(smollm2):
    """add_turn() feeds a user turn and a reply given, not generated: the chat's ids are the template's rendering of the
    conversation, its cache holds what one forward over them computes, and the next reply is the one plain generate
    gives over the whole conversation in one prompt. Under a budget the given turns are evicted like any others."""
    from transformers import DynamicCache

    from retention.compat import cache_kwargs

    model, tok = smollm2
    history = [("My name is Ada and I live in Paris.", "Nice to meet you, Ada."),
               ("Name one river in France.", "The Seine flows through Paris.")]
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=10, system="You are brief.", chunk_size=16)
    for text, reply in history:
        chat.add_turn(text, reply)
    messages = [{"role": "system", "content": "You are brief."}]
    for text, reply in history:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    assert chat.messages == messages
    question = messages + [{"role": "user", "content": "Where do I live?"}]
    want = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    n = chat.ids.shape[1]
    assert chat.cache.get_seq_length() == n - 1
    assert torch.equal(chat.ids[0], want["input_ids"][0, :n])  # the rendering's prefix, closing stop token included
    reference = DynamicCache()
    with torch.no_grad(), chat.attachment.use_mode("teacher"):
        model(input_ids=chat.ids[:, : n - 1], **cache_kwargs(reference), use_cache=True)
    for layer in range(model.config.num_hidden_layers):
        got = chat.cache.store.gather_layer(layer).keys[0]  # (H, slots, D)
        torch.testing.assert_close(got[:, : n - 1], reference.layers[layer].keys[0], atol=1e-4, rtol=1e-4)
    reply = chat.send("Where do I live?")
    chat.model.retention.detach()
    with torch.no_grad():
        out = model.generate(**want, max_new_tokens=10, do_sample=False)
    assert reply == tok.decode(out[0, want["input_ids"].shape[1]:], skip_special_tokens=True)

    empty = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=4)
    empty.add_turn("Say nothing.", "")  # an empty reply is closed too: the next turn follows the template
    empty.add_turn("Now say hi.", "Hi.")
    rendered = tok.apply_chat_template([{"role": "user", "content": "Say nothing."},
                                        {"role": "assistant", "content": ""},
                                        {"role": "user", "content": "Now say hi."},
                                        {"role": "assistant", "content": "Hi."}],
                                       return_tensors="pt", return_dict=True)["input_ids"][0]
    assert torch.equal(empty.ids[0], rendered[: empty.ids.shape[1]]) and empty.ids.shape[1] >= len(rendered) - 1

    bounded = RetentionChat(model, tok, budget_tokens=8, max_new_tokens=4, chunk_size=8)
    for text, reply in history * 3:
        bounded.add_turn(text, reply)
    streams = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert bounded.cache.evictions > 0 and bounded.memory()["kept_entries"] <= 8 * streams + bounded.cache.slack
    with pytest.raises(ChatInputError, match="text-only"):
        bounded.add_turn("Look.", "I see.", images=["x.png"])
    assert len(bounded.messages) == 12  # the refused turn changed nothing


def test_given_turns_under_a_template_that_rerenders_the_last_reply(smollm2):
    """add_turn() with a Qwen3-like template: each given reply is fed once and closed once (its stop token, then the
    next turn), as send() feeds a generated one, and the chat goes on."""
    import copy

    model, tok = smollm2
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6)
    chat.add_turn("My name is Ada.", "Hello Ada.")
    chat.add_turn("I live in Paris.", "Paris is lovely.")
    assert isinstance(chat.send("Where do I live?"), str)
    text = tok.decode(chat.ids[0], skip_special_tokens=False)
    for said in ("My name is Ada.", "Hello Ada.", "I live in Paris.", "Paris is lovely.", "Where do I live?"):
        assert text.count(said) == 1
    assert "Hello Ada.<|im_end|>\n<|im_start|>user\nI live in Paris." in text
    assert "Paris is lovely.<|im_end|>\n<|im_start|>user\nWhere do I live?" in text
    assert "<|im_end|><|im_end|>" not in text and chat.cache.get_seq_length() == chat.ids.shape[1] - 1
    chat.add_turn("Be silent now.", "")  # an empty reply: found by its place in the template, not by its text
    assert isinstance(chat.send("Still there?"), str)
    text = tok.decode(chat.ids[0], skip_special_tokens=False)
    assert ("Be silent now.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_end|>\n"
            "<|im_start|>user\nStill there?" in text)


def test_a_conversation_log_goes_on_from_the_command_line(smollm2, tmp_path, capsys, monkeypatch):
    """`retention chat --history FILE`: a JSON log (messages, or ShareGPT conversations) is fed with add_turn, its
    system message becoming the chat's; the chat then holds what a chat fed turn by turn holds. Logs that cannot be
    fed fail before the model loads, each with its problem named."""
    import json

    from PIL import Image

    import retention.chat_cli as chat_module
    import retention.models
    from retention.chat import read_history
    from retention.cli import main

    model, tok = smollm2
    log = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "My name is Ada."},
           {"role": "assistant", "content": "Hello Ada."}, {"role": "user", "content": ["Hi."]},  # a bare string part
           {"role": "assistant", "content": "Hi again."}]
    (tmp_path / "log.json").write_text(json.dumps(log))
    sharegpt = {"conversations": [{"from": "human", "value": "My name is Ada."},
                                  {"from": "gpt", "value": "Hello Ada."}]}
    (tmp_path / "share.json").write_text(json.dumps(sharegpt))
    assert read_history(tmp_path / "log.json") == ("You are brief.", [("My name is Ada.", "Hello Ada.", []),
                                                                      ("Hi.", "Hi again.", [])])
    assert read_history(tmp_path / "share.json") == (None, [("My name is Ada.", "Hello Ada.", [])])

    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    bad = {"open.json": [{"role": "user", "content": "hi"}], "roles.json": [{"speaker": "x", "text": "hi"}],
           "photo.json": [{"role": "user", "content": [{"type": "image", "image": "nowhere.png"}]},
                          {"role": "assistant", "content": "ok"}],
           "saved.json": {"format": "retention-chat"},
           # was an AttributeError
           "parts.json": [{"role": "user", "content": [3]}, {"role": "assistant", "content": "ok"}],
           # a TypeError (unhashable role), and a number or a dict fed as its repr
           "listrole.json": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "x"}],
           "number.json": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    bad["shown.json"] = [{"role": "user", "content": [{"type": "image", "image": "photo.png"},
                                                      {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": "A square."}]  # a photo that exists, for a text-only model
    words = {"open.json": "end with a reply", "roles.json": "give each message a role",
             "photo.json": "nowhere.png not found", "saved.json": "--resume",
             "shown.json": "smollm2-135m is a text-only model",
             "parts.json": "parts.json, message 0: a content list holds",
             "listrole.json": "give each message a role", "number.json": "a content is text or a list of parts"}
    for name, data in bad.items():
        (tmp_path / name).write_text(json.dumps(data))
        assert main(["chat", "--history", str(tmp_path / name)]) == 2
        assert words[name] in capsys.readouterr().err
    assert main(["chat", "--history", str(tmp_path / "log.json"), "--resume", str(tmp_path / "log.json")]) == 2
    assert "give one" in capsys.readouterr().err
    # --system beside a log that has its own was dropped without a word (and --resume dropped it always)
    assert main(["chat", "--history", str(tmp_path / "log.json"), "--system", "Be long."]) == 2
    assert "starts with a system prompt of its own" in capsys.readouterr().err
    assert main(["chat", "--resume", str(tmp_path / "log.json"), "--system", "Be long."]) == 2
    assert "goes on with the system prompt it was saved with" in capsys.readouterr().err

    fed = {}
    monkeypatch.setattr(retention.models, "load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(chat_module, "chat_loop", lambda c, lines: fed.update(ids=c.ids.clone(), system=c.system))
    assert main(["chat", "--history", str(tmp_path / "log.json"), "--budget", "64"]) == 0
    by_hand = RetentionChat(model, tok, budget_tokens=None, system="You are brief.")
    by_hand.add_turn("My name is Ada.", "Hello Ada.")
    by_hand.add_turn("Hi.", "Hi again.")
    assert torch.equal(fed["ids"], by_hand.ids) and fed["system"] == "You are brief."
    assert f"[fed 2 turn(s), {by_hand.ids.shape[1]} tokens from {tmp_path / 'log.json'}]" in capsys.readouterr().out
    model.retention.detach()


def test_a_reply_stopped_by_a_list_of_eos_ids_is_recorded(smollm2):
    """send(..., eos_token_id=[...]) as generate takes it: the turn is recorded (the list used to crash the commit,
    after the reply had been generated), and a reply that ended on one of the ids counts as ended."""
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=24)
    reply = chat.send("Say hello.", eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("!")])
    assert (chat.messages[-1] == {"role": "assistant", "content": reply}
            and chat.cache.get_seq_length() == chat.ids.shape[1] - 1)
    assert chat._last_reply_ended == (int(chat.ids[0, -1]) in (tok.eos_token_id, tok.convert_tokens_to_ids("!")))
    assert isinstance(chat.send("Again."), str)


def test_a_reply_ended_on_a_stop_id_the_template_does_not_close_with_is_closed_as_rendered(smollm2):
    """A reply that ended on a given stop id other than the template's closer ("!" in eos_token_id=[..., "!"]) is
    closed as the template renders it: the next turn fed nothing of <|im_end|>\\n, so the model read "...!<|im_start|>
    user" and every later turn ran on a conversation the template never writes."""
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=24)
    chat.send("Say hello.", eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("!")])
    assert chat._last_reply_ended and chat.messages[-1]["content"].endswith("!")
    chat.send("Again.", max_new_tokens=1)
    prompt = tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True, tokenize=False)
    want = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(chat.ids[:, : want.shape[1]], want) and chat.ids.shape[1] == want.shape[1] + 1
    model.retention.detach()


def test_a_pad_token_id_given_is_taken_as_generate_takes_it(smollm2):
    """pad_token_id, as generate takes it (model.generate(..., pad_token_id=tok.eos_token_id) is a common habit), was
    passed twice to generate: a TypeError at every turn, from the constructor's options too, after the chat had
    taken them."""
    model, tok = smollm2
    plain = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6)
    given = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6, pad_token_id=tok.eos_token_id)
    assert given.send("Hi.") == plain.send("Hi.")
    assert given.send("Again.", pad_token_id=0) == plain.send("Again.")
    assert torch.equal(given.ids, plain.ids)
    model.retention.detach()


def test_a_generation_config_asking_for_an_output_object_still_chats(smollm2):
    """A model whose generation config sets return_dict_in_generate made generate return an output object, which the
    commit indexed as ids: a TypeError after every reply, its entries left in the cache."""
    model, tok = smollm2
    plain = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6)
    reply = plain.send("Hi.")
    model.generation_config.return_dict_in_generate = True
    try:
        chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=6)
        assert chat.send("Hi.") == reply and torch.equal(chat.ids, plain.ids)
        assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1
    finally:
        model.generation_config.return_dict_in_generate = False
        model.retention.detach()


def test_stop_strings_stop_the_reply_with_the_chats_tokenizer(smollm2):
    """stop_strings, as generate takes them, failed at every turn: generate needs the tokenizer to find them, which
    the chat has and did not pass. The reply now ends on the string, and the next turn closes it as the template
    renders it."""
    model, tok = smollm2
    chat = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=30)
    whole = RetentionChat(model, tok, budget_tokens=None, max_new_tokens=30).send("Tell me about rivers.")
    assert "," in whole[:-1]
    reply = chat.send("Tell me about rivers.", stop_strings=[","])
    assert reply == whole[: whole.index(",") + 1] and not chat._last_reply_ended
    chat.send("Go on.", max_new_tokens=1)
    prompt = tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True, tokenize=False)
    want = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert torch.equal(chat.ids[:, : want.shape[1]], want)
    model.retention.detach()


def test_a_bad_policy_or_cuda_graphs_on_the_cpu_is_refused_before_the_gates_attach(smollm2):
    """An unknown policy name or cuda_graphs on the CPU failed after the chat had attached its gates: a failed
    RetentionChat(model, tok, "untrained", policy="snapKV!") left untrained gates on the model, and the next
    RetentionChat(model, tok) kept them (gates=None keeps what is attached) instead of the shipped ones."""
    model, tok = smollm2
    for given, words in ((dict(policy="snapKV!"), r"unknown policy 'snapKV!'; available: \[.*'snapkv'"),
                         (dict(cuda_graphs=True), "cuda_graphs .--cuda-graphs.: the model is on the CPU")):
        with pytest.raises(ChatSetupError, match=words):
            RetentionChat(model, tok, "untrained", budget_tokens=64, **given)
        assert getattr(model, "retention", None) is None
    chat = RetentionChat(model, tok, budget_tokens=64, policy="snapkv")
    assert chat.cache.policy.name == "snapkv"
    model.retention.detach()
