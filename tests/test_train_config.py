"""Training configs: validation before anything loads, with the key, the allowed values and the line."""

import pytest

from retention.train.config import CONFIG_DIR, ConfigError, load_config, resolve_config_path


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_shipped_configs_are_valid():
    for name in ("smollm2.yaml", "qwen3vl.yaml"):
        cfg = load_config(CONFIG_DIR / name)
        assert cfg.data.sources and cfg.train.steps > 0
    assert load_config("qwen3vl.yaml").model.name == "Qwen/Qwen3-VL-4B-Instruct"  # bare names resolve
    assert resolve_config_path("smollm2") == CONFIG_DIR / "smollm2.yaml"


def test_unknown_key_names_line_and_allowed_keys(tmp_path):
    p = write(tmp_path, "budget:\n  tokens_per_head: 8\ntrain:\n  steps: 3\n  stepz: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.stepz' \(.*c.yaml, line 5\); allowed here: \[.*'steps'"):
        load_config(p)


def test_bad_choice_lists_allowed_values(tmp_path):
    p = write(tmp_path, "budget:\n  tokens_per_head: 8\ngates:\n  variant: shared\n")
    with pytest.raises(ConfigError, match=r"gates.variant = 'shared' \(.*line 4\) is not allowed; "
                                          r"choose one of \['global', 'seed', 'trimkv'\]"):
        load_config(p)


def test_bad_types_and_ranges(tmp_path):
    with pytest.raises(ConfigError, match="train.steps must be an integer.*line 4"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\ntrain:\n  steps: many\n"))
    with pytest.raises(ConfigError, match="train.lr must be > 0"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\ntrain:\n  lr: -1\n"))
    for keep in (0, -1):  # -1 deleted every checkpoint the run wrote, the latest first, so --resume found none
        with pytest.raises(ConfigError, match="train.keep_checkpoints must be > 0"):
            load_config(write(tmp_path, f"budget:\n  tokens_per_head: 8\ntrain:\n  keep_checkpoints: {keep}\n"))
    for p in (1, 1.5, -0.1):  # peft refused 1 and above only after the model had loaded
        with pytest.raises(ConfigError, match=r"lora.dropout must be in \[0, 1\).*line 4"):
            load_config(write(tmp_path, f"budget:\n  tokens_per_head: 8\nlora:\n  dropout: {p}\n"))
    with pytest.raises(ConfigError, match="data.sources.0.kind = 'audio'.*choose one of"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\ndata:\n  sources:\n    - kind: audio\n"))


def test_source_weights_are_checked_and_described(tmp_path):
    head = "budget:\n  tokens_per_head: 8\ndata:\n  seq_len: 256\n  sources:\n"
    cfg = load_config(write(tmp_path, head + "    - {kind: text, path: sotu}\n"
                                     "    - {kind: synthetic, path: niah_single, max_docs: 2, length: 200, "
                                     "weight: 10}\n"))
    assert [s.weight for s in cfg.data.sources] == [1.0, 10]
    assert (cfg.describe_data()
            == "256-token rows: text sotu (train); synthetic niah_single (2 items of 200 tokens, weight 10)")
    two = "".join(f"    - {{kind: synthetic, path: niah_single, max_docs: 2, haystack: {h}}}\n"
                  for h in ("sotu", "pydoc"))
    genres = load_config(write(tmp_path, head + two))
    assert genres.describe_data().endswith("niah_single (2 items of 128 tokens over sotu); "
                                           "synthetic niah_single (2 items of 128 tokens over pydoc)")
    # the card says its training-KL rows are weighted (held-out rows are not); an unweighted run says nothing
    from retention.train.loop import run_facts
    assert "held_out_kl is the plain mean" in run_facts(cfg)["kl_weighting"]
    assert "kl_weighting" not in run_facts(load_config(write(tmp_path, head + "    - {kind: text, path: sotu}\n")))
    with pytest.raises(ConfigError, match=r"data.sources.0.weight must be > 0 \(.*line 6\)"):
        load_config(write(tmp_path, head + "    - {kind: text, path: sotu, weight: 0}\n"))
    with pytest.raises(ConfigError, match="data.sources.0.weight .*multimodal conversations all weigh 1"):
        load_config(write(tmp_path, head + "    - {kind: multimodal, path: x.jsonl, weight: 2}\n"))


def test_multimodal_sources_beside_text_or_in_batches_are_refused_before_the_model_loads(tmp_path):
    """Both failed only once the vision-language model had loaded and the data was built (a DataError from
    build_multimodal, or from the first batch after the held-out pass)."""
    head = "budget:\n  tokens_per_head: 8\ndata:\n  sources:\n    - {kind: multimodal, path: x.jsonl}\n"
    with pytest.raises(ConfigError, match=r"data.sources.0 \(.*line 5\): multimodal .*also has \['chat'\]"):
        load_config(write(tmp_path, head + "    - {kind: chat, path: sharegpt}\n"))
    with pytest.raises(ConfigError, match=r"train.batch_size = 2 \(.*line 7\).*set train.batch_size: 1"):
        load_config(write(tmp_path, head + "train:\n  batch_size: 2\n"))
    assert load_config(write(tmp_path, head + "train:\n  grad_accum: 2\n")).train.grad_accum == 2


def test_synthetic_task_options_are_checked_before_the_model_loads(tmp_path):
    head = "budget:\n  tokens_per_head: 8\ndata:\n  seq_len: 256\n  sources:\n"
    with pytest.raises(ConfigError, match=r"data.sources.0.params \(.*line 6\): niah_multikey takes no option 'key'"):
        load_config(write(tmp_path, head + "    - {kind: synthetic, path: niah_multikey, max_docs: 2, length: 200, "
                                           "params: {key: 8}}\n"))
    with pytest.raises(ConfigError, match="niah_multivalue: values must be a whole number 1 or more, got 0"):
        load_config(write(tmp_path, head + "    - {kind: synthetic, path: niah_multivalue, max_docs: 2, length: 200, "
                                           "params: {values: 0}}\n"))
    load_config(write(tmp_path, head + "    - {kind: synthetic, path: niah_multikey, max_docs: 2, length: 200, "
                                       "params: {keys: 8}}\n"))


def test_a_budget_that_holds_a_whole_row_is_refused(tmp_path):
    """A budget of a row's every token leaves the capacity loss without a term: the run trained the gates on the KL
    alone (beta towards 1, keep everything) and said nothing."""
    with pytest.raises(ConfigError, match="tokens_per_head = 64.*line 2.*data.seq_len = 64 row.*never acts"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 64\ndata:\n  seq_len: 64\n"))
    load_config(write(tmp_path, "budget:\n  tokens_per_head: 63\ndata:\n  seq_len: 64\n"))


def test_budget_needs_exactly_one_form(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of budget.tokens_per_head or budget.global_entries"):
        load_config(write(tmp_path, "train:\n  steps: 2\n"))
    with pytest.raises(ConfigError, match="exactly one"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\n  global_entries: 100\n"))


def test_overrides_apply_and_are_validated(tmp_path):
    p = write(tmp_path, "budget:\n  tokens_per_head: 8\ndata:\n  sources:\n    - path: sotu\n")
    cfg = load_config(p, ["train.steps=7", "data.sources.0.max_docs=3", "gates.variant=trimkv"])
    assert (cfg.train.steps, cfg.data.sources[0].max_docs, cfg.gates.variant) == (7, 3, "trimkv")
    with pytest.raises(ConfigError, match=r"train.steps must be > 0 \(--set train.steps=0\)"):
        load_config(p, ["train.steps=0"])
    with pytest.raises(ConfigError, match="--set needs key=value"):
        load_config(p, ["train.steps"])


def test_missing_config_lists_available(tmp_path):
    with pytest.raises(ConfigError, match="available: \\[.*'smollm2.yaml'"):
        load_config("nope.yaml")


def test_every_shipped_config_loads():
    """The configs in configs/ are what the README and model cards point at: each must validate."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    configs = sorted((root / "configs").glob("*.yaml"))
    assert len(configs) >= 4
    # the studies' recipes are diffs over the shipped chain (base: ../../configs/...): a moved base breaks them
    recipes = sorted(root.glob("experiments/*/train*.yaml"))  # train.yaml, or train-<variant>.yaml beside others
    assert len(recipes) >= 11, recipes
    # the ranking-loss recipes set loss.rank_*, removed after commit acc192c (experiments/rank-loss/README.md): their
    # base chain still resolves, and the removed key is all they fail on
    removed = [p for p in recipes if p.parent.name == "rank-loss"]
    assert len(removed) >= 5, removed
    for path in removed:
        with pytest.raises(ConfigError, match=r"unknown key '(loss|data\.sources\.\d+)\.rank_"):
            load_config(path)
    for path in configs + [p for p in recipes if p not in removed]:
        cfg = load_config(path)
        assert cfg.train.steps > 0 and cfg.data.seq_len > 0, path
        # a tracker named outright stops the run when it is not installed: shipped recipes run wherever they land
        assert cfg.train.tracker in ("auto", "none", None), path
    # the shipped chain: each stage is a diff over the one before it
    for stage, base in (("smollm2-global-4k", "smollm2-global"),
                        ("smollm2-global-4k-answers-sink", "smollm2-global-4k"),
                        ("smollm2-global-4k-evict", "smollm2-global-4k-answers-sink")):
        assert f"base: {base}.yaml" in (root / "configs" / f"{stage}.yaml").read_text()
        assert load_config(f"{stage}.yaml").gates.init_from == f"runs/{base}/final"


def test_moving_a_run_moves_its_export(tmp_path):
    """`--set train.output_dir=X` must not leave the export at the config's own folder (the demo's
    runs/smollm2/final was overwritten that way); an explicit export.dir still wins."""
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")):
        cfg = load_config(path, [f"train.output_dir={tmp_path / 'moved'}"])
        assert cfg.export_dir() == tmp_path / "moved" / "final", path.name
    cfg = load_config("smollm2.yaml", [f"train.output_dir={tmp_path / 'moved'}", f"export.dir={tmp_path / 'there'}"])
    assert cfg.export_dir() == tmp_path / "there"


def test_the_other_commands_config_is_named_with_its_command():
    """train.py given an eval sweep config said "unknown key 'output'"; the eval, "unknown key(s) [...]"."""
    from pathlib import Path

    from retention.eval.config import EvalConfigError, load_eval_config

    root = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError, match="is an evaluation sweep config .*python -m retention.eval run --config"):
        load_config(root / "eval" / "configs" / "tiny.yaml")
    with pytest.raises(EvalConfigError, match="this is a training config: python train.py --config"):
        load_eval_config(root / "configs" / "smollm2.yaml")


def test_chat_template_kwargs_are_checked_with_their_line(tmp_path):
    """``data.chat_template_kwargs`` (as in an eval config and ``retention chat``): a mapping of variable names that
    rendering does not set itself, checked before anything loads."""
    head = "budget:\n  tokens_per_head: 8\ndata:\n  sources: [{kind: chat, path: sharegpt}]\n"
    cfg = load_config(write(tmp_path, head + "  chat_template_kwargs: {enable_thinking: false}\n"))
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert load_config(write(tmp_path, head)).data.chat_template_kwargs == {}
    over = load_config(write(tmp_path, head), ["data.chat_template_kwargs.enable_thinking=false"])
    assert over.data.chat_template_kwargs == {"enable_thinking": False}
    # they change every chat row, so a resume with others is refused as any data change is
    import json

    from retention.train.checkpoint import check_resume_fits, run_settings

    (tmp_path / "state.json").write_text(json.dumps({"config": run_settings(cfg)}))
    check_resume_fits(over, tmp_path)  # the same variables, by --set
    with pytest.raises(SystemExit, match=r"config changed .*data.chat_template_kwargs.enable_thinking False -> None"):
        check_resume_fits(load_config(write(tmp_path, head)), tmp_path)
    for given, words in (("[enable_thinking]", r"data.chat_template_kwargs \(.*line 5\) must be a mapping of template"),
                         ("{enable-thinking: false}", "must be a mapping of template variable names"),
                         ("{tokenize: true}", "sets tokenize, which rendering sets itself: leave them out")):
        with pytest.raises(ConfigError, match=words):
            load_config(write(tmp_path, head + f"  chat_template_kwargs: {given}\n"))


def test_output_folders_under_home_are_the_users_home(tmp_path):
    """``train.output_dir: ~/runs/x`` (and ``export.dir``) made a folder named "~" in the working directory."""
    from pathlib import Path

    cfg = load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\ntrain:\n  output_dir: ~/runs/x\n"),
                      ["export.dir=~/gates/x"])
    assert cfg.train.output_dir == str(Path.home() / "runs" / "x") and cfg.export_dir() == Path.home() / "gates" / "x"


@pytest.mark.parametrize("overrides,words", [
    (["train=3", "train.steps=1"], r"--set train.steps=1: train is 3, not a section with keys"),
    (["data.sources.5.path=x"], r"data.sources is a list of 1: give an index from 0 to 0 in place of '5'"),
    (["data.sources.x.path=x"], r"in place of 'x'"),
    (["data.sources.-1.max_docs=0"], r"in place of '-1'"),
    (["train..steps=1"], r"'train..steps' is not a dotted key"),
])
def test_an_override_through_a_value_or_past_a_list_is_named(tmp_path, overrides, words):
    """These were a TypeError, an IndexError or a ValueError from int() instead of a config error."""
    p = write(tmp_path, "budget:\n  tokens_per_head: 8\ndata:\n  sources: [{kind: text, path: /x}]\n")
    with pytest.raises(ConfigError, match=words):
        load_config(p, overrides)


def test_a_file_that_is_no_mapping_a_key_set_twice_and_infinite_numbers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping of sections .model:, data:, train:, ....; got a list|"
                                          "must be a mapping of sections"):
        load_config(write(tmp_path, "- train\n- data\n"), ["train.steps=3"])  # was a ValueError from int("train")
    # YAML keeps the last of two: steps: 1 then steps: 2 ran 2 steps without a word
    with pytest.raises(ConfigError, match=r"train.steps is set twice in .*c.yaml \(lines 4 and 5\): keep one"):
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\ntrain:\n  steps: 1\n  steps: 2\n"))
    # inf passed the "> 0" check and trained NaN gates
    for given in ("train.lr=.inf", "train.lr=inf", "loss.capacity_weight=.inf"):
        with pytest.raises(ConfigError, match=f"{given.split('=')[0]} must be a finite number"):
            load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\n"), [given])
    with pytest.raises(ConfigError, match="data.seq_len must be >= 2"):  # every row would be dropped
        load_config(write(tmp_path, "budget:\n  tokens_per_head: 8\n"), ["data.seq_len=1"])


def test_a_base_config_is_merged_under_its_child(tmp_path):
    """``base:`` names a file beside the config; mappings merge key by key, lists and values replace."""
    (tmp_path / "base.yaml").write_text("budget:\n  tokens_per_head: 8\ntrain:\n  steps: 5\n  lr: 0.5\n"
                                        "data:\n  seq_len: 256\n  sources:\n    - {kind: text, path: sotu}\n"
                                        "    - {kind: chat, path: sharegpt}\n")
    child = write(tmp_path, "base: base.yaml\ntrain:\n  steps: 7\ndata:\n  sources: [{kind: text, path: /x}]\n")
    cfg = load_config(child)
    assert (cfg.train.steps, cfg.train.lr, cfg.budget.tokens_per_head, cfg.data.seq_len) == (7, 0.5, 8, 256)
    assert [(s.kind, s.path) for s in cfg.data.sources] == [("text", "/x")]  # the list replaced, not merged
    assert cfg.source == str(child)
    # an error on a key the base set names the base file and its line
    (tmp_path / "base.yaml").write_text("budget:\n  tokens_per_head: 8\ngates:\n  variant: shared\n")
    with pytest.raises(ConfigError, match=r"gates.variant = 'shared' \(.*base.yaml, line 4\) is not allowed"):
        load_config(child)


def test_bases_chain_and_are_relative_to_the_config_that_names_them(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.yaml").write_text("budget:\n  tokens_per_head: 8\ntrain:\n  steps: 1\n  lr: 0.1\n"
                                             "  warmup_steps: 0\n")
    (tmp_path / "one" / "b.yaml").write_text("base: a.yaml\ntrain:\n  steps: 2\n  lr: 0.2\n")
    cfg = load_config(write(tmp_path, "base: one/b.yaml\ntrain:\n  steps: 3\n"))
    assert (cfg.train.steps, cfg.train.lr, cfg.train.warmup_steps, cfg.budget.tokens_per_head) == (3, 0.2, 0, 8)
    # --set still applies over the merged config
    assert load_config(tmp_path / "c.yaml", ["train.lr=0.3"]).train.lr == 0.3


def test_a_missing_base_or_a_cycle_of_bases_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"base 'gone.yaml' named in .*c.yaml not found: no file .*gone.yaml"):
        load_config(write(tmp_path, "base: gone.yaml\nbudget:\n  tokens_per_head: 8\n"))
    (tmp_path / "a.yaml").write_text("base: b.yaml\nbudget:\n  tokens_per_head: 8\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"base 'a.yaml' named in .*b.yaml makes a cycle of bases "
                                          r"\(.*a.yaml -> .*b.yaml -> .*a.yaml\)"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="cycle"):  # a config naming itself
        load_config(write(tmp_path, "base: c.yaml\n"))
    with pytest.raises(ConfigError, match="base in .*c.yaml must be the path of another config file"):
        load_config(write(tmp_path, "base: [a.yaml]\n"))
