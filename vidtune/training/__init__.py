"""A training run, built from parts: `setup` (checks, loads and restores, returning a frozen `context.TrainingContext`),
`loop` (the steps), `held_out` and `validation` (what is measured and sampled on the way), `stop` (signals).
`vidtune.trainers.build_trainer(config).run()` is the entry point."""
