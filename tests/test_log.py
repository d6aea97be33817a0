"""The toolkit's messages go through logging (issue 76): same lines as before on stdout, and a user can silence or
redirect them."""

import io
import logging

import pytest

import retention  # noqa: F401  (installs the handler)


@pytest.fixture
def restore_level():
    logger = logging.getLogger("retention")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_messages_read_as_before_on_stdout(capsys, restore_level):
    logging.getLogger("retention.train.loop").info("resumed from x at step 3")
    logging.getLogger("retention.eval.runner").warning("a damaged line")
    assert capsys.readouterr().out == "[retention] resumed from x at step 3\n[eval] warning: a damaged line\n"


def test_a_user_can_silence_and_redirect_them(capsys, restore_level):
    logger = restore_level
    logger.setLevel(logging.WARNING)
    logging.getLogger("retention.models").info("dequantising once")
    assert capsys.readouterr().out == ""
    sink = io.StringIO()
    logger.handlers[:] = [logging.StreamHandler(sink)]
    logging.getLogger("retention.train.checkpoint").warning("skips step-4")
    assert sink.getvalue() == "skips step-4\n" and capsys.readouterr().out == ""


def test_nothing_is_printed_twice_under_basic_config(capsys, restore_level):
    root = logging.getLogger()
    handler = logging.StreamHandler()  # stderr, as basicConfig sets up
    root.addHandler(handler)
    try:
        logging.getLogger("retention.train").info("gates exported to d")
    finally:
        root.removeHandler(handler)
    out = capsys.readouterr()
    assert out.out == "[retention] gates exported to d\n" and out.err == ""


def test_tracker_hyperparameters_are_flat_keys_with_their_types():
    from retention.train.preflight import tracker_hparams

    flat = tracker_hparams({"train": {"lr": 0.05, "steps": 12, "resume_fix": None, "bf16": True},
                            "budget": {"tokens_per_head": 4},
                            "data": {"sources": [{"kind": "text", "path": "a"}], "lengths": [1, 2]}})
    assert flat == {"train.lr": 0.05, "train.steps": 12, "train.resume_fix": "none", "train.bf16": True,
                    "budget.tokens_per_head": 4, "data.sources.0.kind": "text", "data.sources.0.path": "a",
                    "data.lengths": "[1, 2]"}
