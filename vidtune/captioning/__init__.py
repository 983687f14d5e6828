"""Captions for clips and stills, written by a vision-language model into the files a data source reads
(`vidtune caption`). `run.caption_all` is the loop; `vlm.Captioner` the model; `frames` what it sees of a clip;
`qwen_inputs` its vision inputs; where captions are stored is `vidtune.data.caption_files`."""
