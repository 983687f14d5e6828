"""A source's caption options: trigger words, tag shuffling with keep_tokens, per-source caption dropout; each a
pure function of (seed, stream position), so a resumed run reads the same captions."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tests.helpers.datasets import captioned_dataset
from vidtune.config import DataConfig
from vidtune.data.captions import (
    CaptionStyle,
    preservation_caption,
    shuffle_variants,
    split_tags,
    variant_of_visit,
    visit_untriggered,
)
from vidtune.data.dataset import VideoCaptionDataset
from vidtune.data.sources import read_sources

TAGS = "1girl, red hair, smiling, outdoors, sunset, looking at viewer"


def test_the_trigger_goes_before_or_after_each_caption_and_the_caption_without_it_is_kept(shapes_dataset, tmp_path):
    root = captioned_dataset(shapes_dataset, tmp_path / "a", ["a red ball", "a blue cube"])
    data = DataConfig(datasets=[
        {"type": "pairs", "root": str(root), "trigger": "sks", "caption_prefix": "video of"},
        {"type": "pairs", "root": str(root), "trigger": "zxq", "trigger_position": "suffix"},
        {"type": "pairs", "root": str(root)},
    ])
    clips = read_sources(data).clips
    assert [clip.caption for clip in clips] == [
        "sks video of a red ball", "sks video of a blue cube", "a red ball zxq", "a blue cube zxq", "a red ball",
        "a blue cube"]
    assert [clip.untriggered for clip in clips] == ["video of a red ball", "video of a blue cube", "a red ball",
                                                    "a blue cube", "a red ball", "a blue cube"]


def test_tag_shuffling_keeps_the_leading_tags_and_is_a_function_of_seed_and_position():
    style = CaptionStyle("sks", shuffle_tags=True, keep_tokens=2)
    draws = [visit_untriggered(style, TAGS, seed=3, position=position) for position in range(20)]
    assert draws == [visit_untriggered(style, TAGS, seed=3, position=position) for position in range(20)]
    for draw in draws:
        tags = split_tags(draw)
        assert tags[:2] == ["1girl", "red hair"] and sorted(tags) == sorted(split_tags(TAGS))
    assert len(set(draws)) > 10  # 24 orders of the 4 moving tags: a fresh one per visit
    assert draws != [visit_untriggered(style, TAGS, seed=4, position=position) for position in range(20)]
    assert style.with_trigger(draws[0]).startswith("sks, 1girl, red hair, ")
    # The cache's fixed shuffles: as many as asked, each a pure function of (seed, sample, number).
    variants = shuffle_variants(style, TAGS, 3, index=0, count=8)
    assert variants == shuffle_variants(style, TAGS, 3, index=0, count=8) and len(set(variants)) == 8
    assert len(shuffle_variants(style, "a, b, c", 3, index=0, count=8)) == 1  # one tag moves: one order
    assert len(shuffle_variants(CaptionStyle(shuffle_tags=True), "a, b, c", 3, index=0, count=8)) == 6
    picks = [variant_of_visit(8, 3, position) for position in range(400)]
    assert set(picks) == set(range(8))


def test_keep_tokens_needs_shuffle_tags_and_weight_is_set_on_every_training_source(tmp_path):
    with pytest.raises(ValidationError, match="keep_tokens=2 works with shuffle_tags=true only"):
        DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "keep_tokens": 2}])
    with pytest.raises(ValidationError, match=r"data.datasets\[1\] has no weight"):
        DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "weight": 2},
                             {"type": "pairs", "root": str(tmp_path)}])
    with pytest.raises(ValidationError, match=r"weight=2\.0 and repeats=3 both set"):
        DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "weight": 2, "repeats": 3}])
    with pytest.raises(ValidationError, match="role: regularization and eval: true both set"):
        DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "role": "regularization", "eval": True}])
    with pytest.raises(ValidationError, match="trigger is empty"):
        DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "trigger": " "}])
    # A held-out source takes no draws: it needs no weight.
    DataConfig(datasets=[{"type": "pairs", "root": str(tmp_path), "weight": 2},
                         {"type": "pairs", "root": str(tmp_path), "eval": True}])


def test_the_preservation_caption_is_the_caption_without_its_trigger_or_a_drawn_prompt():
    style = CaptionStyle("sks")
    assert preservation_caption("a man walking", style, None, "", seed=0, position=5) == "a man walking"
    assert preservation_caption("a man walking", style, None, "person", 0, 5) == "person a man walking"
    prompts = ["a dog", "a cat", "a car"]
    drawn = [preservation_caption("a man walking", style, prompts, "", 0, position) for position in range(60)]
    assert set(drawn) == set(prompts)
    assert drawn == [preservation_caption("x", style, prompts, "", 0, position) for position in range(60)]


def test_each_visit_reads_its_shuffled_caption_the_same_in_any_dataset_instance(shapes_dataset, tmp_path):
    """What a resumed run relies on: a visit's caption depends on (seed, position) only, not on earlier visits."""
    root = captioned_dataset(shapes_dataset, tmp_path / "tags", [TAGS, "blue, cube, spinning, fast"])
    data = DataConfig(datasets=[{"type": "pairs", "root": str(root), "trigger": "sks", "shuffle_tags": True,
                                 "keep_tokens": 1}], frames=2, num_workers=0)
    from vidtune.data.sources import load_dataset

    clips = load_dataset(data, progress=False)
    first = VideoCaptionDataset(clips, data.bucket_shapes(), seed=7)
    keys = [(position, position % 2, 0) for position in range(12)]
    forward = [first[key]["caption"] for key in keys]
    later = VideoCaptionDataset(clips, data.bucket_shapes(), seed=7)
    assert [later[key]["caption"] for key in reversed(keys)] == forward[::-1]
    assert all(caption.startswith("sks, ") for caption in forward)
    assert {first[key]["untriggered"].split(", ")[0] for key in keys} == {"1girl", "blue"}
    assert len(set(forward[::2])) > 2
    assert torch.equal(first[keys[0]]["video"], later[keys[0]]["video"])
