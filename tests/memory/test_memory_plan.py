"""The memory planner (`vidtune plan`): its prediction against the measured peak, the shipped architectures, the
accounting of the memory savers, the suggestion search and the command's JSON."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from vidtune.cli import main
from vidtune.config import build_config
from vidtune.errors import ConfigError
from vidtune.memory.architectures import families, shipped_architectures
from vidtune.memory.measure import measure_training
from vidtune.memory.meta import META, build_from_config
from vidtune.memory.plan import GIB, plan_memory, quantized_linear_bytes, weight_bytes
from vidtune.memory.suggest import fits, suggest, usable_gib, with_overrides
from vidtune.memory.tracking import LiveMemory
from vidtune.memory.values import KnownValues, UnknownValue
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.tiny import TINY_SHAPES

BAND = (0.85, 1.15)


@pytest.fixture(autouse=True)
def traces_stored_in_a_temporary_folder(monkeypatch, tmp_path):
    """`vidtune plan` keeps its traces on disk: here in the test's own folder, never the user's cache."""
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "stored-traces"))


@pytest.fixture
def plan_config(tiny_model_dir):
    """plan_config(family, **sections) -> a CPU config of the family's tiny model, trained from the cache."""

    def build(family: str = "ltx-video", **sections):
        frames, height, width = TINY_SHAPES[family]
        data = {"model": {"name": family, "pretrained": str(tiny_model_dir(family))},
                "data": {"root": ".", "frames": frames, "height": height, "width": width},
                "training": {"device": "cpu"}, "precompute": {"enabled": True}}
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return build_config(data)

    return build


def test_live_memory_counts_what_is_alive():
    live = LiveMemory()
    weight = torch.ones(1000)
    live.known([weight])
    with live:
        first = weight * 2  # 4000 bytes
        second = first + 1  # 8000 live
        del first
        third = second.view(10, 100)  # a view: no new storage
    assert live.peak == 8000
    assert live.current == 4000
    assert third.untyped_storage().nbytes() == 4000


@pytest.mark.parametrize("family", available_models())
def test_plan_matches_the_measured_peak_of_each_tiny_family(plan_config, family):
    """Planned on meta from the saved tiny model's config.json files, measured by the profiler while the same
    model (random weights) trains two steps on the CPU."""
    config = plan_config(family)
    predicted = plan_memory(config).training_peak
    measured = measure_training(config).peak
    assert BAND[0] <= predicted / measured <= BAND[1], (predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "options"), [
    ("ltx-video", {"training": {"algorithm": "full", "gradient_checkpointing": True}}),
    ("ltx-video", {"memory": {"base_weights": "int8"}}),
    ("ltx-video", {"memory": {"base_weights": "fp8"}}),
    ("ltx-video", {"training": {"algorithm": "full"}, "optimizer": {"name": "came"}}),
    # bitsandbytes' unfused CPU step (five fp32 copies of the largest tensor, 4M values in this tiny model)
    ("hunyuan-video-1.5", {"training": {"algorithm": "full"}, "optimizer": {"name": "adamw8bit"}}),
    ("hunyuan-video-1.5-i2v", {"training": {"gradient_checkpointing": True}}),
    ("ltx-2", {"memory": {"base_weights": "fp8"}}),
], ids=["full-checkpointing", "int8", "fp8", "full-came", "hv15-full-adamw8bit", "hv15-i2v-checkpointing",
        "ltx2-fp8"])
def test_plan_matches_the_measured_peak_across_options(plan_config, family, options):
    config = plan_config(family, lora={"rank": 64, "alpha": 64}, **options)
    predicted = plan_memory(config).training_peak
    measured = measure_training(config).peak
    assert BAND[0] <= predicted / measured <= BAND[1], (predicted, measured)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_plan_matches_the_measured_peak_of_a_lycoris_adapter(plan_config, kind):
    """The planner traces the denoiser with the kind's own layers (peft's LoKr / LoHa), not a LoRA of the rank."""
    config = plan_config("ltx-video", lora={"rank": 64, "alpha": 64}, adapter={"type": kind})
    predicted = plan_memory(config).training_peak
    measured = measure_training(config).peak
    assert BAND[0] <= predicted / measured <= BAND[1], (predicted, measured)
    lora = plan_memory(plan_config("ltx-video", lora={"rank": 64, "alpha": 64})).training_peak
    assert predicted != lora


# Parameter counts of the released denoisers (their model cards, rounded): the shipped configs build these.
DENOISER_PARAMETERS = {
    "Lightricks/LTX-Video": 1.9e9,
    "THUDM/CogVideoX-2b": 1.7e9,
    "THUDM/CogVideoX-5b": 5.6e9,
    "THUDM/CogVideoX-5b-I2V": 5.6e9,
    "hunyuanvideo-community/HunyuanVideo": 12.8e9,
    "genmo/mochi-1-preview": 10.0e9,
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": 1.4e9,
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": 14.3e9,
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": 16.4e9,
    "Lightricks/LTX-Video-0.9.5": 1.9e9,
    "Lightricks/LTX-Video-0.9.7-dev": 13e9,
    "THUDM/CogVideoX1.5-5B": 5.6e9,
    "THUDM/CogVideoX1.5-5B-I2V": 5.6e9,
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v": 8.3e9,
    "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v": 8.3e9,
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": 5e9,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": 14e9,  # each of the two experts
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": 14e9,
    # Named 14B for its Wan 2.1 blocks; with the image cross-attention (as I2V-14B's 16.4B), the face adapters
    # (0.84B) and the motion and face encoders: Comfy-Org's repackaged bf16 file is 34.55 GB, 17.3B parameters.
    "Wan-AI/Wan2.2-Animate-14B-Diffusers": 17.3e9,
    "Lightricks/LTX-2": 19e9,  # the video and audio streams together
    "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers": 14.3e9,  # Wan 2.1 14B's architecture
    "Skywork/SkyReels-V2-T2V-14B-720P-Diffusers": 14.3e9,
    # Named 1.3B for its blocks (Wan 2.1 1.3B's 1.42B); the image cross-attention and embedder add 0.14B.
    "Skywork/SkyReels-V2-I2V-1.3B-540P-Diffusers": 1.56e9,
    "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers": 16.4e9,  # Wan 2.1 I2V 14B's architecture
    "Skywork/SkyReels-V2-I2V-14B-720P-Diffusers": 16.4e9,
    "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers": 1.4e9,  # Wan 2.1 1.3B's, and the frame-rate embedding
    "Skywork/SkyReels-V2-DF-14B-540P-Diffusers": 14.3e9,
    "Skywork/SkyReels-V2-DF-14B-720P-Diffusers": 14.3e9,
    "Efficient-Large-Model/SANA-Video_2B_480p_diffusers": 2.0e9,
    "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers": 2e9,
    "kandinskylab/Kandinsky-5.0-I2V-Lite-5s-Diffusers": 2e9,
    "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers": 19e9,
    "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers": 19e9,
    # Named for Wan 2.1's blocks (1.42B / 14.3B above); the VACE branch adds 15 / 8 Wan blocks (each with its
    # output projection, the first with its input one) and the control patch embedding: 0.73B / 3.05B.
    "Wan-AI/Wan2.1-VACE-1.3B-diffusers": 2.15e9,
    "Wan-AI/Wan2.1-VACE-14B-diffusers": 17.3e9,
    "linoyts/Wan2.2-VACE-Fun-14B-diffusers": 17.3e9,  # each of its two experts: Wan 2.1 VACE 14B's shape
    "nvidia/Cosmos-Predict2.5-2B": 2e9,
    "nvidia/Cosmos-Predict2.5-14B": 14e9,
    # 33.1B: the 61.7 GiB bf16 `transformer/` partition MiniMaxH3Blocks' description names.
    "MiniMaxAI/MiniMax-H3": 33.1e9,
}


@pytest.mark.parametrize("hub_id", sorted(shipped_architectures()))
def test_shipped_architectures_build_the_released_denoisers(hub_id):
    spec_class = get_spec_class(families(hub_id)[0])
    from vidtune.memory.architectures import architecture_folder

    folder, _ = architecture_folder(hub_id, spec_class.name)
    experts = [name for name in ("transformer", "transformer_2") if (folder / name).is_dir()]
    for expert in experts:  # Wan 2.2 A14B: two of the same size
        denoiser = build_from_config(spec_class.denoiser_class, folder / expert, None)
        count = sum(p.numel() for p in denoiser.parameters())
        assert all(p.device == META for p in denoiser.parameters())
        assert abs(count / DENOISER_PARAMETERS[hub_id] - 1) < 0.08, count


def _documented_hub_ids() -> list[str]:
    """The hub ids README.md and docs/*.md name (`Org/Name` in backticks, of the organisations that publish the
    shipped models), each with the families it serves."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    organisations = {hub_id.split("/")[0] for hub_id in shipped_architectures()}
    text = "\n".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    return sorted({found for found in re.findall(r"`([\w.-]+/[\w.-]+)`", text)
                   if found.split("/")[0] in organisations})


def test_every_documented_hub_id_is_shipped():
    documented = _documented_hub_ids()
    assert "Wan-AI/Wan2.2-T2V-A14B-Diffusers" in documented  # the docs are read
    assert [hub_id for hub_id in documented if hub_id not in shipped_architectures()] == []


def _fit_table_hub_ids() -> list[str]:
    """The hub ids of README's "Will it fit?" table (one row a model: `| name (`Org/Name`) | ...`)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("## Will it fit?", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| [^|]*\(`([^`]+)`\) \|", table, flags=re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("hub_id", _fit_table_hub_ids())
def test_plan_works_offline_for_every_hub_id_of_the_readme_table(hub_id):
    """`vidtune plan` for each model of README's table, offline (HF_HUB_OFFLINE=1 in the tests), at a small clip:
    the weights are the released parameter count in bf16 (the LoRA's are small beside them)."""
    config = build_config({"model": {"name": families(hub_id)[0], "pretrained": hub_id},
                           "data": {"root": ".", "frames": 17, "height": 256, "width": 256},
                           "precompute": {"enabled": True}})
    plan = plan_memory(config)
    # Wan 2.2 A14B: a clip runs one expert, the idle one waits in host memory: one expert's weights count.
    assert 0.9 < plan.training["weights"] / (2 * DENOISER_PARAMETERS[hub_id]) < 1.12, plan.training
    assert plan.peak >= plan.training_peak > plan.training["weights"]


def test_the_readme_table_names_the_newest_models():
    assert {"Wan-AI/Wan2.2-T2V-A14B-Diffusers", "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",
            "Lightricks/LTX-Video-0.9.7-dev"} <= set(_fit_table_hub_ids())


@pytest.mark.slow
def test_plan_works_offline_for_a_shipped_hub_id():
    config = build_config({"model": {"name": "wan", "pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"},
                           "data": {"root": ".", "frames": 17, "height": 256, "width": 256},
                           "training": {"gradient_checkpointing": True}, "precompute": {"enabled": True}})
    plan = plan_memory(config)
    assert plan.device == "cuda"
    # 1.4B bf16 weights; the LoRA's gradients and state in fp32.
    assert 2.5 < plan.training["weights"] / GIB < 3.0
    assert plan.training["optimizer state"] == 2 * plan.training["gradients"]
    assert plan.precompute["precompute: text encoders"] > 10 * GIB  # UMT5-XXL in bf16


def test_quantized_weights_and_block_swap_are_accounted(plan_config):
    linear = torch.nn.Linear(256, 128, device=META)
    assert quantized_linear_bytes(linear, "int8") == 256 * 128 + 128 * 4
    assert quantized_linear_bytes(linear, "nf4") == 256 * 128 // 2 + 512 + 2 * 4 + 4
    plain = plan_memory(plan_config()).training["weights"]
    assert plan_memory(plan_config(memory={"base_weights": "int8"})).training["weights"] < 0.6 * plain
    # Block swap: the swapped blocks' frozen weights leave, two of them stay in flight.
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 8)
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(5)])
    model.requires_grad_(False)
    block, proj = (16 * 16 + 16) * 4, (8 * 8 + 8) * 4
    assert weight_bytes(model, "auto", 0) == proj + 5 * block
    assert weight_bytes(model, "auto", 3) == proj + 2 * block + 2 * block
    assert weight_bytes(model, "auto", 5) == proj + 2 * block
    with pytest.raises(ConfigError, match=r"memory\.blocks_to_swap=99"):
        plan_memory(plan_config(memory={"blocks_to_swap": 99}))


def test_sharding_divides_the_sharded_parts(plan_config):
    config = plan_config(training={"algorithm": "full"}, parallel={"strategy": "fsdp"})
    one, four = plan_memory(config), plan_memory(config, world_size=4)
    for part in ("weights", "gradients", "optimizer state"):
        assert four.training[part] == -(-one.training[part] // 4)
    assert four.training["activations"] == one.training["activations"]
    # A quantized base stays whole on every device under FSDP.
    quantized = plan_config(parallel={"strategy": "fsdp"}, memory={"base_weights": "int8"})
    assert plan_memory(quantized, world_size=4).training["weights"] == plan_memory(quantized).training["weights"]


def test_suggestion_fits_the_budget(plan_config):
    config = plan_config(training={"algorithm": "full"})
    plan = plan_memory(config)
    budget = 0.9 * plan.peak / GIB
    found = suggest(config, budget)
    assert found is not None and found.overrides
    assert plan_memory(with_overrides(config, found.overrides)).peak <= budget * GIB
    assert suggest(config, 2 * plan.peak / GIB).overrides == []
    assert suggest(config, 1e-6) is None


def test_plan_command_prints_one_json_object(tiny_model_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    folder = tiny_model_dir("ltx-video")
    frames, height, width = TINY_SHAPES["ltx-video"]
    words = ["plan", "model.name=ltx-video", f"model.pretrained={folder}", f"data.frames={frames}",
             f"data.height={height}", f"data.width={width}", "training.device=cpu", "--json"]
    assert main([*words, "--gpu-memory", "80"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])  # (library warnings may come before it)
    assert isinstance(result["peak_gib"], float) and result["peak_gib"] > 0
    assert result["fits"] is True and result["suggested_overrides"] == []
    assert main([*words, "--gpu-memory", "1e-9"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["fits"] is False and result["suggested_overrides"] == []


def test_plan_says_what_it_is_doing_before_each_wait(tiny_model_dir, capsys):
    frames, height, width = TINY_SHAPES["ltx-video"]
    words = ["plan", "model.name=ltx-video", f"model.pretrained={tiny_model_dir('ltx-video')}",
             f"data.frames={frames}", f"data.height={height}", f"data.width={width}", "training.device=cpu"]
    assert main([*words, "--gpu-memory", "1e-9", "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert "Tracing one training step of ltx-video on the meta device (no weights loaded) ..." in lines
    assert any(line.endswith("is over 9e-10 GiB, the 90% of 1e-09 GiB a plan may fill: tracing combinations of "
                             "memory savers for the fastest one that fits ...") for line in lines), captured.err
    json.loads(captured.out.splitlines()[-1])  # stdout stays the JSON object


def test_plan_refuses_an_unknown_hub_id(capsys):
    assert main(["plan", "model.name=wan", "model.pretrained=someone/unknown-model"]) == 2
    error = capsys.readouterr().err
    assert "someone/unknown-model" in error and "What to do:" in error
    # The command a user has (huggingface_hub's `hf`), and no near miss to suggest for an id like no other.
    assert "hf download someone/unknown-model --include '*.json' --local-dir unknown-model" in error
    assert "huggingface-cli" not in error and "Did you mean" not in error


def test_plan_suggests_the_known_hub_id_a_typo_or_wrong_case_meant(capsys):
    known = sorted(shipped_architectures())[0]
    typo = known.lower()[:-1] + ("x" if known[-1] != "x" else "y")
    assert main(["plan", f"model.name={families(known)[0]}", f"model.pretrained={typo}"]) == 2
    assert f"Did you mean {known}?" in capsys.readouterr().err


def test_known_values_let_the_trace_branch_and_copy_to_the_host():
    """Values a shape-only trace needs (HunyuanVideo 1.5's text-to-video check, LTX-2's timesteps on the host)
    come from constants created in the trace; a value it does not know is an error, never a guess."""
    with KnownValues() as values:
        timesteps = torch.full((2,), 500.0, device=META)
        on_host = timesteps.detach().float().cpu() / 1000.0
        assert on_host.device.type == "cpu" and on_host.tolist() == [0.5, 0.5]
        image_tokens = torch.zeros(2, 1, 8, device=META).to(torch.bfloat16)
        assert bool(torch.all(image_tokens == 0)) is True
        assert bool(torch.all(image_tokens * 3 + 1 == 0)) is False
        mask = torch.ones(2, 5, dtype=torch.long).to(META)  # a tokenizer's mask of one value, copied to meta
        assert int(mask.bool().any(dim=0)[0]) == 1
        embeds = torch.empty(2, 5, 8, device=META)
        values.mark(embeds, 1.0)
        assert bool(torch.all(embeds == 0)) is False
        with pytest.raises(UnknownValue, match=r"\(\) torch.float32 tensor"):
            float((embeds @ torch.empty(8, 8, device=META)).sum(-1)[0, 0])


@pytest.fixture
def fresh_traces(monkeypatch):
    """The planner's caches emptied for one test, and its traces counted: builds of the denoiser, traced steps
    (one per kind: with / without gradient checkpointing) and the forward-backward passes run."""
    import vidtune.memory.plan as planner

    monkeypatch.setattr(planner, "TRACES", planner.Traces())
    counts = {"builds": 0, "steps": 0, "passes": 0}

    def counted(name, key):
        original = getattr(planner, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(planner, name, wrapper)

    counted("build_traced_model", "builds")
    counted("trace_step", "steps")
    counted("_count_step", "passes")
    return counts


def test_the_suggestion_search_traces_the_denoiser_once(plan_config, fresh_traces, monkeypatch):
    """Every combination of savers is derived from one build of the denoiser and one traced step per kind (with
    and without gradient checkpointing): fp8 / int8 / nf4 weights, activation offload, the optimizers and block
    swap are accounted, not traced again."""
    import vidtune.memory.suggest as suggestion

    planned = []
    original = suggestion.plan_memory
    monkeypatch.setattr(suggestion, "plan_memory", lambda *a, **k: planned.append(a[0]) or original(*a, **k))
    monkeypatch.setattr(suggestion, "_precompute_overrides", lambda *_: [])  # the precompute stage is not the subject
    config = plan_config()
    found = suggest(config, 1e-6)  # nothing fits: every combination is planned, and block swap over each
    assert found is None
    assert len(planned) > 50
    assert {c.memory.base_weights for c in planned} == {"auto", "fp8", "int8", "nf4"}
    assert {c.memory.activation_offload for c in planned} == {False, True}
    assert {c.memory.blocks_to_swap for c in planned} >= {0, 2}
    assert fresh_traces["builds"] == 1 and fresh_traces["steps"] == 2  # ... from one build, two traced steps
    assert fresh_traces["passes"] == 2  # the tiny model's two blocks are traced whole


@pytest.mark.parametrize(("hub_id", "size", "more", "every_operator"), [
    ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 64, (0, 0), True),
    # Without checkpointing its offload peak grows evenly from the third block on (at this size).
    ("Lightricks/LTX-2", 128, (1, 0), False),
    pytest.param("hunyuanvideo-community/HunyuanVideo", 64, (0, 0), True, marks=pytest.mark.slow),
])
def test_a_step_traced_with_a_few_blocks_counts_as_the_whole_model(hub_id, size, more, every_operator, fresh_traces,
                                                                   monkeypatch):
    """Each list of blocks traced with 2, 3 and 4 of them (and `more` when the counts do not grow evenly yet) and
    carried on to all gives the whole model's counts (HunyuanVideo: two lists of blocks), with and without gradient
    checkpointing; with `every_operator` the whole model is traced running every operator (no `RepeatedOps`)."""
    import vidtune.memory.plan as planner
    from vidtune.memory import repeated

    family = families(hub_id)[0]
    config = build_config({"model": {"name": family, "pretrained": hub_id},
                           "data": {"root": ".", "frames": 9, "height": size, "width": size},
                           "precompute": {"enabled": True}})
    config, _ = planner.resolve_architecture(config)
    device = torch.device("cuda")
    model = planner._traced_model(config, device, planner._encoders(config, device))
    lists = [len(blocks) for blocks in planner._block_lists(model.denoiser) if len(blocks) > 4]
    assert len(lists) == (2 if "Hunyuan" in hub_id else 1)
    for checkpointing, extra in zip((False, True), more, strict=True):
        fresh_traces["passes"] = 0
        partial = planner.trace_step(model, config, device, checkpointing)
        assert fresh_traces["passes"] == 1 + 2 * len(lists) + extra
        monkeypatch.setattr(planner, "TRACED_BLOCKS", 1000)  # no list is long enough: the whole model
        monkeypatch.setattr(repeated, "ENABLED", not every_operator)
        whole = planner.trace_step(model, config, device, checkpointing)
        monkeypatch.setattr(planner, "TRACED_BLOCKS", 2)
        monkeypatch.setattr(repeated, "ENABLED", True)
        for field in ("live_peak", "host_activations", "traced_grad_bytes"):
            assert getattr(partial, field) == getattr(whole, field), (checkpointing, field)
        # Under activation offload the device's peak may be one block's working memory: carried on as if each
        # block's gradients added to it, never below the whole model's, above it by less than the gradients.
        assert whole.offload_peak <= partial.offload_peak <= whole.offload_peak + whole.traced_grad_bytes
        assert partial.live_peak > 0 and partial.host_activations > 0
    if not every_operator:
        return  # (the fallback below is the same code for every model)
    # A model that cannot run with fewer blocks (it reads one by index) is traced whole.
    original = planner._first_blocks

    @contextlib.contextmanager
    def by_index(lists, counts):
        with original(lists, counts):
            if counts[0] > 2:
                raise IndexError("index 2 is out of range")
            yield

    monkeypatch.setattr(planner, "_first_blocks", by_index)
    fresh_traces["passes"] = 0
    fallback = planner.trace_step(model, config, device, False)
    assert fresh_traces["passes"] == 2  # the two-block step, then the whole model
    monkeypatch.setattr(planner, "TRACED_BLOCKS", 1000)
    assert fallback.live_peak == planner.trace_step(model, config, device, False).live_peak


def _planned(hub_id: str, shape: tuple[int, int, int], *settings: str):
    from vidtune.config import load_config

    frames, height, width = shape
    family = families(hub_id)[0]
    return load_config(None, [f"model.name={family}", f"model.pretrained={hub_id}", f"data.frames={frames}",
                              f"data.height={height}", f"data.width={width}", "precompute.enabled=true", *settings],
                       required_placeholder="(unset)")


@pytest.mark.parametrize(("hub_id", "rank", "checkpointing"), [
    ("Lightricks/LTX-Video", 128, False),
    ("Lightricks/LTX-Video", 128, True),
    pytest.param("hunyuanvideo-community/HunyuanVideo", 32, True, marks=pytest.mark.slow),
])
def test_fp8_base_weights_plan_below_bf16(hub_id, rank, checkpointing):
    """fp8 about halves the frozen weights and adds at most one layer's upcast copy to the activations (the backward
    pass keeps the float8 weight: vidtune/memory/float8.py)."""
    shape = (49, 512, 768) if "LTX" in hub_id else (33, 544, 960)
    settings = [f"lora.rank={rank}", f"lora.alpha={rank}", f"training.gradient_checkpointing={checkpointing}"]
    bf16 = plan_memory(_planned(hub_id, shape, *settings))
    fp8 = plan_memory(_planned(hub_id, shape, *settings, "memory.base_weights=fp8"))
    assert fp8.training_peak < bf16.training_peak
    assert fp8.training["weights"] < 0.7 * bf16.training["weights"]  # (norms, embedders stay bf16)
    extra = fp8.training["activations"] - bf16.training["activations"]
    assert 0 <= extra <= 0.05 * bf16.training["activations"] + 256 * 1024**2, extra / GIB


def test_activation_offload_and_block_swap_take_host_memory(plan_config):
    from vidtune.memory.tracking import pinned_size

    assert [pinned_size(n) for n in (0, 1, 3, 4096, 4097)] == [0, 1, 4, 4096, 8192]
    plain = plan_memory(plan_config())
    assert plain.host == {} and plain.host_peak == 0
    offloaded = plan_memory(plan_config(memory={"activation_offload": True}))
    assert offloaded.host["activation offload (pinned)"] > 0
    assert offloaded.training["activations"] < plain.training["activations"]
    plain = plan_memory(plan_config(training={"gradient_checkpointing": True}))
    swapped = plan_memory(plan_config(training={"gradient_checkpointing": True}, memory={"blocks_to_swap": 1}))
    left = plain.training["weights"] - swapped.training["weights"]
    assert swapped.host["block swap (pinned)"] >= left >= 0


@pytest.mark.slow
def test_suggestions_fit_the_stated_host(fresh_traces, monkeypatch, tmp_path, capsys):
    """Wan 2.1 14B at 81x480x832 on a 24 GiB GPU: offloading every activation of the step (288 GiB) is no answer
    on a 64 GiB host; gradient checkpointing comes first, and what remains in host memory fits it."""
    config = _planned("Wan-AI/Wan2.1-T2V-14B-Diffusers", (81, 480, 832))
    found = suggest(config, 24, host_gib=64)
    assert found is not None and found.plan.peak <= 24 * GIB
    assert found.plan.host_peak <= (64 - 4) * GIB
    assert "training.gradient_checkpointing=true" in found.overrides
    # Without checkpointing, offload keeps the whole step's activations in host memory.
    offloaded = plan_memory(with_overrides(config, ["precompute.enabled=true", "memory.base_weights=int8",
                                                    "memory.activation_offload=true"]))
    assert offloaded.peak <= 24 * GIB and offloaded.host_peak > 64 * GIB
    # A host too small for the unquantized weights a quantized base is loaded from: nothing fits, and the command
    # says what a larger host would allow.
    assert suggest(config, 24, host_gib=16) is None
    assert fresh_traces["builds"] == 1 and fresh_traces["steps"] == 2
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    assert main(["plan", "model.name=wan", "model.pretrained=Wan-AI/Wan2.1-T2V-14B-Diffusers", "data.frames=81",
                 "data.height=480", "data.width=832", "--gpu-memory", "24", "--host-memory", "16"]) == 0
    said = capsys.readouterr().out
    assert ("Does not fit in 24 GiB at 81x480x832 (frames x height x width) with 16.0 GiB of host memory. With more "
            "host memory it fits") in said
    assert "--host-memory GIB" in said
    # The JSON answer gives the same: what a host with more RAM allows, and how much it needs.
    assert main(["plan", "model.name=wan", "model.pretrained=Wan-AI/Wan2.1-T2V-14B-Diffusers", "data.frames=81",
                 "data.height=480", "data.width=832", "--gpu-memory", "24", "--host-memory", "16", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert answer["fits"] is False and answer["suggestion"] is None
    more = answer["with_more_host_memory"]
    assert more["overrides"] and more["peak_gib"] <= 24 * 0.9 and more["host_gib"] > 16 - 4


def test_plan_command_reads_the_host_memory(tiny_model_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    folder = tiny_model_dir("ltx-video")
    frames, height, width = TINY_SHAPES["ltx-video"]
    words = ["plan", "model.name=ltx-video", f"model.pretrained={folder}", f"data.frames={frames}",
             f"data.height={height}", f"data.width={width}", "training.device=cpu", "--json", "--gpu-memory", "80"]
    assert main([*words, "--host-memory", "48"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["host_memory_gib"] == 48 and result["fits"] is True and result["host_peak_gib"] == 0
    assert main([*words]) == 0  # this machine's RAM
    import psutil

    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["host_memory_gib"] == pytest.approx(psutil.virtual_memory().total / GIB, abs=1e-2)
    assert main([*words, "--host-memory", "2"]) == 2
    assert "--host-memory 2: too little" in capsys.readouterr().err


def test_vidtune_plan_keeps_its_traces_for_the_next_run(plan_config, fresh_traces, monkeypatch, tmp_path):
    """A second run of the same question reads the traces from disk (nothing traced) and plans the same bytes; a
    damaged file is traced again and replaced; the library alone keeps nothing on disk."""
    import vidtune.memory.plan as planner

    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    traced_encoders = []
    original = planner.trace_encoders
    monkeypatch.setattr(planner, "trace_encoders", lambda *a: traced_encoders.append(1) or original(*a))
    config = plan_config(memory={"activation_offload": True})
    plan_memory(config)
    assert not (tmp_path / "traces").exists()

    def fresh_run():
        monkeypatch.setattr(planner, "TRACES", planner.Traces())
        with planner.traces_kept_on_disk():
            return plan_memory(config)

    first = fresh_run()
    files = sorted((tmp_path / "traces").glob("*.json"))
    assert len(files) == 2 and fresh_traces["steps"] == 2 and len(traced_encoders) == 2
    second = fresh_run()
    assert fresh_traces["steps"] == 2 and len(traced_encoders) == 2  # nothing traced again
    assert second.training == first.training and second.precompute == first.precompute
    assert second.host == first.host
    for file in files:
        file.write_text("{not json")
    third = fresh_run()
    assert fresh_traces["steps"] == 3 and len(traced_encoders) == 3
    assert third.training == first.training
    assert all(json.loads(file.read_text())["format"] == 1 for file in files)


def test_a_suggestion_leaves_a_tenth_of_the_card_free_and_says_so(plan_config, capsys):
    """A plan just under the card is no fit: the planner does not count the allocator's rounding, fragmentation or
    the CUDA context. Its suggestion plans at most 90 % of the card, and the answer says the figure."""
    config = plan_config()
    plan = plan_memory(config)
    card = plan.peak / GIB / 0.95  # the plan as it is fills 95 % of this card
    assert usable_gib(card) == pytest.approx(0.9 * card)
    assert not fits(plan, card) and fits(plan, plan.peak / GIB / 0.9)
    found = suggest(config, card)
    assert found is not None and found.overrides
    assert found.plan.peak <= 0.9 * card * GIB
