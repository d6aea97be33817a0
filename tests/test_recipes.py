"""The training recipes outside a checkout (issue 76): a wheel ships configs/ as `retention/configs/`, a bare
`--config NAME` finds the checkout's recipe first and the packaged one otherwise, and `retention init-config NAME
[DEST]` copies a recipe with its `base:` chain so the copy loads as the recipe does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import retention.train.config as config_module
from retention.cli import main
from retention.train.config import ConfigError, load_config, resolve_config_path
from retention.train.recipes import available_recipes, copy_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def packaged_only(tmp_path, monkeypatch):
    """As in an installed wheel: no checkout configs/, the recipes under retention/configs/."""
    packaged = tmp_path / "site" / "retention" / "configs"
    shutil.copytree(ROOT / "configs", packaged)
    monkeypatch.setattr(config_module, "CONFIG_DIRS", (tmp_path / "no-checkout" / "configs", packaged))
    return packaged


def test_a_bare_name_resolves_from_the_packaged_recipes_and_the_checkout_comes_first(packaged_only, tmp_path,
                                                                                      monkeypatch):
    assert resolve_config_path("smollm2.yaml") == packaged_only / "smollm2.yaml"
    assert resolve_config_path("qwen3vl") == packaged_only / "qwen3vl.yaml"
    cfg = load_config("smollm2-global-4k.yaml")  # its base: chain inside the packaged folder
    assert cfg.data.seq_len == 4096 and cfg.source == str(packaged_only / "smollm2-global-4k.yaml")
    checkout = tmp_path / "checkout" / "configs"
    checkout.mkdir(parents=True)
    (checkout / "smollm2.yaml").write_text((ROOT / "configs" / "smollm2.yaml").read_text())
    monkeypatch.setattr(config_module, "CONFIG_DIRS", (checkout, packaged_only))
    assert resolve_config_path("smollm2.yaml") == checkout / "smollm2.yaml"
    with pytest.raises(ConfigError, match="available: .*smollm2-global.yaml"):
        resolve_config_path("nope.yaml")


def test_init_config_copies_a_recipe_with_its_bases_and_the_copy_loads_the_same(packaged_only, tmp_path, capsys):
    assert "smollm2-global-4k-evict.yaml" in available_recipes() and "accelerate/zero2.yaml" in available_recipes()
    dest = tmp_path / "mine"
    assert main(["init-config", "smollm2-global-4k-evict.yaml", str(dest)]) == 0
    out = capsys.readouterr().out
    chain = ["smollm2-global-4k-evict.yaml", "smollm2-global-4k-answers-sink.yaml", "smollm2-global-4k.yaml",
             "smollm2-global.yaml"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(chain)
    assert f"retention train --config {dest / chain[0]}" in out
    for name in chain:
        assert (dest / name).read_text() == (packaged_only / name).read_text()
    assert load_config(dest / chain[0]).to_dict() == load_config(chain[0]).to_dict()
    # a second copy refuses to overwrite an edited recipe
    assert main(["init-config", "smollm2-global-4k-evict.yaml", str(dest)]) == 2
    assert "would overwrite" in capsys.readouterr().err
    assert copy_recipe("accelerate/zero2.yaml", dest) == [dest / "accelerate" / "zero2.yaml"]
    assert main(["init-config"]) == 0 and "qwen3vl.yaml" in capsys.readouterr().out
    assert main(["init-config", "nope"]) == 2 and "no recipe named 'nope'" in capsys.readouterr().err
