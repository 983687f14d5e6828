"""Files for other tools: `command.py` is `vidtune export` (a checkpoint -> the final files); `comfyui.py` and
`comfyui_models.py` the ComfyUI LoRA format the specs declare their rules in. Nothing is imported here, so a spec
reading the ComfyUI rules does not load the command (which builds on the trainers)."""
