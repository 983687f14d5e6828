"""The one typed configuration of a vidtune run.

A config is a YAML or TOML file plus `section.key=value` overrides from the command line. Every key has a type and,
where it makes sense, a range or a set of allowed values; unknown keys are errors. The resolved config (defaults
filled in) is written into the output folder of each run, and is frozen once made.

`schema.py`: the sections, keys, defaults and checks; `load.py`: reading files and overrides into a config and
writing it back; `problems.py`: the message naming every invalid setting and where it was set.
"""

from vidtune.config.load import (
    PATH_KEYS,
    apply_overrides,
    build_config,
    config_fingerprint,
    folder_looked_for,
    load_config,
    parse_override,
    resolve_path,
    resolve_paths,
    write_resolved_config,
)
from vidtune.config.problems import Origins, yaml_key_lines
from vidtune.config.schema import (
    SOURCE_TYPES,
    AdapterConfig,
    CheckpointConfig,
    ConditioningConfig,
    Config,
    ControlConfig,
    DataConfig,
    DatasetSource,
    DistillationConfig,
    DType,
    FolderSource,
    FullConfig,
    LoggingConfig,
    LoRAConfig,
    MemoryConfig,
    MetadataSource,
    ModelConfig,
    OptimizerConfig,
    PairsSource,
    ParallelConfig,
    PrecomputeConfig,
    Section,
    TrainingConfig,
    ValidationConfig,
    WandbConfig,
    required_keys,
)

__all__ = [
    "PATH_KEYS", "SOURCE_TYPES", "AdapterConfig", "CheckpointConfig", "ConditioningConfig", "Config", "ControlConfig",
    "DType",
    "DataConfig", "DatasetSource",
    "DistillationConfig", "FolderSource", "FullConfig", "LoRAConfig", "LoggingConfig", "MemoryConfig",
    "MetadataSource", "ModelConfig", "OptimizerConfig", "Origins", "PairsSource", "ParallelConfig", "PrecomputeConfig",
    "Section", "TrainingConfig", "ValidationConfig", "WandbConfig", "apply_overrides", "build_config",
    "config_fingerprint", "folder_looked_for", "load_config", "parse_override", "required_keys", "resolve_path",
    "resolve_paths", "write_resolved_config", "yaml_key_lines",
]
