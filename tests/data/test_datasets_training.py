"""Every family trains a LoRA on a mixed dataset (every source kind, landscape, portrait, odd and long clips, stills)
with buckets, on the fly and from the cache; a bucketed run resumes bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from vidtune.data.synthetic import render_mixed_dataset
from vidtune.errors import ConfigError
from vidtune.models.registry import get_spec_class
from vidtune.models.tiny import TINY_SHAPES
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"


def accepted_buckets(config) -> list[list[int]]:
    """The buckets of a tiny model's shape among landscape, portrait and square, moving and still, that its
    family's rules accept."""
    frames, size, _ = TINY_SHAPES[config.model.name]
    spec = get_spec_class(config.model.name)(config.model)
    found = []
    for count in (frames, 1):
        for height, width in ((size, 2 * size), (2 * size, size), (size, size)):
            try:
                spec.check_video_shape(count, height, width)
            except ConfigError:
                continue
            found.append([count, height, width])
    return found


@pytest.fixture(scope="module")
def mixed_sources(tmp_path_factory) -> Callable[[bool], list[dict]]:
    """mixed_sources(stills) -> the mixed dataset's sources, with or without stills: rendered once per module and
    only read by the runs (their caches are their own), so runs compared bit for bit read the same files."""
    rendered: dict[bool, list[dict]] = {}

    def get(stills: bool) -> list[dict]:
        if stills not in rendered:
            rendered[stills] = render_mixed_dataset(tmp_path_factory.mktemp("mixed") / "data", stills=stills)
        return rendered[stills]

    return get


def mixed_config(make_config, mixed_sources, family: str, **sections):
    """A config on the mixed dataset with every bucket the family accepts, frames drawn at random per visit."""
    probe = make_config(family)
    buckets = accepted_buckets(probe)
    stills = any(bucket[0] == 1 for bucket in buckets)
    data = {"datasets": mixed_sources(stills), "buckets": buckets, "root": None, "frame_sampling": "random",
            **sections.pop("data", {})}
    return make_config(family, data=data, **sections)


# Families the mixed sources cannot feed, and where their data path is tested instead.
NOT_MIXED = {
    "wan-vace": "follows a control clip per sample, which the mixed sources do not have "
                "(tests/models/test_wan_vace.py trains it from clips with control clips)",
    "minimax-h3": "its shortest clip is one VAE chunk, 22 frames; the mixed sources' clips have 18 to 20 "
                  "(tests/models/test_minimax_h3.py)",
}


@pytest.mark.parametrize("family", [
    pytest.param(family, marks=pytest.mark.skip(reason=NOT_MIXED[family])) if family in NOT_MIXED else family
    for family in sorted(TINY_SHAPES)])
def test_every_family_trains_a_lora_on_mixed_sources_with_buckets(make_config, mixed_sources, family):
    config = mixed_config(make_config, mixed_sources, family, training={"steps": 2, "batch_size": 2,
                                                                   "learning_rate": 5e-2},
                          lora={"rank": 4, "alpha": 4})
    trainer = build_trainer(config)
    shapes = []
    original = trainer.loss

    def record(context, batch):
        shapes.append(tuple(batch.latents["latents_mean"].shape))
        return original(context, batch)

    trainer.loss = record
    result = trainer.run()
    assert result.weights_path is not None and result.weights_path.exists()
    assert all(shape[0] == 2 for shape in shapes)  # batches of 2 from one bucket each
    trained = load_file(result.weights_path)
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), "the adapter did not train"
    used = {clip.bucket for clip in trainer.context.clips}
    assert len(used) > 1 or len(config.data.buckets) == 1


def test_mixed_buckets_from_the_cache_train_and_the_cache_holds_each_bucket(make_config, mixed_sources, tmp_path):
    config = mixed_config(make_config, mixed_sources, "ltx-video", training={"steps": 3, "batch_size": 2},
                          precompute={"enabled": True, "cache_dir": str(tmp_path / "cache"), "windows_per_clip": 2})
    trainer = build_trainer(config)
    result = trainer.run()
    assert result.final_step == 3
    plan = trainer.context.source.cached.plan
    shapes = {(p.frames, p.height, p.width) for p in plan.latent_preprocess.values()}
    assert shapes == {tuple(config.data.buckets[clip.bucket]) for clip in trainer.context.clips}
    long = next(i for i, clip in enumerate(trainer.context.clips) if clip.video.name == "long.mp4")
    assert len(plan.latent_windows[long]) == 2  # two windows of the long clip, at its start and its end
    assert [plan.latent_preprocess[k].start for k in plan.latent_windows[long]] == [0, 120 - 9]


def test_a_bucketed_run_with_accumulation_resumes_bit_for_bit(make_config, mixed_sources, tmp_path):
    settings = {"training": {"steps": 4, "batch_size": 2, "gradient_accumulation": 2},
                "checkpoint": {"every": 2}}
    reference = build_trainer(mixed_config(make_config, mixed_sources, "ltx-video", **settings,
                                           output_dir=str(tmp_path / "reference")))
    reference.run()
    first = build_trainer(mixed_config(make_config, mixed_sources, "ltx-video",
                                       training={**settings["training"], "steps": 2},
                                       checkpoint={"every": 2}, output_dir=str(tmp_path / "resumed")))
    first.run()
    resumed = build_trainer(mixed_config(make_config, mixed_sources, "ltx-video", training=settings["training"],
                                         checkpoint={"every": 2, "resume": "latest"},
                                         output_dir=str(tmp_path / "resumed")))
    resumed.run()
    a, b = load_file(tmp_path / "reference" / LORA_FILE), load_file(tmp_path / "resumed" / LORA_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(row)["loss"] for row in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("reference", "resumed")]
    assert losses[0] == losses[1]
