"""The precompute stage: a content-addressed cache that is never stale, crash-safe, and concurrent."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from vidtune.data.synthetic import render_shapes_dataset
from vidtune.models.ltx_video import LTXVideoSpec
from vidtune.models.spec import TextComponents
from vidtune.precompute import CacheStore, cache_root, precompute


def counts(summary):
    return (summary.conditions_computed, summary.conditions_reused, summary.latents_computed, summary.latents_reused)


def test_second_run_reuses_everything(config_for):
    config = config_for()
    first = precompute(config)
    assert first.line() == "conditions: 4 computed, 0 reused; latents: 4 computed, 0 reused"
    second = precompute(config)
    assert second.line() == "conditions: 0 computed, 4 reused; latents: 0 computed, 4 reused"
    assert first.plan.condition_keys == second.plan.condition_keys
    assert first.plan.latent_keys == second.plan.latent_keys
    assert len(set(first.plan.latent_keys)) == 4
    # A second run loads no model at all.
    assert not [w for w in second.workers if w.items]


def test_editing_one_caption_encodes_that_caption_only(config_for, dataset):
    config = config_for()
    precompute(config)
    prompts = (dataset / "prompts.txt").read_text().splitlines()
    prompts[2] = "a purple star spinning slowly"
    (dataset / "prompts.txt").write_text("\n".join(prompts) + "\n")
    edited = precompute(config)
    assert counts(edited) == (1, 3, 0, 4)
    assert edited.computed_keys["conditions"] == [edited.plan.condition_keys[2]]


def test_changing_the_resolution_encodes_latents_but_no_captions(config_for):
    precompute(config_for())
    resized = precompute(config_for(data={"height": 48, "width": 48}))
    assert counts(resized) == (0, 4, 4, 0)
    entry = resized.plan.cache.read("latents", resized.plan.latent_keys[0])
    assert entry["latents_mean"].shape[-2:] == (12, 12)
    more_frames = precompute(config_for(data={"frames": 13}))
    assert counts(more_frames) == (0, 4, 4, 0)


def test_replacing_a_clip_under_the_same_name_encodes_that_clip(config_for, dataset, tmp_path):
    config = config_for()
    before = precompute(config)
    other = render_shapes_dataset(tmp_path / "other", num_clips=2, num_frames=17, height=48, width=48, seed=7)
    clip = dataset / "clips" / "clip_001.mp4"
    shutil.copyfile(other / "clips" / "clip_001.mp4", clip)
    after = precompute(config)
    assert counts(after) == (0, 4, 1, 3)
    assert after.plan.latent_keys[1] != before.plan.latent_keys[1]
    unchanged = [0, 2, 3]
    assert [after.plan.latent_keys[i] for i in unchanged] == [before.plan.latent_keys[i] for i in unchanged]

    # A clip's identity is its content: touching it, or renaming it, computes nothing.
    os.utime(clip, (1_000_000_000, 1_000_000_000))
    os.rename(dataset / "clips" / "clip_003.mp4", dataset / "clips" / "renamed.mp4")
    (dataset / "videos.txt").write_text((dataset / "videos.txt").read_text().replace("clip_003", "renamed"))
    assert counts(precompute(config)) == (0, 4, 0, 4)


def test_the_key_covers_component_weights_and_dtype(config_for, tiny_model_dir, tmp_path):
    precompute(config_for())
    # Same folder layout, other VAE weights: only latents change.
    model = shutil.copytree(tiny_model_dir("ltx-video"), tmp_path / "model")
    weights = next((model / "vae").glob("*.safetensors"))
    state = load_file(weights)
    name = next(k for k in state if k.endswith("conv_in.conv.weight"))
    state[name] = state[name] * 1.01
    save_file(state, weights)
    assert counts(precompute(config_for(model={"pretrained": str(model)}))) == (0, 4, 4, 0)
    # Another VAE dtype: other entries, stored in that dtype.
    half = precompute(config_for(model={"vae_dtype": "bfloat16"}))
    assert counts(half) == (0, 4, 4, 0)
    assert half.plan.cache.read("latents", half.plan.latent_keys[0])["latents_mean"].dtype == torch.bfloat16
    # Another text encoder dtype or sequence length: only conditions change.
    assert counts(precompute(config_for(model={"max_sequence_length": 64}))) == (4, 0, 0, 4)


def test_damaged_entries_are_reported_and_computed_again(config_for, caplog):
    config = config_for()
    first = precompute(config)
    cache = first.plan.cache
    latent = cache.path("latents", first.plan.latent_keys[0])
    latent.write_bytes(latent.read_bytes()[:-100])  # truncated
    condition = cache.path("conditions", first.plan.condition_keys[3])
    data = bytearray(condition.read_bytes())
    data[-5] ^= 0xFF  # same size, damaged content
    condition.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = precompute(config)
    assert counts(again) == (1, 3, 1, 3) and again.corrupt == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(latent.name in m and "truncated" in m for m in warned)
    assert any(condition.name in m and "checksum" in m for m in warned)
    assert counts(precompute(config)) == (0, 4, 0, 4)


def test_an_interrupted_precompute_resumes_where_it_stopped(config_for, monkeypatch):
    config = config_for(precompute={"batch_size": 1})
    real_write = CacheStore.write
    written = []

    def write_then_crash(self, kind, key, tensors, info=None):
        if len(written) == 5:
            raise KeyboardInterrupt  # killed in the middle of the sixth write
        written.append((kind, key))
        return real_write(self, kind, key, tensors, info)

    monkeypatch.setattr(CacheStore, "write", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        precompute(config)
    monkeypatch.setattr(CacheStore, "write", real_write)

    resumed = precompute(config)
    assert resumed.conditions_reused + resumed.latents_reused == 5
    assert resumed.conditions_computed + resumed.latents_computed == 3
    assert not set(written) & {(k, key) for k, keys in resumed.computed_keys.items() for key in keys}
    assert not resumed.plan.cache.temporary_files()


def test_text_and_vae_workers_run_concurrently(config_for, monkeypatch):
    """Each worker's first encoder call waits for the others: sequential workers would never get past it."""
    barrier = threading.Barrier(3, timeout=60)
    seen: dict[str, str] = {}

    def meet(method):
        def wrapper(self, module, *args):
            name = threading.current_thread().name
            if name not in seen:
                encoder = module["text_encoder"] if isinstance(module, TextComponents) else module
                seen[name] = str(encoder.device)
                barrier.wait()
            return method(self, module, *args)

        return wrapper

    monkeypatch.setattr(LTXVideoSpec, "prepare_conditions", meet(LTXVideoSpec.prepare_conditions))
    monkeypatch.setattr(LTXVideoSpec, "prepare_latents", meet(LTXVideoSpec.prepare_latents))
    summary = precompute(config_for(precompute={"batch_size": 1, "text_device": "cpu",
                                                "vae_devices": ["cpu", "cpu"]}))
    assert counts(summary) == (4, 0, 4, 0)
    assert seen == {"vidtune-text": "cpu", "vidtune-vae0": "cpu", "vidtune-vae1": "cpu"}
    workers = {w.name: w for w in summary.workers}
    assert workers["text"].items == 4 and workers["vae0"].items + workers["vae1"].items == 4
    assert workers["vae0"].items and workers["vae1"].items
    assert workers["text"].started < workers["vae0"].finished and workers["vae0"].started < workers["text"].finished


def test_stored_samples_halve_the_disk(config_for):
    posterior = precompute(config_for())
    sample = precompute(config_for(precompute={"store": "sample"}))
    assert counts(sample) == (0, 4, 4, 0)
    entry = sample.plan.cache.read("latents", sample.plan.latent_keys[0])
    assert set(entry) == {"latents", "frame_rate"}  # the drawn latent (no posterior), and the clip's rate (LTX)
    sizes = [plan.cache.path("latents", plan.latent_keys[0]).stat().st_size
             for plan in (posterior.plan, sample.plan)]
    assert sizes[1] < 0.6 * sizes[0]


def test_caption_dropout_caches_the_empty_prompt_once(config_for):
    empty = config_for(data={"caption_dropout": 0.5, "caption_dropout_technique": "empty"})
    first = precompute(empty)
    assert counts(first) == (5, 0, 4, 0)
    assert first.plan.conditions[first.plan.empty_key] == ""
    assert counts(precompute(empty)) == (0, 5, 0, 4)
    zero = config_for(data={"caption_dropout": 0.5, "caption_dropout_technique": "zero"})
    assert precompute(zero).plan.empty_key is None


def test_default_cache_folder_is_next_to_the_data(make_config, dataset):
    config = make_config(data_root=dataset)
    assert config.precompute.enabled is False  # opt-in
    assert cache_root(config) == (dataset / ".vidtune-cache").absolute()


def test_killed_precompute_process_resumes(config_for, tmp_path):
    """A real `vidtune precompute` killed with SIGKILL mid-run: the next run reuses what it wrote."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    data = render_shapes_dataset(tmp_path / "many", num_clips=12, num_frames=33, height=48, width=48, seed=3)
    config = config_for(data_root=data, data={"frames": 33, "height": 48, "width": 48},
                        precompute={"batch_size": 1})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    process = subprocess.Popen([sys.executable, "-m", "vidtune", "precompute", str(path)],
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    latents = cache_root(config) / "latents"
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if latents.is_dir() and len(list(latents.glob("*/*.safetensors"))) >= 2:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "precompute finished before it could be killed"
    resumed = precompute(config)
    assert resumed.latents_reused >= 2 and resumed.latents_computed >= 1
    assert resumed.latents_reused + resumed.latents_computed == 12
    assert resumed.conditions_reused + resumed.conditions_computed == 12
