"""Standard long-context sets from the Hub as :class:`~retention.tasks.Item` lists (for GPU users).

=============  ==========================  ===========================================================
set            Hub source                  fields used
=============  ==========================  ===========================================================
RULER          ``simonjegou/ruler``        config = context length ("4096", ...), split ``test``:
               (kvpress' export)           ``context, question, answer_prefix, answer (list), task,
                                           max_new_tokens``
LongBench v1   ``THUDM/LongBench``         ``data.zip`` -> ``data/<subset>.jsonl`` (the Hub repo is a
                                           loading script, which ``datasets`` >= 4 no longer runs):
                                           ``input, context, answers, all_classes, _id``
LongBench v2   ``THUDM/LongBench-v2``      split ``train``: ``_id, question, choice_A..D, answer
                                           (letter), context, domain, difficulty, length``
MMDU           ``laolao77/MMDU``           ``benchmark.json``: ``{id: {id, image: [paths],
                                           conversations: [{from: user|assistant, value}]}}`` with
                                           ``<ImageHere>`` markers
=============  ==========================  ===========================================================

Each loader takes ``data_files=`` (a local copy in the same format: what the tests and offline users
do) instead of the Hub. Items follow the query-agnostic layout: the document is the ``context``, the
question comes after it.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from retention.tasks import Item

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUB = {
    "ruler": "simonjegou/ruler",
    "longbench": "THUDM/LongBench",
    "longbench_v2": "THUDM/LongBench-v2",
    "mmdu": "laolao77/MMDU",
}


class DatasetUnavailableError(RuntimeError):
    """A Hub set cannot be read here; the message says how to use a local copy."""


def _hub_error(name: str, e: Exception) -> DatasetUnavailableError:
    return DatasetUnavailableError(
        f"cannot load {HUB[name]!r} from the Hub ({type(e).__name__}: {e}); download it where the Hub is "
        "reachable and pass data_files= (same format)")


def _load_rows(name: str, config: str | None, split: str, data_files: Any, revision: str | None = None):
    import datasets

    if data_files is not None:
        return datasets.load_dataset("json", data_files=data_files, split="train")
    try:
        return datasets.load_dataset(HUB[name], config, split=split, revision=revision)
    except Exception as e:  # offline, gated, unknown config: one clear error
        raise _hub_error(name, e) from None


def _take(rows, limit: int | None):
    for i, r in enumerate(rows):
        if limit is not None and i >= limit:
            return
        yield i, r


# --- RULER -----------------------------------------------------------------------------------------
def load_ruler(length: int | str = 4096, split: str = "test", data_files: Any = None, limit: int | None = None,
               tasks: list[str] | None = None, revision: str | None = None) -> list[Item]:
    """RULER at one context length (kvpress' Hub export); ``tasks`` filters, e.g. ``["niah_single_1"]``. Scored with
    RULER's own plain substring match (:func:`retention.eval.metrics.substring`), as its published numbers are."""
    rows = _load_rows("ruler", str(length), split, data_files, revision)
    items = []
    for i, r in _take((r for r in rows if tasks is None or r["task"] in tasks), limit):
        answers = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
        items.append(Item(f"ruler/{r['task']}", f"ruler-{length}-{i}", r["context"], r["question"], list(answers),
                          answer_prefix=r.get("answer_prefix") or "", max_new_tokens=r.get("max_new_tokens"),
                          metric="substring"))
    return items


# --- LongBench v1 ----------------------------------------------------------------------------------
# subset -> (metric, max_new_tokens, instruction after the context); English subsets of LongBench.
LONGBENCH = {
    "narrativeqa": ("f1", 128, "Answer the question based on the story above as concisely as you can, using a "
                               "single phrase if possible."),
    "qasper": ("f1", 128, "Answer the question based on the article above as concisely as you can, using a single "
                          "phrase or sentence if possible. If it cannot be answered, write \"unanswerable\"; if it is "
                          "a yes/no question, answer \"yes\", \"no\", or \"unanswerable\"."),
    "multifieldqa_en": ("f1", 64, "Answer the question based on the text above. Only give me the answer and do not "
                                  "output any other words."),
    "hotpotqa": ("f1", 32, "Answer the question based on the passages above. Only give me the answer and do not "
                           "output any other words."),
    "2wikimqa": ("f1", 32, "Answer the question based on the passages above. Only give me the answer and do not "
                           "output any other words."),
    "musique": ("f1", 32, "Answer the question based on the passages above. Only give me the answer and do not "
                          "output any other words."),
    "gov_report": ("rouge_l", 512, "Write a one-page summary of the report above."),
    "qmsum": ("rouge_l", 512, "Answer the query based on the meeting transcript above in one or more sentences."),
    "multi_news": ("rouge_l", 512, "Write a one-page summary of all the news above."),
    "trec": ("recall", 64, "Determine the type of the question, following the examples above."),
    "triviaqa": ("f1", 32, "Answer the question, following the examples above."),
    "samsum": ("rouge_l", 128, "Summarize the dialogue, following the examples above."),
    "passage_count": ("recall", 32, "How many unique paragraphs are there among those above, after removing "
                                    "duplicates? Answer with the number only."),
    "passage_retrieval_en": ("recall", 32, "Which paragraph above does the following abstract come from? Answer in "
                                           "the format \"Paragraph 1\"."),
    "lcc": ("edit_sim", 64, "Complete the next line of the code above."),
    "repobench-p": ("edit_sim", 64, "Complete the next line of the code above."),
}


def _longbench_file(subset: str, data_files: Any) -> Any:
    """A jsonl of the subset: ``data_files`` as given, a local ``data.zip``, or the Hub's ``data.zip``."""
    if data_files is not None and not str(data_files).endswith(".zip"):
        return data_files
    if data_files is None:
        try:
            from huggingface_hub import hf_hub_download

            data_files = hf_hub_download(HUB["longbench"], "data.zip", repo_type="dataset")
        except Exception as e:
            raise _hub_error("longbench", e) from None
    out = Path(data_files).with_suffix("")  # extracted beside the archive
    target = out / "data" / f"{subset}.jsonl"
    if not target.is_file():
        with zipfile.ZipFile(data_files) as z:
            z.extract(f"data/{subset}.jsonl", out)
    return str(target)


def load_longbench(subset: str = "hotpotqa", data_files: Any = None, limit: int | None = None) -> list[Item]:
    """One English LongBench subset; scored with its official kind of metric (F1, ROUGE-L, ...)."""
    if subset not in LONGBENCH:
        raise ValueError(f"unknown LongBench subset {subset!r}; English subsets: {sorted(LONGBENCH)}")
    metric, max_new, instruction = LONGBENCH[subset]
    rows = _load_rows("longbench", None, "train", _longbench_file(subset, data_files))
    items = []
    for i, r in _take(rows, limit):
        question = f"{instruction}\n\n{r['input']}".strip() if r.get("input") else instruction
        items.append(Item(f"longbench/{subset}", str(r.get("_id") or f"{subset}-{i}"), r["context"], question,
                          list(r["answers"]), metric=metric, max_new_tokens=max_new))
    return items


# --- LongBench v2 ----------------------------------------------------------------------------------
def load_longbench_v2(split: str = "train", data_files: Any = None, limit: int | None = None,
                      difficulty: str | None = None, revision: str | None = None) -> list[Item]:
    """Multiple choice over long contexts; the reply's letter is compared with the answer's."""
    rows = _load_rows("longbench_v2", None, split, data_files, revision)
    items = []
    for i, r in _take((r for r in rows if difficulty is None or r.get("difficulty") == difficulty), limit):
        choices = "\n".join(f"({c}) {r[f'choice_{c}']}" for c in "ABCD")
        q = (f"What is the correct answer to this question: {r['question']}\nChoices:\n{choices}\n\n"
             "Format your response as follows: \"The correct answer is (insert answer here)\".")
        items.append(Item("longbench_v2", r["_id"], r["context"], q, [r["answer"]], metric="choice",
                          answer_prefix="The correct answer is", max_new_tokens=8,
                          meta={"domain": r.get("domain"), "difficulty": r.get("difficulty"),
                                "length": r.get("length")}))
    return items


# --- MMDU ------------------------------------------------------------------------------------------
def _mmdu_records(data_files: Any) -> tuple[list[dict], str]:
    """The benchmark's records and the file they were read from."""
    if data_files is None:
        try:
            from huggingface_hub import hf_hub_download

            data_files = hf_hub_download(HUB["mmdu"], "benchmark.json", repo_type="dataset")
        except Exception as e:
            raise _hub_error("mmdu", e) from None
    text = Path(data_files).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON lines
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):  # {id: record} (the benchmark file), or one record (JSON lines of one row)
        return ([data] if "conversations" in data else list(data.values())), str(data_files)
    return list(data), str(data_files)


def load_mmdu(data_files: Any = None, limit: int | None = None, turns: str = "last",
              image_root: str | Path | None = None, max_new_tokens: int = 512) -> list[Item]:
    """MMDU dialogues: one item per dialogue (``turns="last"``: the last question, earlier turns with
    their reference answers as history) or per question (``turns="all"``).

    Image markers become ``<image k>`` text in ``messages`` and the paths go to ``meta["images"]``, in
    order, relative to ``image_root`` (default: the data file's folder) as ``meta["image_root"]``; a sweep runs them
    through :mod:`retention.eval.multimodal` with a vision-language model (``tasks: [mmdu]``). The default metric is
    ROUGE-L against the reference answer, after a reply of at most ``max_new_tokens`` tokens (MMDU's answers are
    long; a sweep's own ``max_new_tokens`` does not cut them); MMDU's judged score plugs in with
    :func:`retention.eval.metrics.register_metric` (see :func:`mmdu_judge`).
    """
    if turns not in ("last", "all"):
        raise ValueError(f"turns must be 'last' or 'all', got {turns!r}")
    items = []
    records, source = _mmdu_records(data_files)
    root = str(Path(image_root).expanduser() if image_root is not None else Path(source).parent)
    for rec in records[:limit]:
        images = list(rec.get("image") or rec.get("images") or [])
        k = 0
        msgs = []
        for t in rec["conversations"]:
            text = t["value"]
            while "<ImageHere>" in text or "<image>" in text:
                marker = "<ImageHere>" if "<ImageHere>" in text else "<image>"
                k += 1
                text = text.replace(marker, f"<image {k}>", 1)
            msgs.append({"role": "user" if t["from"] in ("user", "human") else "assistant", "content": text})
        asks = [j for j, m in enumerate(msgs) if m["role"] == "user" and j + 1 < len(msgs)]
        for j in (asks[-1:] if turns == "last" else asks):
            items.append(Item("mmdu", f"mmdu-{rec.get('id', len(items))}-{j // 2}", "", msgs[j]["content"],
                              [msgs[j + 1]["content"]], messages=msgs[:j], metric="rouge_l",
                              max_new_tokens=max_new_tokens, meta={"images": images, "image_root": root}))
    return items


def mmdu_judge(complete: Callable[[str], str]) -> Callable[[str, list[str]], float]:
    """A judged metric from any text-completion function (an API client, a local judge model).

    The judge compares the reply with the reference and gives an overall score from 0 to 10 (MMDU's
    judge rates creativity, richness, visual perception, logical coherence, answer accuracy and image
    relationship understanding); returned as a percentage. Register it with
    ``register_metric("mmdu_judge", mmdu_judge(complete))`` and set ``item.metric = "mmdu_judge"``.
    """
    import re

    def metric(reply: str, answers: list[str]) -> float:
        prompt = ("You are judging an assistant's answer in a multi-image, multi-turn dialogue against a reference "
                  "answer. Rate creativity, richness, visual perception, logical coherence, answer accuracy and "
                  "image relationship understanding, then give an overall score from 0 to 10 on the last line as "
                  f"'Overall Score: X'.\n\nReference answer:\n{answers[0]}\n\nAssistant's answer:\n{reply}\n")
        m = re.search(r"Overall Score:\s*([0-9]+(?:\.[0-9]+)?)", complete(prompt))
        return 10.0 * min(10.0, float(m.group(1))) if m else 0.0

    return metric


# --- the Hub sets as sweep tasks -------------------------------------------------------------------
# ``tasks: [{name: longbench, params: {subset: hotpotqa}}]`` in an eval config: ``items`` is the number of
# records taken (of each RULER task), and each entry of ``lengths`` is RULER's context-length config, or for LongBench
# the most context tokens kept (the middle cut out, as LongBench's own pred.py truncates). MMDU's dialogues are
# multimodal and run whole through :mod:`retention.eval.multimodal` (a vision-language model; ``lengths`` do not cut
# them: their rows carry the first length).
HUB_TASKS: dict[str, Callable[..., list[Item]]] = {
    "ruler": load_ruler, "longbench": load_longbench, "longbench_v2": load_longbench_v2, "mmdu": load_mmdu,
}


def check_hub_task(name: str, params: dict[str, Any]) -> None:
    """ValueError naming the problem when ``params`` do not fit the loader (before a model or a download)."""
    import inspect

    loader = HUB_TASKS[name]
    taken = {"limit"} | ({"length"} if name == "ruler" else set())  # set by the sweep's items / lengths
    if set(params) & taken:
        raise ValueError(f"{name}: {sorted(set(params) & taken)} come from the sweep's items / lengths, not params")
    try:
        inspect.signature(loader).bind(**params)
    except TypeError as e:
        accepted = sorted(set(inspect.signature(loader).parameters) - taken)
        raise ValueError(f"{name}: {e}; its params are {accepted}") from None
    if name == "mmdu" and params.get("turns", "last") not in ("last", "all"):
        raise ValueError(f"mmdu: turns must be 'last' (the last question of each dialogue) or 'all' (every question), "
                         f"got {params['turns']!r}")
    if name == "longbench" and params.get("subset", "hotpotqa") not in LONGBENCH:
        raise ValueError(f"longbench: unknown subset {params['subset']!r}; English subsets: {sorted(LONGBENCH)}")


def truncate_middle(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> str:
    """``text`` cut to at most ``max_tokens`` tokens by dropping its middle (LongBench's truncation)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[len(ids) - (max_tokens - half):], skip_special_tokens=True)


def hub_task_items(name: str, tokenizer: PreTrainedTokenizerBase | None, length: int, n: int,
                   **params: Any) -> list[Item]:
    """``n`` items of a Hub set for a sweep at ``length`` (see :data:`HUB_TASKS`); ``tokenizer=None`` only fetches
    (so a sweep downloads, or fails offline, before its model loads)."""
    if name == "ruler":  # RULER's items are made for that length; n of each of its tasks (its rows come task by task)
        taken: dict[str, int] = {}
        items = []
        for it in load_ruler(length, **params):
            if taken.get(it.task, 0) < n:
                taken[it.task] = taken.get(it.task, 0) + 1
                items.append(it)
        return items
    items = HUB_TASKS[name](limit=n, **params)
    if tokenizer is None or name == "mmdu":  # dialogues with images run whole (retention.eval.multimodal)
        return items
    # the id names the length: an item cut to two lengths is two items (a shared prefill must tell them apart)
    return [replace(it, id=f"{it.id}@{length}", context=truncate_middle(tokenizer, it.context, length)) for it in items]
