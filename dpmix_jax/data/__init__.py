"""Data layer: random-access sources, λ-mixtures, chest X-ray and text loaders, embedded defaults.

Modules (see each docstring):
    sources       `Source` (len / getitem / padded `gather`), `ArraySource`, splits, `GroupIndex`
    mixture       λ validation, soft targets, per-source mixture draws, token budgets
    cxr           NIH ChestX-ray14, CheXpert, MIMIC-CXR-JPG -> `CxrDataset`
    text          Enron sent mail, jsonl/parquet document streams, packing for LM training
    tokenizer     offline GPT-2 BPE and small trained byte-level BPE
    tfds_sources  CIFAR-100 / ImageNet via `tfds.data_source` (import it explicitly; it loads tfds)
    builtin       offline default tasks on data shipped by installed packages

This package imports neither `dpmix_jax.models` nor `dpmix_jax.train`.
"""

from dpmix_jax.data.builtin import (
    BUILTIN_DATA_SOURCES,
    DigitMixtureTask,
    TextMixtureTask,
    describe_builtin_data,
    load_digit_mixture_task,
    load_text_mixture_task,
)
from dpmix_jax.data.cxr import CxrDataset, load_chexpert, load_mimic_cxr, load_nih
from dpmix_jax.data.mixture import (
    MixtureSource,
    SoftTargetSource,
    allot_token_budget,
    check_weights,
    draw_mixture,
    soft_targets,
)
from dpmix_jax.data.sources import (
    ArraySource,
    GroupIndex,
    Source,
    SubsetSource,
    group_disjoint_split,
    padding_mask,
    random_split,
)
from dpmix_jax.data.text import (
    UserDocuments,
    document_tokens,
    iter_documents,
    load_domains,
    load_enron,
    pack_sequences,
)
from dpmix_jax.data.tokenizer import TextTokenizer, gpt2_tokenizer, train_bpe_tokenizer

__all__ = [
    "BUILTIN_DATA_SOURCES",
    "ArraySource",
    "CxrDataset",
    "DigitMixtureTask",
    "GroupIndex",
    "MixtureSource",
    "SoftTargetSource",
    "Source",
    "SubsetSource",
    "TextMixtureTask",
    "TextTokenizer",
    "UserDocuments",
    "allot_token_budget",
    "check_weights",
    "describe_builtin_data",
    "document_tokens",
    "draw_mixture",
    "gpt2_tokenizer",
    "group_disjoint_split",
    "iter_documents",
    "load_chexpert",
    "load_digit_mixture_task",
    "load_domains",
    "load_enron",
    "load_mimic_cxr",
    "load_nih",
    "load_text_mixture_task",
    "pack_sequences",
    "padding_mask",
    "random_split",
    "soft_targets",
    "train_bpe_tokenizer",
]
