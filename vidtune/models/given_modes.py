"""What the specs of families with conditioning modes share, beside the draws and regions of
vidtune/models/conditioning.py. Two ways of giving a sample its latents:

- in place (the LTX families, `InPlaceModes`): the given latents replace the noisy ones, their tokens run at
  timestep 0 and stay out of the loss; the last frame is a keyframe's extra tokens, which only some samples of a batch
  may carry: a batch mixing the two token layouts runs in one call, the extra tokens of the samples without one
  padding hidden from their attention (vidtune/models/key_mask.py);
- on channels (CogVideoX and HunyuanVideo 1.5 image-to-video, `ChannelModes`): the pipelines concatenate a condition
  beside the noisy latents on the channel dimension, the first frame's latents in latent frame 0 and zeros after it
  (HunyuanVideo 1.5 with a mask channel saying where). A mode puts other latents there: a clip to extend in its first
  latent frames, the last frame in the last latent frame, a kept region where the family has a mask channel. The
  pipeline still denoises every latent frame from noise, guided by the condition, so the denoiser predicts the given
  frames too and the loss keeps them, as it keeps the first frame these families have always been given. Every
  sample is conditioned: one drawn into no mode is given its first frame.

A spec mixes one in before its family's class; it reads the spec's `config` (the model section) and `compression`
((VAE spatial ratio, VAE temporal ratio, patch, temporal patch)). The family keeps what differs: how its denoiser is
called with the given latents, and the pipeline that samples each mode (`modes_pipeline`, named in messages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vidtune.errors import ModelError
from vidtune.models import conditioning
from vidtune.models.conditioning import Given
from vidtune.models.spec import frames_to_pil

if TYPE_CHECKING:
    from vidtune.config import Config, ModelConfig

Conditions = dict[str, torch.Tensor]


class ModeSettings:
    """What any family with modes reads from `model.conditioning`, and the checks of its clips and given frames."""

    config: ModelConfig
    compression: tuple[int, int, int, int | None]
    name: str
    modes_pipeline: ClassVar[str] = "the family's condition pipeline"

    @property
    def modes_on(self) -> bool:
        """Conditioning modes beside the first frame are drawn (`model.conditioning`)."""
        return bool(self.config.conditioning.enabled)

    @property
    def takes_last_frame(self) -> bool:
        return any(mode in self.config.conditioning.enabled for mode in conditioning.LAST_FRAME_MODES)

    @property
    def extension_latent_frames(self) -> int:
        """Latent frames of the `extension_frames` given frames (the VAE is causal in time: the clip's first latent
        frames are what encoding those frames alone gives)."""
        return (self.config.conditioning.extension_frames - 1) // self.compression[1] + 1

    def inpaint_region(self, conditions: Conditions, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """[1 or B, 1, F, H, W]: what inpainting keeps: what the clip's mask leaves black, else what
        `model.conditioning.mask_rectangle` leaves."""
        frames, height, width = shape[-3:]
        if conditioning.INPUT_MASK in conditions:
            kept = conditioning.mask_region(conditions[conditioning.INPUT_MASK], frames, height, width)
        else:
            modes = self.config.conditioning
            kept = conditioning.rectangle_region(modes.mask_rectangle, modes.mask_rectangle_generated,
                                                 frames, height, width)
        return kept.to(conditions[conditioning.LATENTS].device)

    def given_region(self, conditions: Conditions, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """[B, 1, F, H, W]: what each sample of a modes batch is given in place (1.0), by its drawn mode."""
        return conditioning.region(conditions[conditioning.MODE], shape, self.extension_latent_frames,
                                   self.inpaint_region(conditions, shape))

    def extension_problems(self, frames: int) -> list[str]:
        """What keeps `model.conditioning.extension` from clips of `frames` frames."""
        modes, temporal = self.config.conditioning, self.compression[1]
        problems = []
        if modes.extension > 0 and (modes.extension_frames - 1) % temporal:
            problems.append(f"model.conditioning.extension_frames={modes.extension_frames}: {self.modes_pipeline} "
                            f"takes a clip of k x {temporal} + 1 frames; use "
                            f"{(modes.extension_frames - 1) // temporal * temporal + 1} or "
                            f"{-(-(modes.extension_frames - 1) // temporal) * temporal + 1}")
        if modes.extension > 0 and frames > 1 and modes.extension_frames >= frames:
            problems.append(f"model.conditioning.extension_frames={modes.extension_frames} gives all {frames} frames "
                            "of a clip (data.frames): nothing is left to learn; give fewer frames")
        return problems

    def optional_inputs(self, config: Config) -> tuple[str, ...]:
        """Inpainting keeps what each clip's `mask` input leaves black, where the data gives one (a mask file or a
        source's `mask_rect`); clips without one keep what `model.conditioning.mask_rectangle` leaves."""
        return ("mask",) if config.model.conditioning.inpaint > 0 else ()

    # ----- sampling ---------------------------------------------------------------------------------------------
    def latent_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The latent (frames, height, width) of a clip of `frames` x `height` x `width`."""
        spatial, temporal, _, _ = self.compression
        return (frames - 1) // temporal + 1, height // spatial, width // spatial

    def sampling_region(self, given: Given, frames: int, height: int, width: int) -> torch.Tensor:
        """[1, 1, F, H, W] on the latent grid: the region an inpainting sample keeps (its mask's black cells, else
        the configured rectangle's)."""
        shape = self.latent_grid(frames, height, width)
        if given.mask is not None:
            return conditioning.mask_region(given.mask[None, None], *shape)
        modes = self.config.conditioning
        return conditioning.rectangle_region(modes.mask_rectangle, modes.mask_rectangle_generated, *shape)

    def check_given_frames(self, given: Given, frames: int) -> None:
        """A clip to extend has k x temporal ratio + 1 frames, fewer than those sampled; a clip to inpaint has as
        many frames as are sampled."""
        temporal = self.compression[1]
        assert given.frames is not None or given.mode == "last_frame"
        if given.mode == "extension" and ((given.frames.shape[0] - 1) % temporal or given.frames.shape[0] >= frames):
            raise ModelError(f"{self.name}: a clip to extend has k x {temporal} + 1 frames, fewer than the "
                             f"{frames} sampled, not {given.frames.shape[0]}.\nWhat to do: give "
                             f"{(given.frames.shape[0] - 1) // temporal * temporal + 1} frames, or sample more.")
        if given.mode == "inpaint" and given.frames.shape[0] != frames:
            raise ModelError(f"{self.name}: inpainting keeps a region of a clip of the {frames} frames sampled, "
                             f"not {given.frames.shape[0]}.\nWhat to do: give a clip of {frames} frames.")


class InPlaceModes(ModeSettings):
    """`model.conditioning`'s modes for a family that gives latents in place (see the module)."""

    compression: tuple[int, int, int, int]

    def draw_modes(self, x0: torch.Tensor, positions: torch.Tensor, seed: int,
                   first_frame_probability: float) -> Conditions:
        """Each sample's mode (drawn from its stream position) and its clean latents: a clip of one latent frame
        takes no frame mode (nothing after it to predict), one no longer than the extension's frames no extension."""
        frames = x0.shape[2]
        allowed = {mode: frames > 1 for mode in conditioning.MODES}
        allowed["extension"] = self.extension_latent_frames < frames
        allowed["inpaint"] = True
        mode_shares = conditioning.shares(self.config.conditioning, first_frame_probability)
        codes = conditioning.draw_modes(mode_shares, positions, seed, allowed)
        return {conditioning.MODE: codes.to(x0.device), conditioning.LATENTS: x0}

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """The condition pipeline's conditions of a mode (`frame_condition` makes each in its pipeline's terms): the
        first frame (an image) and the clip to extend (a video) at the start, the last frame (an image) at the end;
        inpainting: the clip at the start with the region it keeps (`given_region`: its mask's black cells on the
        latent grid, else the rectangle)."""
        if given.mode == "first_frame":
            return self.pipeline_inputs(given.frames)
        self.check_given_frames(given, frames)
        conditions: list[Any] = []
        inputs: dict[str, Any] = {"frame_rate": self.frame_rate}
        if given.mode in conditioning.FIRST_FRAME_MODES:
            conditions.append(self.frame_condition(self.first_frame_image(given.frames), last=False, frames=frames))
        if given.mode in ("extension", "inpaint"):
            assert given.frames is not None
            conditions.append(self.frame_condition(frames_to_pil(given.frames), last=False, frames=frames))
        if given.mode == "inpaint":
            inputs["given_region"] = self.sampling_region(given, frames, height, width)
        if given.mode in conditioning.LAST_FRAME_MODES:
            assert given.last is not None
            conditions.append(self.frame_condition(frames_to_pil(given.last[-1:])[0], last=True, frames=frames))
        return {**inputs, "conditions": conditions}

    def frame_condition(self, picture: Any, last: bool, frames: int) -> Any:
        """One condition of the family's condition pipeline: `picture` (a PIL image, or a list of them: a clip) at
        the first frame, or at the last when `last`."""
        raise NotImplementedError

    def modes_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """Each clip's mean squared error [B] over what it learns: its drawn mode's given region left out."""
        return conditioning.per_clip_error(squared_error, self.given_region(conditions, squared_error.shape))


class ChannelModes(ModeSettings):
    """`model.conditioning`'s modes for a family that gives latents on channels (see the module)."""

    def draw_channel_modes(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """Each sample's mode, drawn from its stream position: the configured shares, the first frame for the rest
        (and for a clip a mode cannot take: one latent frame, or no longer than the extension's)."""
        frames = x0.shape[2]
        allowed = {mode: frames > 1 for mode in conditioning.MODES}
        allowed["first_frame"] = True
        allowed["extension"] = self.extension_latent_frames < frames
        allowed["inpaint"] = True
        codes = conditioning.draw_modes(conditioning.shares(self.config.conditioning, 1.0), positions, seed, allowed)
        codes = torch.where(codes == conditioning.NONE, float(conditioning.code("first_frame")), codes)
        return {conditioning.MODE: codes.to(x0.device), conditioning.LATENTS: x0}


def compose(codes: torch.Tensor, first: torch.Tensor, extension: torch.Tensor | None, last: torch.Tensor | None,
            inpaint: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's condition by its mode, from conditions of the whole latent layout that are zero where they give
    nothing ([B, C, F, H, W] or broadcastable): `first` (first_frame), `extension`, `last` (last_frame), first + last
    (first_last: they fill other latent frames), `inpaint`. A piece no drawn mode reads may be None."""
    def chosen(modes: tuple[str, ...]) -> torch.Tensor:
        return conditioning.is_mode(codes, modes).view(-1, 1, 1, 1, 1).to(first)  # type: ignore[arg-type]

    condition = chosen(conditioning.FIRST_FRAME_MODES) * first
    for piece, modes in ((extension, ("extension",)), (last, conditioning.LAST_FRAME_MODES), (inpaint, ("inpaint",))):
        if piece is not None:
            condition = condition + chosen(modes) * piece.to(first)
    return condition
