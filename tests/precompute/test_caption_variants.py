"""From the cache, shuffled tags are read as fixed shuffles and `training.preserve_base`'s captions are cached too:
the cache plan holds every caption a visit may read."""

from __future__ import annotations

from tests.helpers.datasets import captioned_dataset
from vidtune.data.captions import split_tags, variant_of_visit
from vidtune.trainers import build_trainer

TAGS = ["red, ball, bouncing, fast, outdoors", "blue, cube, spinning, slow, indoors"]


def test_the_cache_holds_each_captions_shuffles_and_their_preservation_captions(make_config, shapes_dataset,
                                                                              tmp_path):
    root = captioned_dataset(shapes_dataset, tmp_path / "tags", TAGS)
    config = make_config(
        data={"root": None, "datasets": [{"type": "pairs", "root": str(root), "trigger": "sks", "shuffle_tags": True,
                                          "keep_tokens": 1}]},
        training={"steps": 2, "batch_size": 2, "preserve_base": {"weight": 1.0}},
        precompute={"enabled": True, "cache_dir": str(tmp_path / "cache"), "caption_shuffles": 3})
    trainer = build_trainer(config)
    trainer.set_up()
    plan = trainer.context.source.cached.plan
    assert [len(variants) for variants in plan.condition_variants] == [3, 3]
    for number, variants in enumerate(plan.condition_variants):
        captions = [plan.conditions[key] for key in variants]
        assert len(set(captions)) == 3  # three orders of the four moving tags
        for caption in captions:
            tags = split_tags(caption)
            assert tags[:2] == ["sks", TAGS[number].split(",")[0]]
            assert sorted(tags[1:]) == sorted(split_tags(TAGS[number]))
            # Its preservation caption, the same shuffle without the trigger, is cached too.
            assert plan.preserve_keys[", ".join(tags[1:])] in plan.conditions
    assert len(plan.preserve_keys) == 6
    # Each visit reads the shuffle its position draws.
    cached = trainer.context.source.cached
    for position in range(6):
        item = cached[(position, 0, 0)]
        key = plan.condition_variants[0][variant_of_visit(3, config.training.seed, position)]
        assert all((item["conditions"][k] == cached.conditions(key)[k]).all() for k in item["conditions"])
    trainer.run()
