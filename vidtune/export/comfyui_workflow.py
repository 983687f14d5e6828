"""The ComfyUI workflow written beside a ComfyUI LoRA: the run's validation sample, as ComfyUI samples it.

`<run>_workflow.json` (ComfyUI's API format, vidtune/export/comfyui_graph.py) loads the family's model files
under the names Comfy-Org's repackaged files have, applies the run's LoRA (strength 1) to each denoiser it
trained, encodes the validation prompt (and the empty negative prompt validation uses), makes the latent at the
validation size and frames (from the start image for image-to-video), and samples it with ComfyUI's Euler sampler
through the sigmas of `validation.comfyui_scheduler` / `comfyui_shift` with the validation steps, guidance and
seed; then decodes it and saves an mp4 at the run's frame rate. `validation.sampler: comfyui` samples the run's
own sheets through the same sigmas (vidtune/export/comfyui_sigmas.py), so the two show the same thing.

The node layout of each family follows ComfyUI's own templates (the `comfyui-workflow-templates` package:
`ltxv_text_to_video`, `ltxv_image_to_video`, `video_ltx2_t2v`, `video_ltx2_i2v`, `text_to_video_wan`,
`image_to_video_wan`, `video_wan2_2_14B_t2v`, `video_wan2_2_5B_ti2v`, `video_wan_vace_14B_v2v`,
`hunyuan_video_text_to_video`, `video_hunyuan_video_1.5_720p_t2v`, `video_kandinsky5_t2v` / `_i2v`), with the
sampler chain of `SamplerCustomAdvanced` (noise, guider, sampler, sigmas) so the sigmas are explicit; a two-expert
Wan 2.2 splits them at its boundary (`SplitSigmas`), the high-noise expert sampling the first part and the
low-noise expert the rest, as the pipeline routes them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidtune.export.comfyui_graph import Graph, Link, problems
from vidtune.export.comfyui_sigmas import ComfyUISchedule, Scheduler
from vidtune.files import atomic_write_text

NEGATIVE_PROMPT = ""  # validation samples guide against the empty caption
PROMPT_PLACEHOLDER = "Write your prompt here"


def workflow_file(name: str) -> str:
    """The workflow's file name beside the run's ComfyUI LoRA (`name`: the run folder's name)."""
    return f"{name}_workflow.json"


@dataclass(frozen=True)
class ModelFiles:
    """The model files a workflow loads, as named in ComfyUI's model folders (Comfy-Org's repackaged files)."""

    diffusion_models: tuple[str, ...] = ()  # models/diffusion_models (UNETLoader), one per denoiser
    text_encoders: tuple[str, ...] = ()  # models/text_encoders (CLIPLoader, DualCLIPLoader)
    clip_type: str = ""  # the loader's `type`
    vae: str = ""  # models/vae
    checkpoint: str = ""  # models/checkpoints (CheckpointLoaderSimple): LTX-Video's, which holds the VAE too
    clip_vision: str = ""  # models/clip_vision: Wan 2.1 image-to-video's image encoder


@dataclass(frozen=True)
class WorkflowInputs:
    """What the workflow samples: the run's validation settings."""

    prompt: str
    frames: int
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    frame_rate: float
    schedule: ComfyUISchedule
    loras: tuple[str | None, ...]  # the ComfyUI LoRA file of each denoiser (None: that one was not trained)
    start_image: str = ""  # ComfyUI/input file an image-to-video workflow starts from
    control_video: str = ""  # ComfyUI/input file a control workflow (Wan VACE) follows
    name: str = "vidtune"  # the saved video's file name prefix


@dataclass(frozen=True)
class Parts:
    """What a family's loaders give the shared sampler chain."""

    models: list[Link]  # one per denoiser, LoRA applied and shift set
    positive: Link
    negative: Link | None  # None: guided by an embedding (BasicGuider, cfg 1)
    latent: Link
    vae: Link
    sigmas_from_latent: bool = False  # LTXVScheduler: its shift follows the latent's size
    # What the family's pipeline does to the sampled latent before decoding (Kandinsky 5 image-to-video's first
    # frames, LTX-2's audio): the latent to decode and the audio to put in the video, if any.
    finish: Callable[[Graph, Link], tuple[Link, Link | None]] | None = None


def _text(graph: Graph, clip: Link, inputs: WorkflowInputs) -> tuple[Link, Link]:
    positive = graph.add("CLIPTextEncode", "Prompt", text=inputs.prompt, clip=clip)
    negative = graph.add("CLIPTextEncode", "Negative prompt (empty, as validation)", text=NEGATIVE_PROMPT, clip=clip)
    return positive, negative


def _with_lora(graph: Graph, model: Link, lora: str | None, number: int) -> Link:
    if lora is None:
        return model
    return graph.add("LoraLoaderModelOnly", f"The run's LoRA{f' ({number + 1})' if number else ''}", model=model,
                     lora_name=lora, strength_model=1.0)


def _unet_models(graph: Graph, files: ModelFiles, inputs: WorkflowInputs) -> list[Link]:
    """UNETLoader per denoiser, its LoRA, and ModelSamplingSD3 with the schedule's shift."""
    models = []
    for number, name in enumerate(files.diffusion_models):
        model = graph.add("UNETLoader", unet_name=name, weight_dtype="default")
        model = _with_lora(graph, model, inputs.loras[number] if number < len(inputs.loras) else None, number)
        models.append(graph.add("ModelSamplingSD3", "Shift", model=model, shift=inputs.schedule.shift))
    return models


def _text_encoder(graph: Graph, files: ModelFiles) -> Link:
    if len(files.text_encoders) == 2:
        return graph.add("DualCLIPLoader", clip_name1=files.text_encoders[0], clip_name2=files.text_encoders[1],
                         type=files.clip_type, device="default")
    return graph.add("CLIPLoader", clip_name=files.text_encoders[0], type=files.clip_type, device="default")


def _size(inputs: WorkflowInputs) -> dict[str, int]:
    return {"width": inputs.width, "height": inputs.height, "length": inputs.frames, "batch_size": 1}


def _start_image(graph: Graph, inputs: WorkflowInputs) -> Link:
    return graph.add("LoadImage", "Start image (put it in ComfyUI/input)", image=inputs.start_image)


# ----- the families -------------------------------------------------------------------------------------------
def ltxv_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, image: bool) -> Parts:
    """LTX-Video (`ltxv_text_to_video`, `ltxv_image_to_video`): the checkpoint holds model and VAE; T5 as `ltxv`;
    LTXVConditioning gives the frame rate; LTXVScheduler's sigmas follow the latent's size."""
    checkpoint = graph.add("CheckpointLoaderSimple", ckpt_name=files.checkpoint)
    model, _, vae = graph.outputs(checkpoint, 3)
    model = _with_lora(graph, model, inputs.loras[0], 0)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    conditioned = graph.add("LTXVConditioning", positive=positive, negative=negative, frame_rate=inputs.frame_rate)
    positive, negative = graph.outputs(conditioned, 2)
    if image:
        made = graph.add("LTXVImgToVideo", positive=positive, negative=negative, vae=vae,
                         image=_start_image(graph, inputs), **_size(inputs), strength=1.0)
        positive, negative, latent = graph.outputs(made, 3)
    else:
        latent = graph.add("EmptyLTXVLatentVideo", **_size(inputs))
    return Parts([model], positive, negative, latent, vae, sigmas_from_latent=True)


def ltx2_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, image: bool) -> Parts:
    """LTX-2 (`video_ltx2_t2v`, `video_ltx2_i2v`, their first stage at the validation size): the checkpoint holds
    the model, both VAEs and the text connectors, Gemma 3 loads beside it (LTXAVTextEncoderLoader); video and audio
    latents are sampled together (LTXVConcatAVLatent, the start image in place for image-to-video), then split,
    decoded each, and the sound muxed into the video."""
    checkpoint = graph.add("CheckpointLoaderSimple", ckpt_name=files.checkpoint)
    model, _, vae = graph.outputs(checkpoint, 3)
    model = _with_lora(graph, model, inputs.loras[0], 0)
    clip = graph.add("LTXAVTextEncoderLoader", text_encoder=files.text_encoders[0], ckpt_name=files.checkpoint)
    positive, negative = _text(graph, clip, inputs)
    conditioned = graph.add("LTXVConditioning", positive=positive, negative=negative, frame_rate=inputs.frame_rate)
    positive, negative = graph.outputs(conditioned, 2)
    video = graph.add("EmptyLTXVLatentVideo", **_size(inputs))
    if image:
        video = graph.add("LTXVImgToVideoInplace", vae=vae, image=_start_image(graph, inputs), latent=video,
                          strength=1.0, bypass=False)
    audio_vae = graph.add("LTXVAudioVAELoader", ckpt_name=files.checkpoint)
    audio = graph.add("LTXVEmptyLatentAudio", frames_number=inputs.frames, frame_rate=round(inputs.frame_rate),
                      batch_size=1, audio_vae=audio_vae)
    latent = graph.add("LTXVConcatAVLatent", video_latent=video, audio_latent=audio)

    def finish(graph: Graph, sampled: Link) -> tuple[Link, Link]:
        video, audio = graph.outputs(graph.add("LTXVSeparateAVLatent", av_latent=sampled), 2)
        return video, graph.add("LTXVAudioVAEDecode", samples=audio, audio_vae=audio_vae)

    return Parts([model], positive, negative, latent, vae, sigmas_from_latent=True, finish=finish)


def wan_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, image: bool, latent_node: str) -> Parts:
    """Wan 2.1 / 2.2 and SkyReels V2 (`text_to_video_wan`, `image_to_video_wan`, `video_wan2_2_14B_t2v`,
    `video_wan2_2_5B_ti2v`): umT5 as `wan`; the latent from EmptyHunyuanLatentVideo (2.1 text-to-video),
    WanImageToVideo (image-to-video; with CLIP vision for 2.1) or Wan22ImageToVideoLatent (TI2V-5B)."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    if latent_node == "Wan22ImageToVideoLatent":
        latent = graph.add(latent_node, vae=vae, **_size(inputs),
                           start_image=_start_image(graph, inputs) if image else None)
    elif image:
        vision = None
        start = _start_image(graph, inputs)
        if files.clip_vision:
            loader = graph.add("CLIPVisionLoader", clip_name=files.clip_vision)
            vision = graph.add("CLIPVisionEncode", clip_vision=loader, image=start, crop="none")
        made = graph.add("WanImageToVideo", positive=positive, negative=negative, vae=vae, **_size(inputs),
                         clip_vision_output=vision, start_image=start)
        positive, negative, latent = graph.outputs(made, 3)
    else:
        latent = graph.add("EmptyHunyuanLatentVideo", **_size(inputs))
    return Parts(models, positive, negative, latent, vae)


def wan_vace_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs) -> Parts:
    """Wan VACE (`video_wan_vace_14B_v2v`): Wan 2.1's loaders, the control video (LoadVideo, its frames) into
    WanVaceToVideo, and the reference frames it puts in front trimmed after sampling (TrimVideoLatent)."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    video = graph.add("LoadVideo", "Control video (put it in ComfyUI/input)", file=inputs.control_video)
    frames = graph.add("GetVideoComponents", video=video)
    made = graph.add("WanVaceToVideo", positive=positive, negative=negative, vae=vae, **_size(inputs), strength=1.0,
                     control_video=frames)
    positive, negative, latent, trim = graph.outputs(made, 4)

    def finish(graph: Graph, sampled: Link) -> tuple[Link, None]:
        return graph.add("TrimVideoLatent", samples=sampled, trim_amount=trim), None

    return Parts(models, positive, negative, latent, vae, finish=finish)


def hunyuan_video_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, embedded: float | None) -> Parts:
    """HunyuanVideo (`hunyuan_video_text_to_video`): CLIP-L and LLaVA-Llama-3 as `hunyuan_video`; a
    guidance-distilled model is told `embedded` (model.guidance_scale) by FluxGuidance; true classifier-free
    guidance against the empty prompt only above 1 (as validation: HunyuanVideoPipeline's `true_cfg_scale`),
    else BasicGuider."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    latent = graph.add("EmptyHunyuanLatentVideo", **_size(inputs))
    if embedded is not None:
        positive = graph.add("FluxGuidance", "Embedded guidance", conditioning=positive, guidance=embedded)
        negative = graph.add("FluxGuidance", "Embedded guidance", conditioning=negative, guidance=embedded)
    return Parts(models, positive, negative if inputs.guidance > 1.0 else None, latent, vae)


def hunyuan_video15_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, image: bool) -> Parts:
    """HunyuanVideo 1.5 (`video_hunyuan_video_1.5_720p_t2v` / `_i2v`): Qwen2.5-VL and ByT5 as
    `hunyuan_video_15`; EmptyHunyuanVideo15Latent, or HunyuanVideo15ImageToVideo from the start image."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    if image:
        start = _start_image(graph, inputs)
        loader = graph.add("CLIPVisionLoader", clip_name=files.clip_vision)
        vision = graph.add("CLIPVisionEncode", clip_vision=loader, image=start, crop="center")
        made = graph.add("HunyuanVideo15ImageToVideo", positive=positive, negative=negative, vae=vae,
                         **_size(inputs), start_image=start, clip_vision_output=vision)
        positive, negative, latent = graph.outputs(made, 3)
    else:
        latent = graph.add("EmptyHunyuanVideo15Latent", **_size(inputs))
    return Parts(models, positive, negative, latent, vae)


def mochi_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs) -> Parts:
    """Mochi: T5-XXL as `mochi`, EmptyMochiLatentVideo."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    return Parts(models, positive, negative, graph.add("EmptyMochiLatentVideo", **_size(inputs)), vae)


def kandinsky5_parts(graph: Graph, files: ModelFiles, inputs: WorkflowInputs, image: bool) -> Parts:
    """Kandinsky 5 (`video_kandinsky5_t2v` / `_i2v`): Qwen2.5-VL and CLIP-L as `kandinsky5`, HunyuanVideo's VAE,
    Kandinsky5ImageToVideo for the latent (with a start image for image-to-video)."""
    models = _unet_models(graph, files, inputs)
    positive, negative = _text(graph, _text_encoder(graph, files), inputs)
    vae = graph.add("VAELoader", vae_name=files.vae)
    made = graph.add("Kandinsky5ImageToVideo", positive=positive, negative=negative, vae=vae, **_size(inputs),
                     start_image=_start_image(graph, inputs) if image else None)
    positive, negative, latent, start = graph.outputs(made, 4)

    def finish(graph: Graph, sampled: Link) -> tuple[Link, None]:
        # Kandinsky5I2VPipeline's ending: the clean start frames, then its first four latent frames normalized
        # to the next five (`normalize_first_frame`), as the template's two nodes do.
        replaced = graph.add("ReplaceVideoLatentFrames", destination=sampled, source=start, index=0)
        return graph.add("NormalizeVideoLatentStart", latent=replaced, start_frame_count=4,
                         reference_frame_count=5), None

    return Parts(models, positive, negative, latent, vae, finish=finish if image else None)


# ----- the shared sampler chain -------------------------------------------------------------------------------
def _guider(graph: Graph, parts: Parts, model: Link, guidance: float) -> Link:
    if parts.negative is None:
        return graph.add("BasicGuider", model=model, conditioning=parts.positive)
    return graph.add("CFGGuider", model=model, positive=parts.positive, negative=parts.negative, cfg=guidance)


def _sigmas(graph: Graph, parts: Parts, inputs: WorkflowInputs) -> Link:
    if inputs.schedule.scheduler == "ltxv":
        return graph.add("LTXVScheduler", steps=inputs.steps, max_shift=2.05, base_shift=0.95, stretch=True,
                         terminal=0.1, latent=parts.latent if parts.sigmas_from_latent else None)
    return graph.add("BasicScheduler", model=parts.models[0], scheduler=inputs.schedule.scheduler,
                     steps=inputs.steps, denoise=1.0)


def sample(graph: Graph, parts: Parts, inputs: WorkflowInputs, split_at: int | None = None) -> None:
    """Noise, guider, Euler and the sigmas into SamplerCustomAdvanced; with two denoisers the sigmas split at step
    `split_at` (the first denoiser before, the second from there, without new noise); decode, save an mp4."""
    noise = graph.add("RandomNoise", "Seed (validation.seed)", noise_seed=inputs.seed)
    sampler = graph.add("KSamplerSelect", sampler_name="euler")
    sigmas = _sigmas(graph, parts, inputs)
    latent = parts.latent
    if len(parts.models) == 2:
        if split_at is None:
            raise ValueError("two denoisers need the step their sigmas split at")
        split = graph.add("SplitSigmas", "Expert boundary", sigmas=sigmas, step=split_at)
        high, low = graph.outputs(split, 2)
        first = graph.add("SamplerCustomAdvanced", "High-noise expert", noise=noise,
                          guider=_guider(graph, parts, parts.models[0], inputs.guidance), sampler=sampler,
                          sigmas=high, latent_image=latent)
        latent = graph.add("SamplerCustomAdvanced", "Low-noise expert", noise=graph.add("DisableNoise"),
                           guider=_guider(graph, parts, parts.models[1], inputs.guidance), sampler=sampler,
                           sigmas=low, latent_image=first)
    else:
        latent = graph.add("SamplerCustomAdvanced", noise=noise,
                           guider=_guider(graph, parts, parts.models[0], inputs.guidance), sampler=sampler,
                           sigmas=sigmas, latent_image=latent)
    audio = None
    if parts.finish is not None:
        latent, audio = parts.finish(graph, latent)
    images = graph.add("VAEDecode", samples=latent, vae=parts.vae)
    video = graph.add("CreateVideo", images=images, fps=float(inputs.frame_rate), audio=audio)
    graph.add("SaveVideo", video=video, filename_prefix=f"video/{inputs.name}", format="auto", codec="auto")


# ----- writing it ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkflowLayout:
    """A family's workflow: its model files and how its loaders and latent are laid out (`parts`, one of the
    functions above with the family's choices bound); a two-denoiser model also its `boundary`, the noise level
    from which the second denoiser samples (the pipeline's `boundary_ratio`)."""

    files: ModelFiles
    parts: Callable[[Graph, ModelFiles, WorkflowInputs], Parts]
    scheduler: Scheduler = "simple"  # the default of validation.comfyui_scheduler
    boundary: float | None = None

    def split_step(self, sigmas: Any) -> int:
        """The step SplitSigmas splits at: the number of steps whose noise level is at or above the boundary
        (the pipeline gives the first denoiser every timestep >= boundary_ratio * 1000)."""
        if self.boundary is None:
            raise ValueError("a split needs the boundary of the two denoisers")
        return int((sigmas[:-1] >= self.boundary).sum())


def build_workflow(layout: WorkflowLayout, inputs: WorkflowInputs, family: str) -> dict[str, Any]:
    """The API-format workflow of a family's `layout` for `inputs`, checked against ComfyUI's node definitions."""
    graph = Graph()
    parts = layout.parts(graph, layout.files, inputs)
    split = layout.split_step(inputs.schedule.sigmas(inputs.steps)) if len(parts.models) == 2 else None
    sample(graph, parts, inputs, split)
    api = graph.api()
    found = problems(api)
    if found:  # vidtune's own layout is wrong: never write a workflow ComfyUI would refuse
        raise ValueError(f"the {family} workflow does not match ComfyUI's node definitions: " + "; ".join(found))
    return api


def pipeline_shift(scheduler_config: dict[str, Any]) -> float:
    """The fixed shift of a family's diffusers scheduler (`shift`, UniPC's `flow_shift`): the default of
    `validation.comfyui_shift`, so the workflow samples at the noise levels the family's pipeline favours."""
    for key in ("flow_shift", "shift"):
        value = scheduler_config.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 1.0


def write_workflow(path: str | os.PathLike[str], api: dict[str, Any]) -> Path:
    atomic_write_text(Path(path), json.dumps(api, indent=2, ensure_ascii=False) + "\n")
    return Path(path)
