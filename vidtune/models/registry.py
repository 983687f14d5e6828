"""Model families by name. Adding a family is its spec module under models/, its tiny model under models/tiny/
(a module of the same name) and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vidtune.errors import ConfigError

if TYPE_CHECKING:  # the registry itself imports no family (nor torch): a name is checked without them
    from vidtune.models.spec import ModelSpec
    from vidtune.models.tiny.common import TinyFamily

# name -> "module:class", imported lazily so one family's imports never slow down another's.
SPECS: dict[str, str] = {
    "ltx-video": "vidtune.models.ltx_video:LTXVideoSpec",
    "ltx-video-i2v": "vidtune.models.ltx_video:LTXVideoImageToVideoSpec",
    "ltx-2": "vidtune.models.ltx_2:LTX2Spec",
    "ltx-2-i2v": "vidtune.models.ltx_2:LTX2ImageToVideoSpec",
    "cogvideox": "vidtune.models.cogvideox:CogVideoXSpec",
    "cogvideox-i2v": "vidtune.models.cogvideox:CogVideoXI2VSpec",
    "mochi": "vidtune.models.mochi:MochiSpec",
    "hunyuan-video": "vidtune.models.hunyuan_video:HunyuanVideoSpec",
    "hunyuan-video-1.5": "vidtune.models.hunyuan_video15:HunyuanVideo15Spec",
    "hunyuan-video-1.5-i2v": "vidtune.models.hunyuan_video15:HunyuanVideo15ImageToVideoSpec",
    "wan": "vidtune.models.wan:WanSpec",
    "wan-i2v": "vidtune.models.wan:WanImageToVideoSpec",
    "wan2.2": "vidtune.models.wan22:Wan22Spec",
    "wan2.2-i2v": "vidtune.models.wan22:Wan22ImageToVideoSpec",
    "wan-animate": "vidtune.models.wan_animate:WanAnimateSpec",
    "skyreels-v2": "vidtune.models.skyreels_v2:SkyReelsV2Spec",
    "skyreels-v2-i2v": "vidtune.models.skyreels_v2:SkyReelsV2ImageToVideoSpec",
    "skyreels-v2-df": "vidtune.models.skyreels_v2:SkyReelsV2DiffusionForcingSpec",
    "sana-video": "vidtune.models.sana_video:SanaVideoSpec",
    "sana-video-i2v": "vidtune.models.sana_video:SanaVideoImageToVideoSpec",
    "kandinsky-5": "vidtune.models.kandinsky5:Kandinsky5Spec",
    "kandinsky-5-i2v": "vidtune.models.kandinsky5:Kandinsky5ImageToVideoSpec",
    "wan-vace": "vidtune.models.wan_vace:WanVACESpec",
    "cosmos-predict-2.5": "vidtune.models.cosmos_predict25:CosmosPredict25Spec",
    "cosmos-predict-2.5-v2w": "vidtune.models.cosmos_predict25:CosmosPredict25VideoToWorldSpec",
    "minimax-h3": "vidtune.models.minimax_h3:MiniMaxH3Spec",
}


def available_models() -> list[str]:
    return sorted(SPECS)


def get_spec_class(name: str) -> type[ModelSpec]:
    if name not in SPECS:
        raise ConfigError(f"model.name: unknown model '{name}'.\nWhat to do: choose one of "
                          f"{', '.join(available_models())}.")
    module_name, class_name = SPECS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def tiny_module_name(name: str) -> str:
    """The module holding a family's tiny model: the spec module's namesake under `vidtune.models.tiny`
    (`vidtune.models.wan:WanSpec` -> `vidtune.models.tiny.wan`)."""
    if name not in SPECS:
        raise ConfigError(f"model.name: unknown model '{name}'; choose one of {', '.join(available_models())}")
    spec_module = SPECS[name].split(":")[0]
    return "vidtune.models.tiny." + spec_module.rsplit(".", 1)[-1]


def tiny_family(name: str) -> TinyFamily:
    """A family's tiny model, clip shape and overfit settings: `TINY[name]` in its tiny module."""
    module_name = tiny_module_name(name)
    path = module_name.replace(".", "/") + ".py"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise LookupError(f"model family '{name}' has no tiny model: add {path} with TINY = "
                          f"{{'{name}': TinyFamily(...)}} (see docs/adding_a_model.md)") from None
    tiny = getattr(module, "TINY", {})
    if name not in tiny:
        raise LookupError(f"model family '{name}' has no tiny model: {path} declares none in TINY for it "
                          f"(it has: {', '.join(sorted(tiny)) or 'none'})")
    return tiny[name]
