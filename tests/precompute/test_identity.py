"""What a cache key says: each spec's declared condition and latent identity, and nothing else of it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from vidtune.models import hunyuan_video
from vidtune.models.cogvideox import CogVideoXI2VSpec
from vidtune.models.ltx_video import LTXVideoSpec
from vidtune.models.registry import available_models
from vidtune.precompute import build_plan, precompute
from vidtune.precompute.encode import build_spec, load_clips


def counts(summary):
    return (summary.conditions_computed, summary.conditions_reused, summary.latents_computed, summary.latents_reused)


def plan_for(config):
    spec = build_spec(config)
    return build_plan(config, spec, load_clips(config, spec, progress=False))


def test_validation_settings_keep_every_entry(config_for, monkeypatch):
    precompute(config_for())
    # The family's recommended sampling guidance and the configured one only change validation samples.
    monkeypatch.setattr(LTXVideoSpec, "validation_guidance_scale", 7.5)
    changed = config_for(validation={"enabled": True, "guidance_scale": 9.0, "num_inference_steps": 3})
    assert counts(precompute(changed)) == (0, 4, 0, 4)


def test_hunyuan_prompt_template_invalidates_conditions_only(config_for, monkeypatch):
    config = config_for(family="hunyuan-video")
    before = precompute(config)
    template = dict(hunyuan_video.PROMPT_TEMPLATE)
    template["template"] = template["template"].replace("Describe the video", "Describe this video", 1)
    assert template != hunyuan_video.PROMPT_TEMPLATE
    monkeypatch.setattr(hunyuan_video, "PROMPT_TEMPLATE", template)
    after = precompute(config)
    assert counts(after) == (4, 0, 0, 4)  # every caption encoded again with the new template, no clip
    assert not set(after.plan.condition_keys) & set(before.plan.condition_keys)
    assert after.plan.latent_keys == before.plan.latent_keys

    # The Llama layer kept is a condition setting too.
    monkeypatch.setattr(hunyuan_video, "LLAMA_LAYERS_TO_SKIP", 1)
    skipped = plan_for(config)
    assert not set(skipped.condition_keys) & set(after.plan.condition_keys)
    assert skipped.latent_keys == before.plan.latent_keys


def test_image_noise_of_first_frames_invalidates_latents_only(config_for, monkeypatch):
    config = config_for(family="cogvideox-i2v")
    before = plan_for(config)
    monkeypatch.setattr(CogVideoXI2VSpec, "image_noise_log_sigma", (-2.0, 0.5))
    after = plan_for(config)
    assert not set(after.latent_keys) & set(before.latent_keys)
    assert after.condition_keys == before.condition_keys


def test_a_pipeline_setting_outside_the_text_components_invalidates_conditions(config_for, tiny_model_dir, tmp_path):
    # Mochi reads force_zeros_for_empty_prompt from model_index.json, which no component folder holds.
    model = shutil.copytree(tiny_model_dir("mochi"), tmp_path / "mochi")
    before = plan_for(config_for(family="mochi", model={"pretrained": str(model)}))
    index = json.loads((model / "model_index.json").read_text())
    index["force_zeros_for_empty_prompt"] = not index.get("force_zeros_for_empty_prompt", False)
    (model / "model_index.json").write_text(json.dumps(index))
    after = plan_for(config_for(family="mochi", model={"pretrained": str(model)}))
    assert not set(after.condition_keys) & set(before.condition_keys)
    assert after.latent_keys == before.latent_keys


_PRINT_IDENTITIES = """
import json, sys
from vidtune.config import build_config
from vidtune.precompute.encode import build_spec
for name, pretrained in json.loads(sys.argv[1]).items():
    config = build_config({"model": {"name": name, "pretrained": pretrained}, "data": {"root": "."}})
    spec = build_spec(config)
    print(json.dumps([name, spec.condition_identity(), spec.latent_identity()], sort_keys=True))
"""


def test_every_spec_identity_is_json_and_stable(make_config, tiny_model_dir):
    here = {}
    for family in available_models():
        spec = build_spec(make_config(family))
        conditions, latents = spec.condition_identity(), spec.latent_identity()
        for identity in (conditions, latents):
            assert identity["family"] == family
            assert json.loads(json.dumps(identity)) == identity  # plain JSON values, nothing that repr()s
        again = build_spec(make_config(family))
        assert (again.condition_identity(), again.latent_identity()) == (conditions, latents)
        here[family] = [family, conditions, latents]
    # The same in another process with another hash seed: nothing in an identity depends on the process.
    folders = {family: str(tiny_model_dir(family)) for family in available_models()}
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    result = subprocess.run([sys.executable, "-c", _PRINT_IDENTITIES, json.dumps(folders)], env=env,
                            capture_output=True, text=True, check=True)
    there = {row[0]: row for row in map(json.loads, result.stdout.splitlines())}
    assert there == here


@pytest.mark.parametrize("family", ["ltx-video", "hunyuan-video"])
def test_identities_leave_out_what_does_not_change_the_tensors(make_config, family, monkeypatch):
    spec = build_spec(make_config(family))
    before = (spec.condition_identity(), spec.latent_identity())
    cls = type(spec)
    monkeypatch.setattr(cls, "validation_guidance_scale", 11.0)
    monkeypatch.setattr(cls, "default_lora_targets", ("to_q",))
    changed = build_spec(make_config(family, model={"guidance_scale": 4.0, "frame_rate": 12.0}))
    assert (changed.condition_identity(), changed.latent_identity()) == before
