"""The disks a run writes to: what is on them, and what to say when they fail.

- `faults`: an error raised while writing (a full disk, a read-only or vanished folder, no permission) told apart
  from a bug and turned into a `StorageError` whose message names the folder, what was written and what to do;
  `vidtune.files` (every atomic write) raises it.
- `digests`: SHA-256 of files and of a safetensors file's tensor bytes, kept in that file's metadata (the weights a
  run exports, the precompute cache's entries).
- `manifest`: a folder's digest manifest (every file's size and SHA-256), written last into each checkpoint and
  checked before one is resumed or exported.
- `space`: free space, sizes in words, and the space a run's checkpoints and final files take.

It imports only `vidtune.errors`, `vidtune.files` and outside libraries, so any layer may use it.
"""
