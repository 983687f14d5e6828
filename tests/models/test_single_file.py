"""model.transformer_file: a denoiser from one file in its original / ComfyUI layout trains exactly as the same
weights from the diffusers folder; float8 files keep their float8 values under memory.base_weights: fp8; ComfyUI's
scaled fp8 is dequantised (or refused when made for float8 matmuls); a file that is not the family's transformer is
refused, before any weight is read, with what it looks like."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.single_file import (
    COMFYUI_PREFIX,
    dequantised_folder,
    float8_weights,
    scaled_float8_weights,
    transformer_state,
    write_original_layout,
)
from vidtune.config import build_config
from vidtune.config.schema import ModelConfig
from vidtune.errors import ConfigError, ModelError
from vidtune.memory.float8 import Float8StorageLinear
from vidtune.models.registry import get_spec_class
from vidtune.models.spec.loading import Loading
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"
# Families whose denoiser diffusers converts from a single file.
CONVERTED = ["ltx-video", "ltx-2", "wan", "hunyuan-video", "mochi", "skyreels-v2", "minimax-h3"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def converted_model_dir(tiny_model_dir, tmp_path_factory):
    """The family's tiny model, shaped as diffusers' converter reads it: HunyuanVideo's without single-stream blocks
    (split at the released model's width only), Mochi's with the released model's 48 blocks."""
    from vidtune.models.tiny import write_tiny_model

    shaped = {"hunyuan-video": {"num_single_layers": 0}, "mochi": {"num_layers": 48, "num_attention_heads": 2}}
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in shaped:
            return tiny_model_dir(family)
        if family not in written:
            written[family] = write_tiny_model(family, tmp_path_factory.mktemp(f"{family}-converted"),
                                               **shaped[family])
        return written[family]

    return get


def _spec(family: str, pretrained: Path, transformer_file: Path | None, base_weights: str = "auto", **model):
    config = ModelConfig(name=family, pretrained=str(pretrained),
                         transformer_file=None if transformer_file is None else str(transformer_file), **model)
    return get_spec_class(family)(config, base_weights=base_weights)


@pytest.fixture
def aligned_weights(monkeypatch):
    """Both runs' transformer weights as fresh tensors: a CPU matmul's last bits depend on where its weight lies in
    memory, and `from_pretrained` leaves a folder's weights as views at the file's offsets, so runs are compared bit
    for bit only once both hold aligned copies (the values are untouched)."""
    original = Loading.load_component

    def load_component(self, cls, component, **kwargs):
        loaded = original(self, cls, component, **kwargs)
        if component.startswith("transformer"):
            for parameter in loaded.parameters():
                parameter.data = parameter.data.clone()
        return loaded

    monkeypatch.setattr(Loading, "load_component", load_component)


def _train(make_config, family: str, output: Path, pretrained: Path, transformer_file: Path | None = None,
           base_weights: str = "auto") -> tuple[list[float], dict[str, torch.Tensor]]:
    model = {"pretrained": str(pretrained)}
    if transformer_file is not None:
        model["transformer_file"] = str(transformer_file)
    config = make_config(family, model=model, memory={"base_weights": base_weights}, training={"steps": 3},
                         output_dir=str(output))
    result = build_trainer(config).run()
    return result.losses, load_file(output / LORA_FILE)


def _assert_same_run(first, second) -> None:
    (losses, adapter), (other_losses, other_adapter) = first, second
    assert losses == other_losses
    assert adapter.keys() == other_adapter.keys()
    for key in adapter:
        assert torch.equal(adapter[key], other_adapter[key]), key


@pytest.mark.parametrize("family", CONVERTED)
def test_the_original_layout_loads_back_with_diffusers_from_single_file(converted_model_dir, tmp_path, family):
    folder = converted_model_dir(family)
    # diffusers' HunyuanVideo and MiniMax H3 converters read the original names without ComfyUI's prefix (vidtune
    # drops it first).
    prefix = "" if family in ("hunyuan-video", "minimax-h3") else COMFYUI_PREFIX
    path = write_original_layout(family, folder, tmp_path / "transformer.safetensors", prefix=prefix)
    cls = get_spec_class(family).denoiser_class
    loaded = cls.from_single_file(str(path), config=str(folder), subfolder="transformer").state_dict()
    reference = transformer_state(folder)
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[key], reference[key]) for key in reference)


@pytest.mark.parametrize("family", CONVERTED)
@pytest.mark.usefixtures("aligned_weights")
def test_a_single_file_trains_the_same_adapter_as_the_folder(make_config, converted_model_dir, tmp_path, family):
    folder = converted_model_dir(family)
    path = write_original_layout(family, folder, tmp_path / "transformer.safetensors", prefix=COMFYUI_PREFIX)
    reference = _train(make_config, family, tmp_path / "folder", folder)
    _assert_same_run(reference, _train(make_config, family, tmp_path / "file", folder, path))


@pytest.mark.parametrize("family", ["ltx-video-i2v", "ltx-2-i2v", "wan-i2v", "wan2.2", "wan-vace", "skyreels-v2-i2v",
                                    "skyreels-v2-df"])
def test_image_to_video_and_newer_models_load_from_their_files(tiny_model_dir, tmp_path, family):
    folder = tiny_model_dir(family)
    path = write_original_layout(family, folder, tmp_path / "transformer.safetensors", prefix=COMFYUI_PREFIX)
    denoiser = _spec(family, folder, path).load_denoiser(CPU)
    reference = transformer_state(folder)
    assert denoiser.state_dict().keys() == reference.keys()
    assert all(torch.equal(denoiser.state_dict()[key], reference[key]) for key in reference)


def test_a_file_without_the_comfyui_prefix_and_with_a_vae_beside_loads_its_transformer(tiny_model_dir, tmp_path):
    # Lightricks' ltx-video-2b-v0.9.safetensors holds the VAE beside the transformer.
    folder = tiny_model_dir("ltx-video")
    path = write_original_layout("ltx-video", folder, tmp_path / "ltx.safetensors",
                                 extra={"vae.decoder.conv_in.conv.weight": torch.ones(2, 2)})
    denoiser = _spec("ltx-video", folder, path).load_denoiser(CPU)
    reference = transformer_state(folder)
    assert all(torch.equal(denoiser.state_dict()[key], reference[key]) for key in reference)


def test_each_tensor_takes_the_dtype_from_pretrained_gives_it(tiny_model_dir, tmp_path):
    # Wan keeps some modules in fp32 under a bf16 torch_dtype: the file's tensors follow the same rule.
    folder = tiny_model_dir("wan")
    path = write_original_layout("wan", folder, tmp_path / "wan.safetensors")
    spec = _spec("wan", folder, path, transformer_dtype="bfloat16")
    from_file = spec.load_denoiser(CPU)
    cls = get_spec_class("wan").denoiser_class
    from_folder = cls.from_pretrained(str(folder), subfolder="transformer", torch_dtype=torch.bfloat16)
    expected = dict(from_folder.named_parameters()) | dict(from_folder.named_buffers())
    found = dict(from_file.named_parameters()) | dict(from_file.named_buffers())
    assert found.keys() == expected.keys()
    assert {tensor.dtype for tensor in found.values()} == {torch.bfloat16, torch.float32}
    for key, tensor in expected.items():
        assert found[key].dtype == tensor.dtype, key
        assert torch.equal(found[key], tensor), key


# ----- float8 --------------------------------------------------------------------------------------------------
def _float8_values(dtype: torch.dtype):
    def values(key: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype).to(tensor.dtype) if key.endswith(".weight") and tensor.dim() == 2 else tensor

    return values


@pytest.mark.parametrize("family", ["wan", "skyreels-v2"])
@pytest.mark.usefixtures("aligned_weights")
def test_a_float8_file_keeps_its_values_as_fp8_base_weights(make_config, tiny_model_dir, tmp_path, family):
    folder = tiny_model_dir(family)
    path = write_original_layout(family, folder, tmp_path / "fp8_e4m3fn.safetensors", cast=float8_weights())
    # The same values in a diffusers folder: fp8 base weights round them to the same float8 values.
    rounded = dequantised_folder(folder, tmp_path / "rounded", _float8_values(torch.float8_e4m3fn))
    reference = _train(make_config, family, tmp_path / "folder", rounded, base_weights="fp8")
    _assert_same_run(reference, _train(make_config, family, tmp_path / "file", folder, path, base_weights="fp8"))


def test_a_minimax_h3_float8_file_is_upcast_exactly_and_fp8_base_weights_are_refused_with_the_reason(tiny_model_dir,
                                                                                                   tmp_path):
    """MiniMax H3's fp8 file trains from its float8 values upcast (exact); as fp8 base weights it is refused before
    training: the transformer casts layers' inputs to their weight dtype, which would be float8."""
    folder = tiny_model_dir("minimax-h3")
    path = write_original_layout("minimax-h3", folder, tmp_path / "minimax_fp8_e4m3fn.safetensors",
                                 cast=float8_weights())
    denoiser = _spec("minimax-h3", folder, path).load_denoiser(CPU)
    expected = transformer_state(dequantised_folder(folder, tmp_path / "rounded", _float8_values(torch.float8_e4m3fn)))
    assert denoiser.state_dict().keys() == expected.keys()
    assert all(torch.equal(denoiser.state_dict()[key], expected[key]) for key in expected)
    assert not torch.equal(expected["context_embedder.weight"], transformer_state(folder)["context_embedder.weight"])
    config = build_config({"model": {"name": "minimax-h3", "pretrained": str(folder), "transformer_file": str(path)},
                           "data": {"root": str(tmp_path)}, "memory": {"base_weights": "fp8"}})
    with pytest.raises(ConfigError, match=r"memory\.base_weights=fp8: minimax-h3's transformer casts"):
        _spec("minimax-h3", folder, path, base_weights="fp8").check_training(config)


@pytest.mark.parametrize("base_weights", ["fp8", "auto"])
def test_e5m2_weights_are_kept_as_they_are_or_upcast_exactly(tiny_model_dir, tmp_path, base_weights):
    from vidtune.memory import prepare_base_weights

    folder = tiny_model_dir("ltx-video")
    path = write_original_layout("ltx-video", folder, tmp_path / "ltx_e5m2.safetensors",
                                 cast=float8_weights(torch.float8_e5m2))
    in_file = load_file(str(path))
    denoiser = _spec("ltx-video", folder, path, base_weights=base_weights).load_denoiser(CPU).requires_grad_(False)
    prepare_base_weights(denoiser, base_weights)
    layer = denoiser.transformer_blocks[0].attn1.to_q
    stored = in_file["transformer_blocks.0.attn1.to_q.weight"]
    assert stored.dtype == torch.float8_e5m2
    if base_weights == "fp8":
        assert isinstance(layer, Float8StorageLinear)
        assert layer.weight.dtype == torch.float8_e5m2  # not rounded again to e4m3
        assert torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))
    else:
        assert layer.weight.dtype == torch.float32
        assert torch.equal(layer.weight, stored.to(torch.float32))


@pytest.mark.parametrize("family", ["wan", "skyreels-v2", "minimax-h3"])
@pytest.mark.usefixtures("aligned_weights")
def test_scaled_fp8_is_dequantised_weight_times_scale(make_config, tiny_model_dir, tmp_path, family):
    scale = 0.03
    folder = tiny_model_dir(family)
    path = write_original_layout(family, folder, tmp_path / "fp8_scaled.safetensors",
                                 cast=scaled_float8_weights(scale), extra={"scaled_fp8": torch.zeros(0)})

    def dequantised(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if not (key.endswith(".weight") and tensor.dim() == 2):
            return tensor
        return (tensor / scale).to(torch.float8_e4m3fn).to(torch.float32) * torch.tensor(scale)

    reference_folder = dequantised_folder(folder, tmp_path / "dequantised", dequantised)
    denoiser = _spec(family, folder, path).load_denoiser(CPU)
    expected = transformer_state(reference_folder)
    assert all(torch.equal(denoiser.state_dict()[key], expected[key]) for key in expected)
    key = next(key for key in expected if key.endswith("attn1.to_q.weight") or key.endswith("attn.to_q.weight"))
    assert not torch.equal(expected[key], transformer_state(folder)[key])  # the file's values, not the folder's
    reference = _train(make_config, family, tmp_path / "folder", reference_folder)
    _assert_same_run(reference, _train(make_config, family, tmp_path / "file", folder, path))


@pytest.mark.usefixtures("aligned_weights")
def test_scaled_fp8_as_fp8_base_weights_keeps_the_files_weights_and_scales(make_config, tiny_model_dir, tmp_path):
    """memory.base_weights: fp8 on a scaled fp8 file: each linear layer keeps the file's float8 weight and computes
    with `weight * scale_weight`, so it trains exactly what the dequantised weights train (rounding the dequantised
    weights to float8 again would lose what the scale kept)."""
    from vidtune.memory import prepare_base_weights
    from vidtune.memory.float8 import SCALE_BUFFER

    scale = 0.003  # dequantised values below float8's normal range: rounding them again would change them
    folder = tiny_model_dir("wan")
    path = write_original_layout("wan", folder, tmp_path / "wan_fp8_scaled.safetensors",
                                 cast=scaled_float8_weights(scale), extra={"scaled_fp8": torch.zeros(0)})
    denoiser = _spec("wan", folder, path, base_weights="fp8").load_denoiser(CPU)
    prepare_base_weights(denoiser.requires_grad_(False), "fp8")
    layer = denoiser.get_submodule("blocks.0.attn1.to_q")
    stored = load_file(str(path))["blocks.0.self_attn.q.weight"]
    assert isinstance(layer, Float8StorageLinear) and layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), stored.view(torch.uint8))
    assert getattr(layer, SCALE_BUFFER).item() == pytest.approx(scale)
    assert SCALE_BUFFER not in " ".join(denoiser.state_dict())

    # The reference: the dequantised values in a folder, the float8 layers' biases rounded as fp8 storage rounds them.
    stored_layers = {name for name, module in denoiser.named_modules() if isinstance(module, Float8StorageLinear)}

    def values(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if key.endswith(".weight") and tensor.dim() == 2:
            return (tensor / scale).to(torch.float8_e4m3fn).to(torch.float32) * torch.tensor(scale)
        if key.endswith(".bias") and key.removesuffix(".bias") in stored_layers:
            return tensor.to(torch.float8_e4m3fn).to(torch.float32)
        return tensor

    reference = _train(make_config, "wan", tmp_path / "reference",
                       dequantised_folder(folder, tmp_path / "dequantised", values))
    _assert_same_run(reference, _train(make_config, "wan", tmp_path / "fp8", folder, path, base_weights="fp8"))


def test_scaled_fp8_made_for_float8_matmuls_is_refused_before_loading(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("wan")
    path = write_original_layout("wan", folder, tmp_path / "wan_fp8_scaled.safetensors",
                                 cast=scaled_float8_weights(scale_input=True), extra={"scaled_fp8": torch.zeros(0)})
    with pytest.raises(ModelError, match=r"(?s)scale_input.*What to do: use the model's plain fp8") as error:
        _spec("wan", folder, path).check_source()
    assert str(path) in str(error.value)


def test_comfyuis_mixed_precision_quantisation_format_is_refused_with_the_reason(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("wan")

    def quantised(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not (key.endswith(".weight") and tensor.dim() == 2):
            return {key: tensor}
        layer = key.removesuffix(".weight")
        return {key: tensor.to(torch.float8_e4m3fn), f"{layer}.weight_scale": torch.tensor(1.0),
                f"{layer}.comfy_quant": torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)}

    path = write_original_layout("wan", folder, tmp_path / "wan_mixed.safetensors", cast=quantised)
    with pytest.raises(ModelError, match=r"(?s)mixed-precision quantisation format.*plain fp8"):
        _spec("wan", folder, path).check_source()


# ----- files that are not the family's transformer --------------------------------------------------------------
def test_an_adapter_file_is_named_as_one(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("wan")
    path = tmp_path / "my_lora.safetensors"
    save_file({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 24),
               "blocks.0.self_attn.q.lora_B.weight": torch.zeros(24, 4)}, str(path))
    with pytest.raises(ModelError, match=r"model.transformer_file: .*my_lora.safetensors is not a wan transformer"
                                         r".*adapter \(LoRA\) file"):
        _spec("wan", folder, path).check_source()


def test_another_familys_file_says_what_diffusers_recognises(tiny_model_dir, tmp_path):
    path = write_original_layout("wan", tiny_model_dir("wan"), tmp_path / "wan.safetensors", prefix=COMFYUI_PREFIX)
    with pytest.raises(ModelError, match=r"is not a ltx-video transformer.*recognises it as a `wan-"):
        _spec("ltx-video", tiny_model_dir("ltx-video"), path).check_source()


def test_a_pipeline_file_without_the_transformer_is_named_as_one(tiny_model_dir, tmp_path):
    path = tmp_path / "pipeline.safetensors"
    save_file({"vae.decoder.conv_in.weight": torch.zeros(2, 2),
               "text_encoders.t5xxl.encoder.block.0.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ModelError, match=r"holds a VAE and text encoders beside a model \(a whole-pipeline"):
        _spec("ltx-video", tiny_model_dir("ltx-video"), path).check_source()


def test_a_file_of_another_size_names_a_tensor_and_both_shapes(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("ltx-video")
    path = write_original_layout("ltx-video", folder, tmp_path / "ltx.safetensors")
    state = load_file(str(path))
    state["patchify_proj.weight"] = torch.zeros(64, 256)
    save_file(state, str(path))
    with pytest.raises(ModelError, match=r"another size.*patchify|proj_in.weight: \[64, 256\] in the file"):
        _spec("ltx-video", folder, path).check_source()


@pytest.mark.parametrize("name", ["model.ckpt", "model.gguf", "missing.safetensors"])
def test_files_vidtune_does_not_read_are_refused_by_name(tiny_model_dir, tmp_path, name):
    path = tmp_path / name
    if name != "missing.safetensors":
        path.write_bytes(b"not a model")
    with pytest.raises(ModelError, match=rf"model.transformer_file: .*{name}"):
        _spec("ltx-video", tiny_model_dir("ltx-video"), path).check_source()


def test_a_damaged_file_is_refused_plainly(tiny_model_dir, tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelError, match=r"(?s)cannot be read as a .safetensors file.*download it again"):
        _spec("ltx-video", tiny_model_dir("ltx-video"), path).check_source()


@pytest.mark.parametrize("family", ["cogvideox", "hunyuan-video-1.5"])
def test_families_without_a_diffusers_converter_are_refused_with_the_reason(tiny_model_dir, tmp_path, family):
    path = tmp_path / "transformer.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(ModelError, match=r"cannot load its transformer from a single file: diffusers has no converter"):
        _spec(family, tiny_model_dir(family), path).check_source()


def test_a_pruned_minimax_h3_file_is_refused_with_diffusers_reason(tiny_model_dir, tmp_path):
    """The pruned MiniMax H3 files hold a table of time embeddings (`adaln_t_table`) in place of the time embedder,
    which diffusers' transformer has no place for: refused before any weight is read, saying so."""
    folder = tiny_model_dir("minimax-h3")
    full = write_original_layout("minimax-h3", folder, tmp_path / "full.safetensors")
    pruned = {key: tensor for key, tensor in load_file(str(full)).items() if not key.startswith("time_embedder.")}
    save_file({**pruned, "adaln_t_table": torch.zeros(8, 32)}, str(tmp_path / "pruned.safetensors"))
    with pytest.raises(ModelError, match=r"model\.transformer_file: .*pruned.safetensors is not a minimax-h3 "
                                         r"transformer.*pruned MiniMax-H3 checkpoint.*adaln_t_table"):
        _spec("minimax-h3", folder, tmp_path / "pruned.safetensors").load_denoiser(CPU)


@pytest.mark.parametrize("family, reason", [("mochi", "48 blocks"), ("hunyuan-video", "width 3072")])
def test_converters_made_for_the_released_sizes_refuse_others_with_the_reason(tiny_model_dir, tmp_path, family,
                                                                               reason):
    path = tmp_path / "transformer.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    with pytest.raises(ModelError, match=reason):
        _spec(family, tiny_model_dir(family), path).check_source()


def test_both_experts_of_a_two_expert_model_load_from_their_files(tmp_path):
    from vidtune.models.tiny.wan22 import write_tiny_wan22

    folder = write_tiny_wan22(tmp_path / "a14b", two_experts=True)
    files = {name: write_original_layout("wan", folder, tmp_path / f"wan2.2_{name}.safetensors",
                                         prefix=COMFYUI_PREFIX, component=name)
             for name in ("transformer", "transformer_2")}
    config = ModelConfig(name="wan2.2", pretrained=str(folder), transformer_file=str(files["transformer"]),
                         transformer_2_file=str(files["transformer_2"]))
    spec = get_spec_class("wan2.2")(config)
    spec.check_source()
    pair = spec.load_denoiser(CPU)
    for name, expert in zip(("transformer", "transformer_2"), pair.experts(), strict=True):
        expected = transformer_state(folder, name)
        assert all(torch.equal(expert.state_dict()[key], expected[key]) for key in expected), name
    high, low = (transformer_state(folder, name)["proj_out.weight"] for name in ("transformer", "transformer_2"))
    assert not torch.equal(high, low)  # each expert from its own file


def test_a_second_transformer_file_needs_a_second_transformer(tiny_model_dir, tmp_path):
    path = write_original_layout("wan", tiny_model_dir("wan"), tmp_path / "wan.safetensors")
    config = ModelConfig(name="wan", pretrained=str(tiny_model_dir("wan")), transformer_2_file=str(path))
    with pytest.raises(ModelError, match=r"model.transformer_2_file: .* has no transformer_2"):
        get_spec_class("wan")(config).check_source()


def test_the_file_and_a_transformer_subfolder_cannot_both_be_given(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("wan")
    with pytest.raises(ConfigError, match=r"model.transformer_file and model.subfolders.transformer"):
        build_config({"model": {"name": "wan", "pretrained": str(folder), "transformer_file": str(tmp_path / "x"),
                                "subfolders": {"transformer": str(folder / "transformer")}},
                      "data": {"root": str(tmp_path)}})


# ----- the planner -----------------------------------------------------------------------------------------------
def _plan(tiny_model_dir, path: Path, base_weights: str):
    from vidtune.memory.plan import plan_memory
    from vidtune.models.tiny import TINY_SHAPES

    frames, height, width = TINY_SHAPES["wan"]
    return plan_memory(build_config({
        "model": {"name": "wan", "pretrained": str(tiny_model_dir("wan")), "transformer_file": str(path)},
        "data": {"root": ".", "frames": frames, "height": height, "width": width},
        "training": {"device": "cpu"}, "precompute": {"enabled": True}, "memory": {"base_weights": base_weights}}))


def test_the_planner_reads_the_files_size_and_dtype(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    path = write_original_layout("wan", tiny_model_dir("wan"), tmp_path / "wan_fp8.safetensors", cast=float8_weights())
    kept, upcast = _plan(tiny_model_dir, path, "fp8"), _plan(tiny_model_dir, path, "auto")
    assert any("wan_fp8.safetensors" in note and "float8_e4m3fn" in note and "stay as they are" in note
               for note in kept.notes)
    assert any("upcast to float32" in note and "`fp8` keeps" in note for note in upcast.notes)
    fp32_weights = sum(tensor.numel() * 4 for tensor in transformer_state(tiny_model_dir("wan")).values())
    assert upcast.host_loading > fp32_weights  # the file, then the weights upcast
    assert path.stat().st_size <= kept.host_loading < upcast.host_loading  # float8 weights loaded as float8


def test_the_planner_refuses_a_file_that_is_not_the_transformer(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDTUNE_PLAN_CACHE", str(tmp_path / "traces"))
    path = tmp_path / "my_lora.safetensors"
    save_file({"blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 24)}, str(path))
    with pytest.raises(ModelError, match="adapter"):
        _plan(tiny_model_dir, path, "auto")


def test_sampling_a_full_fine_tune_uses_its_trained_transformer_not_the_file(make_config, tiny_model_dir, tmp_path):
    from vidtune.sampling import load_pipeline

    folder = tiny_model_dir("ltx-video")
    path = write_original_layout("ltx-video", folder, tmp_path / "ltx.safetensors")
    output = tmp_path / "full"
    config = make_config("ltx-video", model={"pretrained": str(folder), "transformer_file": str(path)},
                         training={"algorithm": "full", "steps": 1}, output_dir=str(output))
    build_trainer(config).run()
    trained = transformer_state(output)
    run = load_pipeline(output, device="cpu")
    sampled = run.pipeline.transformer.state_dict()
    assert all(torch.equal(sampled[key], trained[key]) for key in trained)
    assert not torch.equal(trained["proj_out.weight"], transformer_state(folder)["proj_out.weight"])
