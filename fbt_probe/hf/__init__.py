"""Hugging Face models as full-bandwidth models: the wrapper (``HFFeedbackModel``), the
per-family hooks (``adapters``), model and fusion folders (``folders``), tiny models made
locally (``tiny``) and GGUF conversion (``convert``)."""

from fbt_probe.hf.folders import (
    FUSION_CONFIG,
    FUSION_WEIGHTS,
    TOKENIZER_FILES,
    base_folder,
    check_fusion_values,
    check_hf_config,
    check_vocabulary,
    copy_hf,
    hf_config_of,
    init_fusion,
    is_fusion_folder,
    is_hf_folder,
    load_fusion,
    load_hf,
    quiet,
    random_init_hf,
    read_fusion_config,
    save_fusion,
    save_hf,
)
from fbt_probe.hf.wrapper import FORMAT, HFConfig, HFFeedbackModel, require_tokenizer

__all__ = [
    "HFFeedbackModel",
    "HFConfig",
    "load_hf",
    "save_hf",
    "save_fusion",
    "load_fusion",
    "init_fusion",
    "is_hf_folder",
    "is_fusion_folder",
    "require_tokenizer",
    "random_init_hf",
    "copy_hf",
    "hf_config_of",
    "base_folder",
    "check_fusion_values",
    "check_hf_config",
    "check_vocabulary",
    "read_fusion_config",
    "quiet",
    "FUSION_CONFIG",
    "FUSION_WEIGHTS",
    "TOKENIZER_FILES",
    "FORMAT",
]
