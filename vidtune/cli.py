"""The `vidtune` command."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from vidtune import outputs
from vidtune.errors import ConfigError, StorageError, VidtuneError
from vidtune.models.folders import check_folder_exists
from vidtune.models.registry import SPECS, get_spec_class

if TYPE_CHECKING:
    from vidtune.config import Config

# Imports inside the functions below are kept out of `import vidtune.cli` on purpose: the config's schema (pydantic
# builds it in about half a second) loads when a command or its help needs it, and each command's own modules (torch,
# the families, the trainers) load when it runs, after its config and folders are checked, so a wrong setting
# answers at once.


def _split_config_and_overrides(values: list[str]) -> tuple[str | None, list[str]]:
    if values and "=" not in values[0]:
        return values[0], values[1:]
    return None, values


def _load(values: list[str]) -> Config:
    from vidtune.config import load_config

    if not values:
        raise ConfigError(
            "No config given: the command needs a config file (YAML or TOML) and/or section.key=value settings.\n"
            "What to do: run it as e.g. vidtune train my.yaml [section.key=value ...]; `vidtune quickstart` writes "
            "a complete example config and `vidtune config show` lists every key."
        )
    path, overrides = _split_config_and_overrides(values)
    return load_config(path, overrides)


def resume_command(config: str | None, overrides: list[str], verbose: bool = False) -> str:
    """The command that continues this run: the user's own config and overrides (any earlier checkpoint.resume
    left out) plus checkpoint.resume=latest, quoted for a shell. Under torchrun, the same launcher."""
    kept = [item for item in overrides if item.partition("=")[0].strip() != "checkpoint.resume"]
    words = [*(["--verbose"] if verbose else []), "train", *([config] if config else []), *kept,
             "checkpoint.resume=latest"]
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        local, world = os.environ.get("LOCAL_WORLD_SIZE", "N"), os.environ.get("WORLD_SIZE")
        launcher = (f"torchrun --nproc_per_node {local}" if world in (None, local)
                    else "torchrun [the same torchrun options]")
        return f"{launcher} -m vidtune {shlex.join(words)}"
    return shlex.join(["vidtune", *words])


def command_train(args: argparse.Namespace) -> int:
    config = _load(args.config)  # before torch and the trainers are imported: a config error exits at once
    check_folder_exists(config.model.pretrained)  # so does a model folder that is not there
    from vidtune import parallel
    from vidtune.cpu import configure_cpu_threads
    from vidtune.parallel.launch import adopt_launcher_environment
    from vidtune.trainers import build_trainer
    from vidtune.training.stop import TrainingInterrupted

    adopt_launcher_environment()  # SLURM's srun without torchrun: its variables as torchrun's
    configure_cpu_threads(config)
    started = time.perf_counter()
    try:
        result = build_trainer(config).run()
    except TrainingInterrupted as stopped:
        again = resume_command(*_split_config_and_overrides(args.config), verbose=args.verbose)
        raise TrainingInterrupted(f"{stopped}\nWhat to do: to continue, run {again}", stopped.exit_code) from None
    except StorageError as fault:  # a full disk, a read-only or vanished folder: the run's own command continues it
        again = resume_command(*_split_config_and_overrides(args.config), verbose=args.verbose)
        raise fault.with_notes(advice=f"{fault.advice}:\n  {again}") from None
    if parallel.is_main():  # under torchrun, once
        print_summary(result, time.perf_counter() - started)
    return 0


def command_quickstart(args: argparse.Namespace) -> int:
    from vidtune.quickstart import QUICKSTART_SETTINGS, run_quickstart

    started = time.perf_counter()
    output = Path(args.output).absolute()
    result = run_quickstart(output, args.overrides)
    print_summary(result, time.perf_counter() - started)
    config = output / "quickstart.yaml"
    data = QUICKSTART_SETTINGS["data"]
    print(f"\nWhat it used (all in {output}):")
    print(f"  config       {config} (edit it and run `vidtune train` on it)")
    print(f"  tiny model   {output / 'tiny-ltx-video'} (random weights, in the diffusers layout)")
    print(f"  clips        {output / 'data'} (videos.txt, prompts.txt, clips/)")
    print("\nTo train the tiny model on your own clips, put videos.txt (one clip a line) and prompts.txt (one caption "
          f"a line) in their folder (clips of at least {data['frames']} frames at {data['fps']} fps), then run")
    print("  " + shlex.join(["vidtune", "train", str(config), "data.root=/path/to/your/clips",
                             "output_dir=my-first-run"]))
    print("The samples look like noise: the tiny model has random weights, so the quickstart shows the whole path "
          "(clips, training, checkpoints, samples), not a good video.")
    print("For a real model, start from the config under \"Train on your own clips\" in README.md.")
    return 0


def command_data_check(args: argparse.Namespace) -> int:
    """Everything `vidtune train` checks about the data, without loading a model: exit 1 when training would
    fail on it, 0 otherwise (2: the config or the model folder itself is wrong)."""
    config = _load(args.config)
    check_folder_exists(config.model.pretrained)  # before the family's code (and torch) is imported
    from vidtune.data.report import check_data, table, write_json, write_sheets

    spec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
    spec.check_source()
    check = check_data(config, spec, progress=config.logging.progress)
    print(table(check, config.data.fps))
    overview, kept = check_overview_path(Path(config.output_dir), args.overview)
    with _writing("--overview" if args.overview else "output_dir", "overview", overview):
        sheets = write_sheets(check, overview)
    if kept is not None:
        print(f"The run in {kept.parent} keeps its own {kept.name} (what it trained); this check's is beside it.")
    report = Path(args.report) if args.report else None
    if report is not None:
        with _writing("--report", "report", report):
            write_json(check, report)
    print(f"Overview: {', '.join(str(path.resolve()) for path in sheets)}")
    if report is not None:
        print(f"Report: {report.resolve()}")
    warnings, problems = check.warnings(), check.problems()
    if warnings:
        print(f"\n{len(warnings)} warning{'s' if len(warnings) != 1 else ''} (training would go on):")
        print("\n".join(f"  - {warning}" for warning in warnings))
    if problems:
        print(f"\n{len(problems)} problem{'s' if len(problems) != 1 else ''}; training would stop:", file=sys.stderr)
        print("\n".join(f"  - {problem}" for problem in problems), file=sys.stderr)
        print("What to do: fix them (every problem of every source is listed) and run vidtune data check again.",
              file=sys.stderr)
        return 1
    print(f"\nThe dataset is ready: {len(check.clips)} samples, every one in a bucket.")
    return 0


def check_overview_path(output_dir: Path, given: str | None) -> tuple[Path, Path | None]:
    """Where `vidtune data check` draws its overview, and the run overview it leaves alone: `--overview`, else
    output_dir's dataset_overview.png, unless a run already trained there (its resolved config): then
    data_check_overview.png beside it, so a check with other settings never rewrites the run's record."""
    if given:
        return Path(given), None
    run_overview = output_dir / outputs.DATASET_OVERVIEW
    if (output_dir / outputs.RESOLVED_CONFIG).is_file():
        return output_dir / outputs.DATA_CHECK_OVERVIEW, run_overview if run_overview.is_file() else None
    return run_overview, None


@contextlib.contextmanager
def _writing(where: str, what: str, target: Path) -> Iterator[None]:
    """Around writing `target`: its folder made first; an OSError (a file in the way, no permission, a full disk)
    becomes a message naming the setting `where` to change."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as error:
        raise VidtuneError(f"{where}: cannot write the {what} {target} ({_os_reason(error)}).\n"
                           "What to do: choose a path in a folder you can write to.") from None


def _os_reason(error: OSError) -> str:
    """`No such file or directory: /path` rather than a traceback's `[Errno 2] ...`."""
    return f"{error.strerror}: {error.filename}" if error.strerror and error.filename else str(error)


def command_precompute(args: argparse.Namespace) -> int:
    config = _load(args.config)
    from vidtune.cpu import configure_cpu_threads
    from vidtune.precompute import precompute

    configure_cpu_threads(config)
    try:
        summary = precompute(config)
    except StorageError as fault:  # entries already written are whole: a rerun computes only the rest
        raise fault.with_notes(advice=f"{fault.advice}; then run the same command again") from None
    if summary.rank == 0:
        print(f"Cache: {summary.cache_dir} ({summary.seconds:.1f} s)")
        print(summary.line())
        if summary.sound:
            print(summary.sound)
    return 0


def command_cache_info(args: argparse.Namespace) -> int:
    config = _load(args.config) if args.config else None
    if config is None and not args.cache_dir:
        raise VidtuneError("vidtune cache info: no cache given.\nWhat to do: give a config (CONFIG [KEY=VALUE ...]) "
                           "or --cache-dir.")
    from vidtune.precompute.info import cache_report

    if config is not None and args.cache_dir:
        config = config.model_copy(update={"precompute": config.precompute.model_copy(
            update={"cache_dir": args.cache_dir})})
    report = cache_report(config, root=args.cache_dir, verify=args.verify, progress=config is not None)
    print("\n".join(report.lines()))
    return 0


def command_checkpoint_verify(args: argparse.Namespace) -> int:
    """Exit 0 when every checkpoint and weights file of the run is whole (or cannot be checked), 1 when one is
    damaged."""
    from vidtune.training.verify import report, verify_run

    text, whole = report(Path(args.run), verify_run(Path(args.run)))
    print(text, file=sys.stdout if whole else sys.stderr)
    return 0 if whole else 1


def command_config_show(args: argparse.Namespace) -> int:
    from vidtune.config import load_config
    from vidtune.config_docs import NOT_SET, render_resolved

    path, overrides = _split_config_and_overrides(args.config)
    config = load_config(path, overrides, required_placeholder=NOT_SET)
    source = path or "the defaults"
    if overrides:
        source += " with " + " ".join(overrides)
    print(render_resolved(config, source), end="")
    return 0


def sections_help() -> str:
    """The config's sections, one line each, for `vidtune train --help`."""
    from vidtune.config import Config

    width = max(len(name) for name in Config.model_fields)
    lines = [f"  {name.ljust(width)}  {field.description or ''}" for name, field in Config.model_fields.items()]
    return ("the config's sections (set any key in the file, or on the command line as section.key=value):\n"
            + "\n".join(lines) + "\n\n"
            "Every key with its value and meaning: vidtune config show [CONFIG] [section.key=value ...]\n"
            "Reference with limits: docs/configuration.md. Example: vidtune train my.yaml training.steps=500")


def require_folder(path: str, what: str) -> None:
    """A folder a command reads is there, checked before the command imports torch (a typo answers at once)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise VidtuneError(f"{folder} does not exist (looked for at {folder.resolve()}).\nWhat to do: give {what}.")


RUN_FOLDERS = ("a run's output_dir, one of its checkpoints (.../checkpoints/step-XXXXXXXX) or a folder "
               "`vidtune export` wrote")


def command_export(args: argparse.Namespace) -> int:
    require_folder(args.checkpoint, "a checkpoint folder (.../checkpoints/step-XXXXXXXX) or a run's output_dir")
    from vidtune.export.command import export_checkpoint

    written = export_checkpoint(args.checkpoint, args.output, overwrite=args.overwrite, format=args.format)
    print(f"Exported {args.checkpoint} -> {written}")
    return 0


def load_plan_config(path: str | None, overrides: list[str]) -> Config:
    """A config as `vidtune train` reads it; the dataset is not needed for a plan (data.root may stay unset)."""
    from vidtune.config import load_config
    from vidtune.config_docs import NOT_SET

    if path is None and not overrides:
        raise ConfigError("No config given: vidtune plan needs a config file and/or section.key=value settings.\n"
                          "What to do: run e.g. vidtune plan my.yaml, or vidtune plan model.name=ltx-video "
                          "model.pretrained=Lightricks/LTX-Video.")
    config = load_config(path, overrides, required_placeholder=NOT_SET)
    for key, value in (("model.name", config.model.name), ("model.pretrained", config.model.pretrained)):
        if value == NOT_SET:
            raise ConfigError(f"{key}: required, but not set.\nWhat to do: set it in the config file or as "
                              f"{key}=... on the command line.")
    if config.model.name not in SPECS:
        get_spec_class(config.model.name)  # an unknown family named plainly
    return config


def command_plan(args: argparse.Namespace) -> int:
    path, overrides = _split_config_and_overrides(args.config)
    config = load_plan_config(path, overrides)  # before torch is imported: a config error exits at once
    from vidtune.memory.report import run_plan

    return run_plan(config, path, overrides, args.gpu_memory, args.json, args.gpus, args.host_memory)


def command_studio(args: argparse.Namespace) -> int:
    require_folder(args.root, "the folder that holds your clips, configs and runs (--root)")
    from vidtune.studio.serve import serve

    return serve(args.root, host=args.host, port=args.port, token=args.token)


def positive_int(text: str) -> int:
    """An option's whole number above 0 (argparse names the option and shows the usage otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def command_sample(args: argparse.Namespace) -> int:
    require_folder(args.run_dir, RUN_FOLDERS)
    from vidtune.data.video import probe_video
    from vidtune.sample_source import sample_source
    from vidtune.sampling import load_pipeline, next_sample_path, sample_run

    for flag, path, suffix in (("--output", args.output, ".mp4"), ("--latents", args.latents, ".safetensors")):
        if path is not None and Path(path).suffix.lower() != suffix:
            raise VidtuneError(f"{flag} {path}: the file name must end in {suffix}.\nWhat to do: name it e.g. "
                               f"sample{suffix}.")
    started = time.perf_counter()
    if not args.verbose:  # transformers draws a bar per component loaded: noise here
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    given = Path(args.run_dir)
    with sample_source(given) as source:
        if source.checkpoint is not None:
            unfinished = "" if source.checkpoint == given or source.checkpoint.parent == given else \
                f"{given} holds no final weights (the run did not finish): "
            print(f"{unfinished}sampling the checkpoint {source.checkpoint} (its weights exported as `vidtune export` "
                  "does, into a temporary folder).", flush=True)
        output = Path(args.output) if args.output else next_sample_path(source.home)
        print("Loading the model ...", flush=True)
        run = load_pipeline(source.folder, device=args.device, ema=False if args.no_ema else None,
                            embedded_guidance=args.embedded_guidance)
        averaged = " (the moving average of the weights, as validation used; --no-ema for the weights)" \
            if run.weights.name in (outputs.LORA_EMA_WEIGHTS, outputs.TRANSFORMER_EMA_FOLDER) else ""
        weights = run.weights if source.checkpoint is None else f"{run.weights.name} of {source.checkpoint.name}"
        print(f"Sampling {run.spec.name} with {weights}{averaged} on {run.device}.", flush=True)
        written = sample_run(run, args.prompt, output, image=Path(args.image) if args.image else None,
                             latents=Path(args.latents) if args.latents else None,
                             control=Path(args.control) if args.control else None, num_inference_steps=args.steps,
                             **{key: Path(value) for key in ("last_frame", "extend", "inpaint", "mask")
                                if (value := getattr(args, key)) is not None},
                             guidance_scale=args.guidance, seed=args.seed, frames=args.frames, height=args.height,
                             width=args.width, progress=True)
    sound = "with the sampled sound; " if probe_video(written).has_audio else ""  # LTX-2's
    print(f"Sample in {time.perf_counter() - started:.0f} s: {written.resolve()} ({sound}+ "
          f"{written.with_suffix('.png').name} contact sheet, {written.with_suffix('.txt').name} prompt)")
    if args.latents:
        print(f"Latents: {Path(args.latents).resolve()} (key 'latents')")
    return 0


def command_caption(args: argparse.Namespace) -> int:
    from vidtune.captioning.command import resolve_data, with_options

    sources, settings, progress = resolve_data(args.data, args.overrides, args.prompts, args.video_column,
                                               args.caption_column)
    settings = with_options(settings, {
        "model": args.model, "fps": args.fps, "max_frames": args.max_frames, "max_pixels": args.max_pixels,
        "instruction": args.instruction, "prefix": args.prefix, "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype})
    if not args.verbose:  # transformers draws a bar per weight file loaded: noise here
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    from vidtune.captioning.run import caption_all, describe_sources, load_captioner, open_sources

    files = open_sources(sources)
    print(f"Captioning {describe_sources(files)} with {settings.model}"
          f"{' (dry run: nothing is written)' if args.dry_run else ''}.", flush=True)

    def load():  # only when something has no caption yet
        print(f"Loading {settings.model} ...", flush=True)
        return load_captioner(settings)

    try:
        summary = caption_all(files, settings, load, overwrite=args.overwrite, dry_run=args.dry_run,
                              progress=progress)
    except StorageError as fault:  # a caption is written as soon as it is made: a rerun captions the rest
        raise fault.with_notes("Every caption made before it is written; a caption file is never left cut short.",
                               advice=f"{fault.advice}; then run the same command again (it captions the rest)"
                               ) from None
    lines = summary.lines()
    print(lines[0])
    if summary.skipped:
        print("\n".join(lines[1:]), file=sys.stderr)
        return 1
    return 0


def print_summary(result, seconds: float) -> None:
    """What this process did (a resumed run: the steps it ran, not the whole run's) and where the outputs are."""
    print()
    ran = result.final_step - result.first_step
    if ran == 0:
        print(f"Nothing left to train: the run was already at step {result.final_step}; the outputs were written "
              f"again in {seconds:.0f} s.")
    elif result.first_step:
        print(f"Resumed from step {result.first_step}: finished steps {result.first_step + 1}-{result.final_step} "
              f"({ran} steps) in {seconds:.0f} s.")
    else:
        print(f"Finished {result.final_step} steps in {seconds:.0f} s.")
    if result.losses:
        losses = result.losses
        print(f"Loss over these steps: first {losses[0]:.4f}, last {losses[-1]:.4f} "
              f"(lowest {min(losses):.4f}, highest {max(losses):.4f})")
    print(f"Outputs in {result.output_dir.resolve()}:")
    if result.weights_path:
        print(f"  weights      {result.weights_path}")
    for second in (False, True):  # the LoRA for ComfyUI, named after the run (two files for two experts)
        comfyui = result.output_dir / outputs.comfyui_lora_weights(result.output_dir.resolve().name, second)
        if comfyui.is_file():
            print(f"  for ComfyUI  {comfyui}")
    print(f"  checkpoints  {outputs.checkpoints_root(result.output_dir)}")
    print(f"  metrics      {result.output_dir / outputs.METRICS}")
    print(f"  loss curve   {result.output_dir / outputs.LOSS_PLOT}")
    if result.held_out and (result.output_dir / outputs.EVAL_PLOT).is_file():  # drawn from the second score on
        print(f"  eval curve   {result.output_dir / outputs.EVAL_PLOT}")
    samples = result.every_sample or result.sample_paths
    by_step = result.output_dir / outputs.SAMPLES_BY_STEP
    if samples and by_step.is_file():
        print(f"  by step      {by_step} (every validation side by side)")
    for path in samples:
        print(f"  sample       {path} (+ {path.with_suffix('.png').name})")
    if result.held_out:
        print(result.held_out)
    if result.weights_path:
        run = shlex.quote(str(result.output_dir.resolve()))
        print(f"To generate a video with it: vidtune sample {run} --prompt \"...\"")


# Libraries whose warnings and log lines are for their developers, not for someone training a model.
THIRD_PARTY_LOGGERS = ("huggingface_hub", "diffusers", "transformers", "peft", "torch", "httpx", "httpx2", "PIL",
                       "matplotlib", "accelerate", "torchao", "bitsandbytes",
                       # torch's logging setup (run again when torchao imports torch._dynamo) leaves this one at
                       # WARNING: the "Enum subclass ... register_constant()" lines torchao triggers.
                       "torch.utils._pytree")


def quiet_third_party() -> None:
    """Normal runs show vidtune's own messages only: library warnings (deprecations, retries, ...) are hidden and
    library loggers report errors only. `--verbose` shows everything."""
    # These three set their own level when imported (later, lazily): tell them through their variables too.
    for variable in ("HF_HUB_VERBOSITY", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY"):
        os.environ.setdefault(variable, "error")
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"vidtune(\.|$)")
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vidtune", description="Fine-tune video diffusion models on your clips.")
    parser.add_argument("--verbose", action="store_true", help="show library logs and full tracebacks")
    # The `deepspeed` launcher passes each process --local_rank=N before the command; LOCAL_RANK says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a config file and/or section.key=value overrides",
                                epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", nargs="*", metavar="CONFIG [KEY=VALUE ...]",
                       help="a config file (YAML or TOML), then section.key=value overrides")
    train.set_defaults(handler=command_train)

    quickstart = commands.add_parser("quickstart", help="tiny model + generated clips, trained end to end on CPU")
    quickstart.add_argument("--output", default="vidtune-quickstart", help="folder for everything it writes")
    quickstart.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    quickstart.set_defaults(handler=command_quickstart)

    data = commands.add_parser("data", help="dataset tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    check = data_commands.add_parser(
        "check", help="check every source and sample as training would (no model loaded): a table, buckets, "
        "duplicates, a contact sheet; exit 1 when training would fail")
    check.add_argument("config", nargs="*", metavar="CONFIG [KEY=VALUE ...]")
    check.add_argument("--overview", help="where to write the contact sheet PNG (more pages: NAME-2.png, ...)")
    check.add_argument("--report", help="where to write the JSON report")
    check.set_defaults(handler=command_data_check)

    caption = commands.add_parser(
        "caption", help="write a caption for every clip and still that has none, with a vision-language model",
        description="Caption every clip and still of DATA that has no caption yet with a vision-language model "
        "(Qwen2-VL / Qwen2.5-VL / Qwen3-VL), writing each caption where DATA keeps them as soon as it is made: "
        "prompts.txt beside videos.txt (same line), a .txt beside each clip in a folder, or the caption column / key "
        "of a .csv / .jsonl. Existing captions are kept (--overwrite replaces them); a rerun after a stop captions "
        "what is still missing. Unset options take the config's caption section, else the defaults (vidtune config "
        "show lists them). Exits 1 when a clip was skipped (each is listed with its file and line).")
    caption.add_argument("data", metavar="DATA", help="a config file (its data section), a folder, a clip list "
                         "(videos.txt) or a .csv / .jsonl file")
    caption.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with a config file: section.key=value "
                         "settings, as for train")
    caption.add_argument("--model", help="hub id or folder of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (default: "
                         "Qwen/Qwen2.5-VL-7B-Instruct)")
    caption.add_argument("--fps", type=float, metavar="F", help="frames per second the model sees (default 2)")
    caption.add_argument("--max-frames", type=positive_int, metavar="N", help="at most N frames of a clip, spread "
                         "over it (default 32)")
    caption.add_argument("--max-pixels", type=positive_int, metavar="P", help="pixels per frame, at most (default "
                         "200704, 448x448)")
    caption.add_argument("--instruction", help="what the model is asked ({media} becomes video or image)")
    caption.add_argument("--prefix", help="written before every caption, e.g. a trigger word")
    caption.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="longest caption in tokens "
                         "(default 256)")
    caption.add_argument("--batch-size", type=positive_int, metavar="N", help="clips per model call (default 1)")
    caption.add_argument("--device", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    caption.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                         help="weights dtype (auto: bfloat16 on a GPU, float32 on the CPU)")
    caption.add_argument("--prompts", metavar="NAME", help="a clip list or a folder with one: the caption list's "
                         "name beside it (default prompts.txt)")
    caption.add_argument("--video-column", metavar="NAME", help="a .csv / .jsonl: the column or key of the clip "
                         "paths (default video)")
    caption.add_argument("--caption-column", metavar="NAME", help="a .csv / .jsonl: the column or key captions go to "
                         "(default caption; a missing CSV column is added)")
    caption.add_argument("--overwrite", action="store_true", help="replace captions that are already there")
    caption.add_argument("--dry-run", action="store_true", help="list the clips that have no caption yet and where "
                         "each caption would go; load no model, write nothing")
    caption.set_defaults(handler=command_caption)

    precompute = commands.add_parser(
        "precompute", help="encode captions and clips into the cache (what precompute.enabled=true runs first)"
    )
    precompute.add_argument("config", nargs="*", metavar="CONFIG [KEY=VALUE ...]")
    precompute.set_defaults(handler=command_precompute)

    cache = commands.add_parser("cache", help="precompute cache tools")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    info = cache_commands.add_parser("info", help="entries and size of a cache, and what a config would reuse")
    info.add_argument("config", nargs="*", metavar="CONFIG [KEY=VALUE ...]")
    info.add_argument("--cache-dir", help="the cache folder (default: the config's precompute.cache_dir)")
    info.add_argument("--verify", action="store_true", help="read and checksum every entry the config needs")
    info.set_defaults(handler=command_cache_info)

    checkpoint = commands.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_commands = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    verify = checkpoint_commands.add_parser(
        "verify", help="check every checkpoint and final weights file of a run against the digests written with them",
        description="Check each checkpoint of RUN against its digest manifest and each final weights file against "
        "the digest in its metadata; exit 1 when one is damaged.")
    verify.add_argument("run", metavar="RUN", help="a run's output_dir, or one checkpoint folder")
    verify.set_defaults(handler=command_checkpoint_verify)

    config = commands.add_parser("config", help="config tools")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser(
        "show", help="print the resolved config: every key, its value (defaults filled in) and what it means",
        description="Print the resolved config of CONFIG and the overrides (without CONFIG: the defaults), "
        "every key with its value and a one-line description. The output is YAML you can save and edit.")
    show.add_argument("config", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
    show.set_defaults(handler=command_config_show)

    export = commands.add_parser(
        "export", help="write a checkpoint's weights as a finished run's (LoRA adapter or transformer folder), "
        "or a LoRA for ComfyUI"
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoints/step-XXXXXXXX folder, or a run folder (its newest checkpoint)")
    export.add_argument("--output", required=True, help="folder to write the adapter or transformer/ into")
    export.add_argument("--overwrite", action="store_true", help="replace weights already in --output")
    export.add_argument("--format", choices=["diffusers", "comfyui"], default="diffusers",
                        help="comfyui: only the LoRA for ComfyUI (<run>_comfyui.safetensors); a finished run's "
                        "folder converts its final adapter")
    export.set_defaults(handler=command_export)

    sample = commands.add_parser(
        "sample", help="generate a video with what a run trained (adapter or transformer), in the family's pipeline",
        description="Generate one video with the weights a run trained (RUN_DIR: its output_dir, one of its "
        "checkpoints, or a vidtune export folder), through the model family's own diffusers pipeline and scheduler. "
        "Unset options take the run's validation settings. Writes the mp4, a PNG contact sheet and the prompt "
        "beside it.")
    sample.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir (a run that did not finish: its newest "
                        "checkpoint), a checkpoints/step-XXXXXXXX folder, or a folder vidtune export wrote")
    sample.add_argument("--prompt", required=True, help="what to generate")
    sample.add_argument("--image", metavar="PNG", help="image-to-video models: the first frame (default: the "
                        "first frame of the run's first clip)")
    sample.add_argument("--last-frame", metavar="PNG", help="a run trained with model.conditioning's last_frame or "
                        "first_last: the last frame (with --image: the first and last frames)")
    sample.add_argument("--extend", metavar="CLIP", help="a run trained with model.conditioning.extension: the clip "
                        "whose first model.conditioning.extension_frames frames the sample continues")
    sample.add_argument("--inpaint", metavar="CLIP", help="a run trained with model.conditioning.inpaint: the clip "
                        "whose region outside the mask is kept (--mask, else model.conditioning.mask_rectangle)")
    sample.add_argument("--mask", metavar="PNG", help="with --inpaint: white where the sample is generated, black "
                        "where the clip is kept")
    sample.add_argument("--control", metavar="CLIP",
                        help="a control run (control-lora, control-full, in-context-lora) or a model that follows a "
                        "control clip (wan-vace): the control clip to follow (default: the run's first clip's)")
    sample.add_argument("--steps", type=positive_int, metavar="N", help="denoising steps (default: validation's)")
    sample.add_argument("--guidance", type=float, metavar="G", help="guidance scale (default: validation's)")
    sample.add_argument("--embedded-guidance", type=float, metavar="G",
                        help="models with a guidance embedding (HunyuanVideo): the scale it is told (default: "
                        "model.guidance_scale; a student of distillation.guidance_range: distillation.guidance_scale)")
    sample.add_argument("--seed", type=int, metavar="S", help="seed of the noise (default: validation's)")
    sample.add_argument("--frames", type=positive_int, metavar="F",
                        help="frames (default: validation's, else training's)")
    sample.add_argument("--height", type=positive_int, metavar="H", help="height in pixels")
    sample.add_argument("--width", type=positive_int, metavar="W", help="width in pixels")
    sample.add_argument("--output", metavar="OUT.mp4", help="the video to write (default: "
                        "RUN_DIR/samples/sample-NNN.mp4, the first free number)")
    sample.add_argument("--latents", metavar="OUT.safetensors",
                        help="also write the final latents there (key 'latents', [1, C, F, H, W])")
    sample.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:N")
    sample.add_argument("--no-ema", action="store_true", help="runs with training.ema_decay: the trained weights "
                        "instead of their moving average (which validation used)")
    sample.set_defaults(handler=command_sample)

    plan = commands.add_parser("plan", help="the peak GPU memory a config needs, and what makes it fit (no weights "
                               "loaded, no GPU needed)")
    plan.add_argument("config", nargs="*", metavar="CONFIG [KEY=VALUE ...]",
                      help="a config file (YAML or TOML), then section.key=value overrides")
    plan.add_argument("--gpu-memory", type=float, metavar="GIB", help="the GPU's memory: whether the run fits, and "
                      "else the fastest settings that make it fit")
    plan.add_argument("--gpus", type=positive_int, default=1, metavar="N", help="GPUs training together "
                      "(parallel.strategy fsdp / deepspeed shard over them)")
    plan.add_argument("--host-memory", type=float, metavar="GIB", help="the host's memory (RAM) the suggestions "
                      "must fit too (default: this machine's)")
    plan.add_argument("--json", action="store_true", help="print one JSON object (peak_gib; with --gpu-memory also "
                      "fits and suggested_overrides)")
    plan.set_defaults(handler=command_plan)

    studio = commands.add_parser("studio", help="a local web app: clips and captions, settings that fit, runs, "
                                 "samples, export (needs the studio extra: pip install \"vidtune[studio]\")")
    studio.add_argument("--root", default=".", help="the folder it reads and writes under (default: this one)")
    studio.add_argument("--port", type=positive_int, default=8765, help="port to listen on (default 8765)")
    studio.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this "
                        "machine only; any other needs --token)")
    studio.add_argument("--token", help="access token every request must carry (generated when --host is not "
                        "this machine and none is given)")
    studio.set_defaults(handler=command_studio)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        quiet_third_party()
    try:
        return args.handler(args)
    except VidtuneError as error:
        if args.verbose:
            raise
        code = getattr(error, "exit_code", 2)
        print(f"\n{'error' if code == 2 else 'stopped'}: {error}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if args.command == "caption":  # every caption made so far is written: a rerun does the rest
            print("\nInterrupted; every caption made so far is written.\nWhat to do: to caption the rest, run the "
                  "same command again.", file=sys.stderr)
            return 130
        again = (resume_command(*_split_config_and_overrides(args.config), verbose=args.verbose)
                 if args.command == "train" else "the same command with checkpoint.resume=latest")
        print(f"\nInterrupted at once; the checkpoints already written are kept.\nWhat to do: to continue, run "
              f"{again}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
