"""``retention chat``: a terminal conversation over one bounded :class:`~retention.chat.RetentionChat`.

The command's flags, the checks that run before the model loads, and the loop over typed lines (messages and
``/`` commands: :data:`CHAT_COMMANDS`).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch

from .attach import unwrap
from .chat import (ChatInputError, ChatSetupError, RetentionChat, generation_value_problem, read_history,
                   read_transcript)
from .templates import template_variables_problem

CHAT_COMMANDS = ("/image PATH attaches an image to the next message (vision-language models), /save FILE writes the "
                 "conversation (retention chat --resume FILE goes on with it), /memory, /reset, /help, /quit (or "
                 "/exit); begin a message with // to send one that starts with /; Ctrl-C stops a reply")


def _memory_line(report: dict[str, Any]) -> str:
    """The line printed after each turn: KV memory, the entries kept (split as text + image for a vision-language
    chat, :meth:`RetentionChat.memory`) of a full cache's, and the tokens seen."""
    if report.get("kept_image_entries") is not None:
        kept = f"{report['kept_text_entries']:,} text + {report['kept_image_entries']:,} image entries"
    else:
        kept = f"{report['kept_entries']:,} entries"
    return (f"[kv {report['kv_bytes'] / 2**20:.2f} MiB of {report['full_cache_bytes'] / 2**20:.2f} MiB full; "
            f"kept: {kept} of {report['full_cache_entries']:,}; {report['tokens_seen']} tokens seen]")


def _extent(chat: RetentionChat) -> str:
    return f"{sum(m['role'] == 'user' for m in chat.messages)} turn(s), {chat.ids.shape[1]:,} tokens"


def _show_warnings(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        print(f"\nwarning: {w.message}", file=sys.stderr)
    caught.clear()


def chat_loop(chat: RetentionChat, lines: Iterable[str]) -> None:
    """``retention chat``'s loop over ``lines``: each a message or a command (:data:`CHAT_COMMANDS`). Replies stream to
    stdout, errors go to stderr; a mistyped command is named, never sent to the model as a message, and a message
    the chat refuses (an image for a text-only model, say) is reported as not sent."""
    pending: list[Any] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and not line.startswith("//"):
            command, _, arg = line.partition(" ")
            if command in ("/quit", "/exit"):
                break
            if command == "/reset":
                chat.reset()
                pending = []
                print("[conversation and cache cleared]")
            elif command == "/memory":
                print(_memory_line(chat.memory()))
            elif command == "/save" and not arg.strip():
                print("error: /save needs a file: /save chat.json", file=sys.stderr)
            elif command == "/save":
                try:
                    saved = chat.save(arg.strip())
                    print(f"[saved {_extent(chat)} to {saved}]")
                except (ChatInputError, OSError) as e:
                    print(f"error: cannot save: {e}", file=sys.stderr)
            elif command == "/help":
                print(CHAT_COMMANDS)
            elif command == "/image" and not chat.multimodal:  # say so now, not after the next message is typed
                print(f"error: {type(unwrap(chat.model)).__name__} is a text-only model: /image needs a "
                      "vision-language model (--model Qwen/Qwen3-VL-2B-Instruct, for example)", file=sys.stderr)
            elif command == "/image" and not arg.strip():
                print("error: /image needs a path: /image photo.jpg", file=sys.stderr)
            elif command == "/image":
                from .images import open_rgb

                try:
                    pending.append(open_rgb(arg.strip()))
                    print(f"[{len(pending)} image(s) attached to the next message]")
                except OSError as e:
                    print(f"error: cannot open image: {e}", file=sys.stderr)
            else:
                print(f"error: unknown command {command}; {CHAT_COMMANDS}", file=sys.stderr)
            continue
        text = line[1:] if line.startswith("//") else line
        turns, shown = len(chat.messages), []
        try:
            reply = chat.stream(text, pending)
            try:
                with warnings.catch_warnings(record=True) as caught:  # shown as a line, not a source location
                    warnings.simplefilter("always")
                    try:
                        for piece in reply:
                            _show_warnings(caught)
                            print(piece, end="", flush=True)
                            shown.append(piece)
                    finally:
                        _show_warnings(caught)
            except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat (the reply so far is kept)
                reply.close()  # a Ctrl-C between pieces leaves the stream open: closing it keeps the reply
                # the streamer holds back a word's start, and tokens made before the stop landed are kept too: show
                # the reply as kept, so the screen and a /save agree
                kept = chat.messages[-1]["content"] if len(chat.messages) > turns else "".join(shown)
                said = "".join(shown)
                print(kept[len(said):] if kept.startswith(said) else f"\n[kept as the reply: {kept}]", end="")
                print(" [stopped]", end="")
            print()
            print(_memory_line(chat.memory()))
        except (ChatInputError, ChatSetupError) as e:  # nothing was sent; the cache is as before
            dropped = f" (its {len(pending)} image(s) dropped too: attach them again)" if pending else ""
            print(f"error: {e}; the message was not sent{dropped}", file=sys.stderr)
        except RuntimeError as e:  # out of GPU memory, say: the turn is not kept, the conversation before it is
            print(f"\nerror: the turn failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); it is "
                  "not kept. The conversation so far is: /save FILE keeps it, and the next message feeds it again",
                  file=sys.stderr)
        pending = []


def _chat_command(args: argparse.Namespace) -> int:
    from .models import load_model
    from .policies import GlobalGatesPolicy, get_policy

    gate_options = {"sink": args.sink, "recent": args.recent}
    try:  # the policy checks its options before the model loads
        if args.policy == "global_gates":
            policy = GlobalGatesPolicy(**{k: v for k, v in gate_options.items() if v is not None})  # else its defaults
        else:
            given = [f"--{k}" for k, v in gate_options.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply to --policy global_gates, not {args.policy}")
            policy = get_policy(args.policy)
        generation = _generation_options(args)
        template = _template_options(args.chat_template_kwargs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .commands import check_gates_source, model_placement

    device, dtype = model_placement(args)  # a device this machine lacks fails before the model loads
    if args.cuda_graphs and torch.device(device).type != "cuda":
        print(f"error: --cuda-graphs needs a CUDA GPU (the model goes to {device}); leave it out", file=sys.stderr)
        return 2
    gates = check_gates_source(args.gates, args.model)  # so does a bad --gates (retention.cli prints both)
    history = None
    try:  # and a file that is no saved conversation, or no conversation log
        if args.resume and args.history:
            raise ChatInputError("--resume and --history both start the conversation: give one")
        if args.resume and args.system is not None:  # it was dropped without a word
            raise ChatInputError(f"--system: the conversation in {args.resume} goes on with the system prompt it was "
                                 "saved with; leave --system out")
        shown = None  # the file whose turns hold images: a text-only model cannot take them
        if args.resume and read_transcript(args.resume)["image_turns"]:
            shown = args.resume
        if args.history:
            history = read_history(args.history)
            if args.system is not None and history[0] is not None and history[0] != args.system:  # --system won
                raise ChatInputError(f"--system: {args.history} starts with a system prompt of its own; leave "
                                     "--system out, or edit the file's")
            shown = args.history if any(images for _, _, images in history[1]) else None
        if shown is not None:
            _check_shows_images(args.model, shown)
    except ChatInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, processor = load_model(args.model, device=device, dtype=dtype)
    try:
        with warnings.catch_warnings(record=True) as caught:  # printed as lines, as in the chat loop
            warnings.simplefilter("always")
            try:
                chat = RetentionChat(
                    model, processor, args.gates if gates is None else gates, budget_tokens=args.budget,
                    chunk_size=args.chunk_size, max_new_tokens=args.max_new_tokens,
                    system=args.system or (history[0] if history else None), policy=policy,
                    cuda_graphs=args.cuda_graphs, chat_template_kwargs=template, **generation,
                )
            finally:
                _show_warnings(caught)
    except (ChatSetupError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"retention chat: {CHAT_COMMANDS}")
    if args.resume and not _start_from(chat, lambda: chat.resume(args.resume), "resumed", args.resume, where=""):
        return 2
    if history is not None:
        def feed() -> None:
            for text, reply, images in history[1]:
                chat.add_turn(text, reply, images=images)  # paths: the chat reads them as every turn's images

        if not _start_from(chat, feed, "fed", args.history, where=f"{args.history}: "):  # images for a text-only model
            return 2
    if args.seed is not None:  # after the model and gates load, so the replies alone draw from it
        torch.manual_seed(args.seed)
    if hasattr(sys.stdin, "reconfigure"):  # a byte that is not UTF-8: that message is refused, the chat goes on
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        chat_loop(chat, _typed_lines() if sys.stdin.isatty() else sys.stdin)
    except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat quietly (during a reply it stops the reply)
        print()
    return 0


def _generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generate options of ``retention chat``'s sampling flags; ValueError naming the fix for a flag out of range
    or a sampling flag without ``--sample`` (checked before the model loads)."""
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
                "seed": args.seed}
    given = [f"--{k.replace('_', '-')}" for k, v in sampling.items() if v is not None]
    if given and not args.sample:
        raise ValueError(f"{', '.join(given)} apply when sampling: add --sample (replies are greedy without it)")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = getattr(args, name)
        if value is not None and (problem := generation_value_problem(name, value)):
            problem = problem.replace("leave out sampling", "leave out --sample")
            raise ValueError(f"--{name.replace('_', '-')} {problem}")
    options = {k: v for k, v in sampling.items() if k != "seed" and v is not None}
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    return {"do_sample": True, **options} if args.sample else options


def _template_options(text: str | None) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object of template variables; ValueError naming the fix otherwise."""
    import json

    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON ({e.msg}): give an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object of template variables, got {text}: e.g. "
                         "'{\"enable_thinking\": false}'")
    if problem := template_variables_problem(value):
        raise ValueError(f"--chat-template-kwargs {problem}")
    return value


def _check_shows_images(model: str, path: str) -> None:
    """:class:`ChatInputError` when ``path`` (a log or a transcript with images) meets a text-only ``model``, read
    from the model's config before its weights load. A config that cannot be read is left to the model's load."""
    from .models import ModelNotAvailableError, is_multimodal, load_config

    try:
        config = load_config(model, check_support=False)[0]
    except ModelNotAvailableError:
        return
    if not is_multimodal(config):
        raise ChatInputError(f"{path} holds images but {model} is a text-only model: give a vision-language model "
                             "(--model Qwen/Qwen3-VL-4B-Instruct), or a conversation without images")


def _start_from(chat: RetentionChat, start: Callable[[], None], verb: str, source: str, where: str) -> bool:
    """Run ``start`` (a resume, or a log fed turn by turn) with its warnings printed as lines, as in the chat loop;
    then say what was ``verb``-ed from ``source`` and the memory line. False after printing its error (``where``
    first)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                start()
            finally:
                _show_warnings(caught)
    except ChatInputError as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return False
    print(f"[{verb} {_extent(chat)} from {source}] {_memory_line(chat.memory())}")
    return True


def _typed_lines() -> Iterator[str]:
    """Lines typed at a terminal, with a prompt (and readline's editing and history where Python has it)."""
    try:
        import readline  # noqa: F401  (input() uses it once imported)
    except ImportError:
        pass
    while True:
        try:
            yield input("> ")
        except EOFError:  # Ctrl-D
            print()
            return


def register(subparsers: Any) -> None:
    """Add ``retention chat`` to the CLI."""
    from .commands import add_placement_args, non_negative_int, positive_int
    from .policies import POLICIES

    p = subparsers.add_parser("chat", help="interactive chat over a bounded retention cache (reads stdin)")
    p.add_argument("--model", default="smollm2-135m", help="embedded name, Hub id or local folder")
    p.add_argument("--gates", default=None, help="gate checkpoint folder, Hub repo or shipped name; default: the gates "
                   "shipped for an embedded model (checkpoints/), else untrained; 'untrained' forces untrained gates")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="KV budget in tokens per (layer, KV head); default: unlimited")
    p.add_argument("--policy", default="global_gates", choices=sorted(POLICIES), metavar="POLICY",
                   help="eviction policy: global_gates (the learned gates, default) or a baseline to compare with "
                   f"({', '.join(sorted(set(POLICIES) - {'global_gates'}))})")
    p.add_argument("--sink", type=int, default=None, help="global_gates: first tokens always kept in every head "
                   "(attention sinks; default 4); 0: the gates alone decide")
    p.add_argument("--recent", type=int, default=None, help="global_gates: newest tokens always kept in every head "
                   "(a local window; default 0)")
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="prefill chunk in tokens (default: %(default)s): a long turn competes for the budget chunk "
                   "by chunk")
    p.add_argument("--max-new-tokens", type=positive_int, default=256,
                   help="longest reply in tokens (default: %(default)s)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--resume", default=None, metavar="FILE", help="go on with a conversation saved by /save (under "
                   "this command's budget and policy)")
    p.add_argument("--history", default=None, metavar="FILE", help="go on from a conversation log (JSON {role, "
                   "content} messages or ShareGPT conversations, ending with a reply), fed through this chat's cache")
    p.add_argument("--sample", action="store_true", help="sample the replies (at the model's generation-config "
                   "temperature, top-k, top-p and min-p, each overridden by its flag below); default: greedy")
    p.add_argument("--temperature", type=float, default=None, help="with --sample: divide the logits by this (> 0)")
    p.add_argument("--top-k", type=non_negative_int, default=None, help="with --sample: draw from the K likeliest "
                   "tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample: draw from the likeliest tokens whose "
                   "probabilities sum to P (nucleus sampling)")
    p.add_argument("--min-p", type=float, default=None, help="with --sample: drop tokens less likely than P times the "
                   "likeliest")
    p.add_argument("--repetition-penalty", type=float, default=None, help="penalise tokens already in the conversation "
                   "(above 1), greedy or sampled")
    p.add_argument("--seed", type=int, default=None, help="with --sample: seed the draws, for replies that repeat")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON", help="variables for the model's chat "
                   "template, as a JSON object: '{\"enable_thinking\": false}' turns Qwen3's reasoning block off")
    p.add_argument("--cuda-graphs", action="store_true", help="decode replies as replayed CUDA graphs (GraphDecoder; "
                   "a GPU, policies that read no queries): several times faster per token")
    add_placement_args(p)
    p.set_defaults(func=_chat_command)
