"""Family training defaults: the keys a config leaves unset take the family's published values; set keys win."""

from __future__ import annotations

from pathlib import Path

import pytest

import vidtune
from vidtune.config import build_config
from vidtune.models.defaults import CONFIG_KEYS
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.tables import defaults_table, noise_table

TABLE_START, TABLE_END = "<!-- defaults table: start -->\n", "<!-- defaults table: end -->\n"
NOISE_START, NOISE_END = "<!-- noise table: start -->\n", "<!-- noise table: end -->\n"


def _config(name: str, **sections):
    return build_config({"model": {"name": name, "pretrained": "some/model", **sections.pop("model", {})},
                         "data": {"root": ".", **sections.pop("data", {})}, **sections})


@pytest.mark.parametrize("family", available_models())
def test_unset_keys_take_the_familys_defaults(family):
    defaults = get_spec_class(family).defaults
    config = _config(family)
    for (section, key), field in CONFIG_KEYS.items():
        assert getattr(getattr(config, section), key) == getattr(defaults, field), (family, section, key)
    assert config.frame_rate == defaults.fps


def test_set_keys_win_over_the_family():
    config = _config("hunyuan-video-1.5", data={"height": 256, "fps": 12.0},
                     training={"sigma_shift": 2.0, "sigma_sampling": "uniform"})
    assert (config.data.frames, config.data.height, config.data.width) == (121, 256, 848)
    assert (config.training.sigma_shift, config.training.sigma_sampling) == (2.0, "uniform")
    assert config.frame_rate == 12.0  # the clips' resampled rate, not the family's
    assert _config("wan", model={"frame_rate": 20.0}).frame_rate == 20.0
    # A resolved config written out and read back keeps its values (nothing is filled twice).
    again = build_config(config.to_dict())
    assert again.to_dict() == config.to_dict()


def test_the_families_differ_where_their_recipes_do():
    wan, cogvideox = _config("wan"), _config("cogvideox")
    assert (wan.data.frames, wan.data.height, wan.data.width, wan.frame_rate) == (81, 480, 832, 16.0)
    assert (cogvideox.data.frames, cogvideox.data.height, cogvideox.data.width, cogvideox.frame_rate) == (
        49, 480, 720, 8.0)
    assert wan.training.sigma_shift == 3.0 and _config("ltx-video").training.sigma_shift == 1.0


def test_docs_models_md_holds_the_generated_table():
    text = (Path(vidtune.__file__).parent.parent / "docs" / "models.md").read_text(encoding="utf-8")
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert table == defaults_table(), "run: python -m vidtune.models.tables and paste it into docs/models.md"


def test_docs_models_md_holds_the_noise_table_with_a_source_for_every_family():
    text = (Path(vidtune.__file__).parent.parent / "docs" / "models.md").read_text(encoding="utf-8")
    table = text.split(NOISE_START, 1)[1].split(NOISE_END, 1)[0]
    assert table == noise_table(), "run: python -m vidtune.models.tables and paste it into docs/models.md"
    assert all(get_spec_class(family).defaults.noise_source for family in available_models())


def test_every_registered_name_has_its_specs_defaults_without_importing_it():
    from vidtune.models.defaults import FAMILY_DEFAULTS
    from vidtune.models.registry import SPECS

    assert set(FAMILY_DEFAULTS) == set(SPECS)
    for name in SPECS:
        assert get_spec_class(name).defaults is FAMILY_DEFAULTS[name], name
