"""Context parallelism's settings, refused before anything loads where the processes or the family cannot split."""

from __future__ import annotations

import pytest
import torch

from vidtune.algorithms.build import build_spec
from vidtune.config import build_config
from vidtune.errors import ConfigError
from vidtune.parallel import choose, data_rank, data_world
from vidtune.parallel.context import check_context, context_plan
from vidtune.parallel.strategy import Strategy
from vidtune.trainers import build_trainer


def _minimal(**parallel) -> dict:
    return {"model": {"name": "wan", "pretrained": "x"}, "data": {"root": "."}, "parallel": parallel}


def test_the_context_degree_is_ulysses_times_ring():
    config = build_config(_minimal(context={"ulysses": 2, "ring": 2}))
    assert config.parallel.context.degree == 4
    assert build_config(_minimal()).parallel.context.degree == 1


@pytest.mark.parametrize(("parallel", "named"), [
    ({"strategy": "deepspeed", "context": {"ring": 2}}, r"parallel\.strategy=fsdp"),
    ({"strategy": "fsdp", "replicate_degree": 2, "context": {"ulysses": 2}}, r"parallel\.replicate_degree"),
])
def test_context_refuses_what_it_cannot_compose_with(parallel, named):
    with pytest.raises(ConfigError, match=named):
        build_config(_minimal(**parallel))


def test_the_ranks_of_a_data_group_share_a_data_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank, group in enumerate([0, 0, 1, 1]):
        monkeypatch.setenv("RANK", str(rank))
        assert (data_rank(2), data_world(2)) == (group, 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert (data_rank(2), data_world(2)) == (0, 1)  # one process: nothing to split over


def test_a_degree_that_does_not_divide_the_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="does not divide the 3 processes"):
        check_context(build_config(_minimal(context={"ulysses": 2})))


def test_one_process_trains_without_a_split(make_config):
    config = make_config(parallel={"context": {"ulysses": 2}})
    assert type(choose.choose_strategy(config, torch.device("cpu"))) is Strategy


@pytest.mark.parametrize(("family", "reason"), [
    ("ltx-video-i2v", "keyframes"),
    ("cogvideox", "no context-parallel plan"),
])
def test_a_family_without_a_fitting_plan_is_refused_with_the_reason(make_config, family, reason):
    spec = build_spec(make_config(family, parallel={"context": {"ulysses": 2}}))
    with pytest.raises(ConfigError, match=reason):
        context_plan(spec, make_config(family, parallel={"context": {"ulysses": 2}}))


def test_ulysses_must_divide_the_attention_heads(make_config):
    config = make_config("wan", parallel={"context": {"ulysses": 7}})
    with pytest.raises(ConfigError, match=r"parallel\.context\.ulysses=7 does not divide"):
        context_plan(build_spec(config), config)
    plan = context_plan(build_spec(make_config("wan", parallel={"context": {"ring": 7}})),
                        make_config("wan", parallel={"context": {"ring": 7}}))
    assert "proj_out" in plan  # ring splits any head count


def test_split_attention_runs_on_the_native_backend(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = build_config({**_minimal(context={"ring": 2}), "model": {"name": "wan", "pretrained": "x",
                                                                      "attention_backend": "flash"}})
    with pytest.raises(ConfigError, match=r"model\.attention_backend=auto"):
        check_context(config)
    check_context(build_config(_minimal(context={"ring": 2})))  # auto: accepted


def test_ltx2_splits_its_audio_stream_as_its_video(make_config):
    """The audio tokens, their caption and rotary tables are split and their prediction gathered, as the video's;
    Ulysses must divide the audio heads too (the tiny model: 4 video heads, 2 audio heads)."""
    config = make_config("ltx-2", parallel={"context": {"ulysses": 2}})
    plan = context_plan(build_spec(config), config)
    assert {"hidden_states", "audio_hidden_states", "encoder_hidden_states",
            "audio_encoder_hidden_states"} <= set(plan[""])
    assert {"rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope", "proj_out", "audio_proj_out"} <= set(plan)
    config = make_config("ltx-2", parallel={"context": {"ulysses": 4}})
    with pytest.raises(ConfigError, match=r"does not divide the 2 attention heads .*audio_num_attention_heads"):
        context_plan(build_spec(config), config)


def test_ltx2_clip_shapes_whose_lengths_do_not_divide_are_refused_before_loading(make_config, monkeypatch):
    """9 frames at the clips' 24 fps give 9 audio latent frames (3 x 8 x 8 video tokens divide): refused, naming
    the shape, the rate and the settings; 17 frames give 18 and pass."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = make_config("ltx-2", data={"frames": 9}, parallel={"context": {"ring": 2}})
    with pytest.raises(ConfigError, match=r"(?s)9 frames of 32x32 at 24 fps .*: 9 audio latent frames.*data\.frames"):
        build_trainer(config).check_inputs()
    build_trainer(make_config("ltx-2", data={"frames": 17}, parallel={"context": {"ring": 2}})).check_inputs()
    config = make_config("ltx-2", data={"frames": 17}, model={"max_sequence_length": 63},
                         parallel={"context": {"ulysses": 2}})
    with pytest.raises(ConfigError, match=r"63 caption tokens \(model\.max_sequence_length\)"):
        build_trainer(config).check_inputs()
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process trains without a split: nothing to divide
    build_trainer(config).check_inputs()
