"""Setting a run up, in one pass and in this order: `set_up(run) -> TrainingContext`.

1. `find_checkpoint`: the checkpoint a resumed run continues (a used output_dir is refused before anything else);
2. `check_inputs`: the model folder, bucket shapes, scheduler, every option and every sample, before any long work;
3. the parallel strategy, chosen once (`vidtune.parallel.choose`); the output folder and the trackers;
4. `load_models`: the batch source (the cache, or encoding on the fly), the denoiser set up by the algorithm part;
5. the strategy's sharding, the weights' average, the training state (restored from the checkpoint), the
   data-parallel wrapper, block swap, the held-out samples, the metrics log.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from vidtune import outputs, parallel
from vidtune.algorithms import traits_of
from vidtune.attention import resolve_attention_backend, set_attention_backend
from vidtune.batches import Batch, BatchSource, CachedBatches, EncodedBatches
from vidtune.compile import compile_blocks
from vidtune.config import Config, write_resolved_config
from vidtune.data.audio import has_sound, sound_line
from vidtune.data.buckets import check_bucket_shapes
from vidtune.data.overview import write_dataset_overview
from vidtune.data.sources import Clip, load_dataset
from vidtune.ema import EMA
from vidtune.errors import ConfigError, StorageError
from vidtune.evaluation import EvalHistory, HeldOutSet, check_evaluation, encode_held_out, held_out_line, hold_out
from vidtune.files import check_writable
from vidtune.memory import check_base_weights
from vidtune.metrics import StepLog, truncate_metrics
from vidtune.offload import (
    apply_block_swap,
    check_activation_offload,
    check_block_count,
    check_block_swap,
    loading_device,
)
from vidtune.optim import check_optimizer
from vidtune.parallel.choose import choose_strategy
from vidtune.parallel.context import check_context_tokens
from vidtune.parallel.deepspeed import check_deepspeed
from vidtune.precompute import CachedClips, precompute
from vidtune.precompute.plan import cache_root
from vidtune.processors import with_reference_controls
from vidtune.resume import resolve_resume
from vidtune.sampling import comfyui_schedule
from vidtune.state import SavedState, TrainingState, read_checkpoint, restore_rng, resume_stream
from vidtune.storage.space import CheckpointSpace, check_space, optimizer_state_bytes
from vidtune.trackers import check_trackers, open_trackers
from vidtune.training.context import Average, Encoders, Inputs, NoAverage, TrainingContext
from vidtune.training.held_out import HeldOut, NoHeldOut, own_rng

if TYPE_CHECKING:
    from vidtune.algorithms.losses import LossFunction
    from vidtune.algorithms.part import AlgorithmPart
    from vidtune.models.spec import Conditions, ModelSpec
    from vidtune.parallel.strategy import Strategy


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def uses_bf16(config: Config, device: torch.device) -> bool:
    precision = config.training.precision
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def show_progress(config: Config) -> bool:
    """Progress bars: as configured, on rank 0 only."""
    return config.logging.progress and parallel.is_main()


def set_up(config: Config, spec: ModelSpec, part: AlgorithmPart, loss: LossFunction,
           device: torch.device) -> TrainingContext:
    """Everything a run needs, checked, loaded and restored (see the module's docstring)."""
    saved = find_checkpoint(config, part)
    # A read-only, full or missing output folder is named now, not after the data checks and the model's loading.
    parallel.on_main(lambda: check_writable(Path(config.output_dir), "output_dir"))
    inputs = check_inputs(config, spec, part, device, saved)
    strategy = choose_strategy(config, device)
    parallel.on_main(lambda: prepare_output_dir(config, spec, inputs.clips))
    # Trackers start before the long work, so a refusal (no login, no package) comes at once.
    output_dir = Path(config.output_dir)
    trackers = open_trackers(config, output_dir, saved.step if saved else 0) if parallel.is_main() else []
    # Rank 0 draws what one process draws; other data groups draw their own (e.g. LoRA dropout masks), the ranks of
    # one group (parallel.context) alike.
    seed_everything(config.training.seed + parallel.data_rank(config.parallel.context.degree))
    encoders = Encoders(spec, device, load_now=not config.precompute.enabled)
    source = open_batch_source(config, spec, inputs, device, encoders, resuming=saved is not None)
    empty_caption = empty_caption_of(config, source)
    denoiser, parameters = load_denoiser(config, spec, part, inputs, device, strategy, resuming=saved is not None)
    part.prepare_inputs(source)  # e.g. a teacher's negative prompt
    # FSDP shards the denoiser here, replacing its parameters, so the optimizer is built after.
    parameters = strategy.prepare(denoiser, parameters)
    average = make_average(config, part, parameters)
    strategy.ema = average.average
    state = TrainingState(config, part.traits.name, parameters, len(inputs.clips), part.state_dict,
                          part.load_state_dict, average.average, strategy)
    state.space = checkpoint_space(config, spec, part, parameters)
    trained = denoiser
    if strategy.wraps_before_restore:  # DeepSpeed: each rank restores its own shards into the engine
        trained = strategy.wrap(denoiser, parameters, state.optimizer)
    if saved is not None:
        state.restore(saved, device)
    first_step = state.step
    parallel.on_main(lambda: say_space(config, state))  # before the first step: the disk holds what the run writes
    if not strategy.wraps_before_restore:
        # Under torchrun, DDP starts every rank from rank 0's weights and averages the gradients over ranks.
        trained = strategy.wrap(denoiser, parameters, state.optimizer)
    # After the wrapper, which checks and broadcasts the weights on the training device.
    swap = apply_block_swap(denoiser, spec.block_lists, config.memory.blocks_to_swap, device)
    part.prepare_frozen(strategy)  # FSDP shards a full student's teacher like the student
    held_out = set_up_held_out(config, spec, inputs, device, encoders)
    log = StepLog(output_dir / outputs.METRICS, config.training.steps, state.step, show_progress(config), trackers)
    parallel.on_main(lambda: truncate_metrics(log.path, state.step))
    if isinstance(held_out, HeldOut):
        held_out.history = parallel.on_main(lambda: EvalHistory.read(log.path))
    denoiser.train()
    return TrainingContext(
        config=config, spec=spec, part=part, loss=loss, device=device, bf16=uses_bf16(config, device),
        inputs=inputs, strategy=strategy, encoders=encoders, source=source, empty_caption=empty_caption,
        denoiser=denoiser, trained_denoiser=trained, parameters=parameters, average=average,
        block_swaps=(swap,) if swap is not None else (), state=state, held_out=held_out, log=log,
        first_step=first_step, batches=lambda: batch_stream(config, source, state, saved),
    )


# ----- before anything loads ---------------------------------------------------------------------------------------
def find_checkpoint(config: Config, part: AlgorithmPart) -> SavedState | None:
    """The checkpoint this run continues from, checked against the config. A used output_dir is refused before
    anything is read or written. Rank 0 decides (it also tidies what a killed run left) and every rank follows, or
    raises the same error."""
    folder = parallel.on_main(lambda: resolve_resume(config))
    if folder is None:
        return None
    return read_checkpoint(folder, config, part.traits.name, part.resume_fixed_keys)


def check_inputs(config: Config, spec: ModelSpec, part: AlgorithmPart, device: torch.device,
                 saved: SavedState | None = None) -> Inputs:
    """Model folder, bucket shapes, scheduler, every source and every sample, before any long work (`saved`: the
    checkpoint the run continues)."""
    data = config.data
    spec.check_source()
    check_bucket_shapes(spec, data.bucket_shapes(), single=not data.buckets)
    spec.check_training(config)
    if config.validation.sampler == "comfyui":
        comfyui_schedule(config, spec)  # a family without a ComfyUI workflow is refused here
    objective = spec.objective(config.training)  # an unknown scheduler fails here, not later
    check_trackers(config)
    check_optimizer(config, device)
    if config.parallel.strategy == "deepspeed":
        check_deepspeed(config, device.type, saved)
    check_base_weights(config.memory.base_weights)
    check_base_weights(config.memory.text_encoder_weights, "memory.text_encoder_weights")
    memory, training = config.memory, config.training
    check_block_swap(memory.blocks_to_swap, part.traits, training.gradient_checkpointing, memory.activation_offload,
                     config.parallel.strategy, training.compile)
    if memory.blocks_to_swap:
        check_block_count(memory.blocks_to_swap, spec.block_lists, spec.load_config(spec.denoiser_class, "transformer"))
    check_activation_offload(memory.activation_offload, device)
    attention_backend = resolve_attention_backend(config.model.attention_backend, device)
    check_evaluation(config)
    clips = leave_out_silent(config, spec, with_reference_controls(
        config, load_dataset(data, progress=show_progress(config), required_inputs=spec.required_inputs(config))))
    spec.check_frame_settings(config, clips)
    spec.check_clip_inputs(clips)
    check_context_tokens(config, spec, clips)
    training_clips, eval_clips = hold_out(clips, config)
    part.check([*training_clips, *eval_clips], objective, resuming=saved is not None)
    return Inputs(objective, attention_backend, training_clips, eval_clips)


def leave_out_silent(config: Config, spec: ModelSpec, clips: list[Clip]) -> list[Clip]:
    """The clips a run trains on: for a family that trains on sound with `model.clips_without_sound: leave-out`,
    those with an audio track, with one line saying how many were left out; else all of them."""
    if spec.audio_format() is None or config.model.clips_without_sound != "leave-out":
        return clips
    kept = [clip for clip in clips if has_sound(clip)]
    if not kept:
        raise ConfigError(f"model.clips_without_sound: leave-out leaves none of the {len(clips)} samples: none "
                          "has an audio track.\nWhat to do: add clips with sound, or set "
                          "model.clips_without_sound=video-only to train their video.")
    if len(kept) < len(clips) and parallel.is_main():
        print(f"{spec.name}: {len(clips) - len(kept)} of {len(clips)} samples have no audio track and are "
              "left out (model.clips_without_sound: leave-out).", flush=True)
    return kept


def prepare_output_dir(config: Config, spec: ModelSpec, clips: list[Clip]) -> None:
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(config, output_dir)
    # What the run trains on, to look at: each sample's frames at its bucket's size, and its caption (and whether it
    # has sound, for a family that trains on it).
    write_dataset_overview(clips, config.data, output_dir / outputs.DATASET_OVERVIEW,
                           sound=spec.audio_format() is not None)


# ----- the models ------------------------------------------------------------------------------------------------
def open_batch_source(config: Config, spec: ModelSpec, inputs: Inputs, device: torch.device,
                      encoders: Encoders, resuming: bool = False) -> BatchSource:
    """From the cache (`precompute.enabled`: missing entries are computed first, with the encoders loaded and
    released by that stage, so training never holds them), or encoded on the fly (the encoders loaded already).
    A resumed run whose cache folder is gone is refused (`resuming`): an unmounted drive, not a cache to rebuild."""
    if spec.audio_format() is not None and parallel.is_main():
        video_only = traits_of(config).in_context and not config.control.with_audio
        print(f"{spec.name}: every sample trains video only, cut off from the audio stream (control.with_audio: "
              "false)." if video_only else sound_line(spec.name, inputs.clips), flush=True)
    if not config.precompute.enabled:
        return EncodedBatches(config, inputs.clips, device, spec, encoders.text, encoders.vae)
    if resuming:
        parallel.on_main(lambda: check_cache_still_there(cache_root(config)))
    # The held-out samples' entries too: their encoders load once, with training's (vidtune/evaluation.py).
    summary = precompute(config, [*inputs.clips, *inputs.eval_clips], progress=show_progress(config))
    if summary.rank == 0:
        print(summary.line(), flush=True)
    cached = CachedClips(config, spec, summary.plan, inputs.clips)
    return CachedBatches(config, inputs.clips, device, cached)


def check_cache_still_there(root: Path) -> None:
    """A resumed run trained from the cache in `root`: when that folder is gone, a drive is unmounted (or the cache
    was removed), and computing it all again on whatever disk is there now is not what its user expects."""
    if root.is_dir():
        return
    raise StorageError(
        f"precompute.cache_dir: the cache folder {root} is gone (a drive unmounted, or the folder removed), though "
        "the checkpoint this run continues was trained from it. Nothing was computed or trained.",
        f"mount the drive again; or, to compute the cache again there, create the folder (mkdir -p {root}) and run "
        "the same command again", folder=root)


def checkpoint_space(config: Config, spec: ModelSpec, part: AlgorithmPart,
                     parameters: list[nn.Parameter]) -> CheckpointSpace:
    """The disk space this run's checkpoints and final files take, estimated from the trained weights and the
    optimizer's state per weight (measured after the first checkpoint)."""
    elements = sum(p.numel() for p in parameters)
    element_size = max((p.element_size() for p in parameters), default=4)
    formats = 1 if part.traits.trains_base_weights else 1 + bool(spec.comfyui_lora_rules())
    return CheckpointSpace.estimate(elements * element_size,
                                    optimizer_state_bytes(config.optimizer.name, elements, element_size),
                                    config.training.ema_decay is not None, config.checkpoint.keep, formats)


def say_space(config: Config, state: TrainingState) -> None:
    """Refuse a run whose output folder cannot hold one checkpoint; warn when it cannot hold the rest of the run."""
    existing, to_write = state.checkpoints_to_come()
    warning = check_space(Path(config.output_dir), state.space, existing, to_write)
    if warning is not None:
        print(f"Warning: {warning}", flush=True)


def empty_caption_of(config: Config, source: BatchSource) -> Conditions:
    """Caption dropout's `empty` caption (from the cache, or encoded), or nothing when it is not used."""
    if config.data.drops_captions() and config.data.caption_dropout_technique == "empty":
        return source.empty_caption()
    return {}


def load_denoiser(config: Config, spec: ModelSpec, part: AlgorithmPart, inputs: Inputs, device: torch.device,
                  strategy: Strategy, resuming: bool = False) -> tuple[nn.Module, list[nn.Parameter]]:
    """The denoiser set up by the algorithm part, its attention kernel, compiled blocks, on the training device;
    and the parameters to train."""
    # Quantized base weights for a GPU are quantized in host memory first: the GPU never holds the whole
    # unquantized model (vidtune/offload.py).
    load_on = loading_device(config.memory.base_weights, device)
    denoiser = strategy.load_denoiser(spec, load_on)  # FSDP: perhaps rank 0 only
    if config.training.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    parameters = part.configure(denoiser, resuming)
    # The kernel before compiling, so the compiled blocks call it; both after the adapter and base weights.
    set_attention_backend(denoiser, inputs.attention_backend, spec.name)
    if config.training.compile:
        compile_blocks(denoiser, len(config.data.bucket_shapes()))
    if load_on != device:
        denoiser.to(device)
    return denoiser, parameters


def make_average(config: Config, part: AlgorithmPart, parameters: list[nn.Parameter]) -> Average | NoAverage:
    """The moving average of the trained parameters (`training.ema_decay`), or none."""
    decay = config.training.ema_decay
    if decay is None:
        return NoAverage()
    return Average(EMA(part.trained_parameters(parameters), decay))


def set_up_held_out(config: Config, spec: ModelSpec, inputs: Inputs, device: torch.device,
                    encoders: Encoders) -> HeldOut | NoHeldOut:
    """The held-out samples' inputs, encoded once on every rank (from the cache or with the run's encoders), without
    drawing from the training RNGs."""
    if not inputs.eval_clips:
        return NoHeldOut()
    if parallel.is_main():
        print(held_out_line(inputs.eval_clips, inputs.clips, config), flush=True)
    text, vae = (encoders.text, encoders.vae) if encoders.loaded else (None, None)
    with own_rng(device):
        items = encode_held_out(config, spec, inputs.eval_clips, device, text, vae, progress=show_progress(config))
    items = [(conditions, spec.training_latents(latents)) for conditions, latents in items]  # as training draws them
    return HeldOut(HeldOutSet.from_config(config, inputs.eval_clips, items))


def batch_stream(config: Config, source: BatchSource, state: TrainingState,
                 saved: SavedState | None) -> Iterator[Batch]:
    """The batches from the current data position; after a resume, with the saved RNGs in place."""
    stream = source.batches(state.samples_consumed)
    if saved is None:
        return stream
    if state.step < config.training.steps:
        return resume_stream(stream, saved)
    restore_rng(saved)
    return stream
