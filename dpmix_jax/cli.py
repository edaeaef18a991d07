"""The `dpmix` command: parses, builds a config, calls the library.

dpmix demo [image|text] [--out DIR] [--epsilons 1 2 5] [--seeds 0 1 2] [--delta 1e-5]
           [--noise independent|bandmf --bands B] ...
dpmix run EXPERIMENT [--mesh data=D,model=M] [--distributed] [experiment arguments ...]
dpmix audit [arguments ...]          (= dpmix run audit ...)
dpmix bench [arguments ...]          (= dpmix run bench_grads ...)
dpmix experiments                    (lists the experiments)
dpmix report [--add NAME=RUN_DIR ...] [--check]   (README tables from docs/results/*.json)
dpmix generate [--documents DIR] [--model DIR] [--epsilon 1] [--out DIR] ...   (Hot PATE text)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import pathlib
import runpy
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from dpmix_jax import checkout, interrupt

EXPERIMENTS = {
    "quickstart": "DP-SGD on scikit-learn digits with the privacy core only",
    "nih_chexpert": "NIH ChestX-ray14 with CheXpert as public data (14 tasks, macro AUC)",
    "nih_mimic": "NIH ChestX-ray14 with MIMIC-CXR as public data (14 tasks, macro AUC)",
    "enron": "Enron sent mail, user-level DP, Common Pile domains as public data",
    "openwebmath": "OpenWebMath, example-level DP",
    "k_scaling": "excess MixMin loss against the number of public sources k",
    "ablations": "ρ, proxy epochs, and parallel vs sequential composition",
    "per_task": "per-task AUC gains over Random Init, prevalence groups, a rare-label task's λ",
    "patient_level": "image vs patient privacy unit at equal ε (user-level DP over patients)",
    "small_eps": "λ's cosine to non-private MixMin at ε = 0.2 and 1, and a mixture-settings sweep",
    "rho_guide": "sufficient mixture size from the error bound vs measured excess loss over n",
    "tabular": "tabular DP-MixMin on a bundled table under covariate shift, density-ratio variant",
    "gsd": "gradient subspace distance source selection vs DP-MixMin on shared inputs",
    "clip_study": "clipping bias: excess loss against C, with and without the gradient shift",
    "shift_study": "DP-MixMin's gradient shift vs raw clipping on the image and text defaults",
    "search_cost": "privacy cost of Random Search against k, beside DP-MixMin's",
    "correlated_noise": "BandMF vs DP-SGD at equal ε: image and text fine-tuning, DP-MixMin",
    "adaptive_clipping": "adaptive vs fixed clip norms (C, 10C, C/10) in DP fine-tuning",
    "audit": "canary audits of every release (many runs, one run) and a tightness check",
    "hot_pate": "Hot PATE: coordinated vs independent ensembles, private generation",
    "text_peers": "Hot PATE vs InvisibleInk, Amin et al. 2024, PMixED: topic-conditioned text",
    "hot_pate_ablations": "Hot PATE: temperature, TARGMAX vs TWS, privacy cost, API-only teachers",
    "discrete_noise": "exact discrete noise for vote counts: sampler speed, ε vs continuous noise",
    "bench_grads": "per-example gradient throughput against non-private steps and Opacus",
}

# The pipeline's methods (`pipeline.METHODS`; spelled out so that `--help` needs no JAX import).
METHOD_NAMES = ("dp_mixmin", "uniform", "random_init", "random_search", "nonprivate_mixmin")

_SHORTCUTS = {"audit": "audit", "bench": "bench_grads"}  # dpmix NAME ... = dpmix run TARGET ...
_MAX_SEED = 2**32 - 1
# Set (to anything but 0) to see the traceback of an error that dpmix reports in one line.
DEBUG_ENV = "DPMIX_DEBUG"
INTERRUPTED = (
    "interrupted; to resume, rerun the same command (same --out): its stored stages are read "
    "back and their privacy ledger is kept"
)
INTERRUPTED_STATUS = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
_MAX_MESSAGE = 400  # characters of an error message shown; the start names the file

# The program name of the experiment that `_run_experiment` runs (`experiment_program`).
_experiment_prog: str | None = None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default and keeps the line breaks of descriptions and epilogs. An
    option whose default is None says in its help what leaving it out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--mesh` and `--distributed` (applied by `use_mesh`)."""
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="device mesh of the training runs: D devices split each batch, M devices split "
        "large parameters (FSDP); default: every device on data",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="multi-process run (TPU pods, GPU clusters): every process runs the same command; "
        "jax.distributed.initialize() reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
        "JAX_PROCESS_ID (or detects them on TPU/SLURM); process 0 writes the outputs",
    )


def use_mesh(args: argparse.Namespace) -> None:
    """Starts the multi-process runtime if asked and makes `--mesh` the run's mesh."""
    import jax

    from dpmix_jax import parallel

    out = str(getattr(args, "out", None) or "")
    if "://" in out or out.startswith("gs:/"):
        raise ValueError(
            f"--out {out}: outputs go to a local or mounted folder, not a URL; mount the bucket "
            "(e.g. with gcsfuse) and give its path"
        )
    if args.distributed:
        _initialize_distributed()
    if not args.mesh and jax.device_count() == 1:
        parallel.set_active_mesh(None)  # one device: nothing to shard
        return
    config = parallel.parse_mesh(args.mesh) if args.mesh else parallel.MeshConfig()
    parallel.set_active_mesh(parallel.make_mesh(config), config.fsdp_min_size)


def experiment_program(name: str) -> str:
    """The name the parser of `experiments.NAME` shows: `dpmix audit`, `dpmix run enron`, or
    (when the module is run directly) `python -m experiments.enron`."""
    return _experiment_prog or f"python -m experiments.{name}"


def parse_seed(text: str) -> int:
    """A `--seeds` value: an integer from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {_MAX_SEED}, got {text}")
    return value


def _examples(prog: str, *lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {prog} {line}".rstrip() for line in lines)


def _version() -> str:
    try:
        return importlib.metadata.version("dpmix_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run `pip install -e .`)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpmix",
        description="Differentially private learning with public data: DP-MixMin and Hot PATE.",
        epilog=_examples(
            "dpmix",
            "demo                      # DP-MixMin vs baselines on the image default",
            "demo text --out runs/demo_text",
            "run k_scaling --preset cpu",
            "audit --preset cpu",
            "experiments               # list the experiments",
            "COMMAND --help            # the options of one command",
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="end-to-end DP-MixMin against the baselines on an embedded default data set",
        description=textwrap.fill(
            "Runs DP-MixMin, Uniform, Random Init, Random Search and non-private MixMin at each "
            "ε and seed on an embedded default (offline; image: 7 minutes, text: 23, on 2 "
            "CPU cores shared with other jobs) and "
            "writes results.json, results.md and plots to --out. Finished stages are stored "
            "under --out/stages, so an interrupted demo resumes."
        ),
        epilog=_examples(
            "dpmix demo",
            "",
            "text --out runs/demo_text",
            "--epsilons 0.5 1 --seeds 0 --delta 1e-6",
            "--methods dp_mixmin uniform --quiet",
        ),
        formatter_class=HelpFormatter,
    )
    demo.add_argument(
        "dataset",
        nargs="?",
        choices=("image", "text"),
        default="image",
        help="image: MNIST digits with 12 public label functions (example-level DP); text: "
        "synthetic e-mail users over 7 public text domains (user-level DP)",
    )
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="output folder (default: runs/demo, runs/demo_text for text): results.json, "
        "results.md, plots, stages/ (stored stages, for resuming) and xla_cache/ (compiled "
        "programs)",
    )
    demo.add_argument(
        "--epsilons",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 5.0],
        metavar="EPS",
        help="end-to-end target ε of each run (every method is run at each)",
    )
    demo.add_argument(
        "--delta",
        type=float,
        default=1e-5,
        metavar="DELTA",
        help="δ of every private stage and of the end-to-end guarantee; must be below 1/n for "
        "the n units of each private stage",
    )
    demo.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="accept a δ >= 1/n, which protects nobody (every result records the override)",
    )
    demo.add_argument(
        "--seeds",
        type=parse_seed,
        nargs="+",
        default=[0, 1, 2],
        metavar="SEED",
        help="repetitions; tables and plots show mean ± std over them",
    )
    demo.add_argument(
        "--methods",
        nargs="+",
        choices=METHOD_NAMES,
        default=list(METHOD_NAMES),
        metavar="METHOD",
        help=f"methods to compare, a subset of: {' '.join(METHOD_NAMES)}",
    )
    demo.add_argument(
        "--reproducible",
        action="store_true",
        help=(
            "seed the private mechanisms' noise, sampling and splits with --seeds (exact "
            "reproduction; not private against anyone who knows the seeds); without it the "
            "seeds only number the repetitions and private randomness is secret"
        ),
    )
    demo.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="text only: DP fine-tuning of rank-R LoRA adapters (alpha = 2R) on every attention "
        "and MLP projection, the pretrained weights frozen (default: the last block and the head)",
    )
    demo.add_argument(
        "--noise",
        choices=("independent", "bandmf"),
        default=None,
        help="noise of the private fine-tuning and DP-MixMin stages: independent (DP-SGD) or "
        "bandmf (correlated noise of --bands bands, cyclic Poisson sampling) (default: the "
        "presets' independent noise)",
    )
    demo.add_argument(
        "--bands",
        type=int,
        default=None,
        metavar="B",
        help="bands of --noise bandmf (1 <= B <= each stage's steps; 1 is DP-SGD) (default: "
        "none; required with --noise bandmf)",
    )
    demo.add_argument(
        "--adaptive-clipping",
        action="store_true",
        help=(
            "adaptive clipping in DP fine-tuning and DP-MixMin: the clip norm starts at the "
            "preset's and follows --target-quantile of the units' gradient norms (same ε)"
        ),
    )
    demo.add_argument(
        "--target-quantile",
        type=float,
        default=None,
        metavar="Q",
        help="with --adaptive-clipping: the fraction of units left unclipped (default 0.5)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    add_scale_arguments(demo)

    width = max(map(len, EXPERIMENTS))
    run = commands.add_parser(
        "run",
        help="run a paper experiment (see `dpmix experiments`)",
        description=(
            "Runs `python -m experiments.EXPERIMENT` with the remaining arguments; "
            "`dpmix run EXPERIMENT --help` shows the experiment's own options.\n\nexperiments:\n"
            + "\n".join(f"  {name:<{width}}  {text}" for name, text in EXPERIMENTS.items())
        ),
        epilog=_examples(
            "dpmix run",
            "k_scaling --preset cpu",
            "enron --preset cpu --out runs/enron",
            "nih_chexpert --preset paper --nih-root data/nih --public-root data/chexpert",
            "audit --help",
        ),
        formatter_class=HelpFormatter,
    )
    run.add_argument(
        "experiment",
        choices=list(EXPERIMENTS),
        metavar="EXPERIMENT",
        help="one of: " + ", ".join(EXPERIMENTS),
    )
    run.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments of the experiment (each also takes --mesh and --distributed)",
    )

    for name, target in _SHORTCUTS.items():
        # Every argument goes to the experiment (collected by `main`: argparse's REMAINDER
        # does not take options as a subcommand's first argument).
        sub = commands.add_parser(name, help=EXPERIMENTS[target], add_help=False)
        sub.set_defaults(experiment=target)
    commands.add_parser("experiments", help="list the experiments", formatter_class=HelpFormatter)
    report = commands.add_parser(
        "report",
        help="rebuild the results tables of README.md and docs/ from docs/results/*.json",
        description=textwrap.fill(
            "Every results table in README.md and docs/*.md sits between "
            "`<!-- table:NAME VIEW -->` and `<!-- /table -->` and is rendered from "
            "docs/results/NAME.json, a copy of the "
            "results.json a run wrote. --add copies a finished run's results.json and plots "
            "there first; --check changes nothing and fails if a table differs from its file. "
            "Numbers in the prose are derived from the same files by hidden "
            "`<!-- numbers NAME ... -->` blocks (see dpmix_jax.pipeline.numbers); both modes "
            "list every one the stored runs do not give, and exit 1 then."
        ),
        epilog=_examples(
            "dpmix report",
            "                           # rebuild the tables from docs/results/*.json",
            "--add demo-image=runs/demo demo-text=runs/demo_text",
            "--check",
        ),
        formatter_class=HelpFormatter,
    )
    report.add_argument(
        "--add",
        nargs="+",
        default=[],
        metavar="NAME=RUN_DIR",
        help="copy RUN_DIR/results.json to docs/results/NAME.json (and its plots beside it)",
    )
    report.add_argument(
        "--readme",
        type=pathlib.Path,
        nargs="+",
        default=None,
        metavar="PATH",
        help="the markdown files whose tables are rebuilt (default: README.md and docs/*.md)",
    )
    report.add_argument(
        "--results",
        type=pathlib.Path,
        default=pathlib.Path("docs/results"),
        metavar="DIR",
        help="the folder of the checked-in results files",
    )
    report.add_argument(
        "--check", action="store_true", help="only compare; exit 1 if a table is out of date"
    )
    _add_generate_command(commands)
    return parser


def _demo_config(args: argparse.Namespace) -> Any:
    """The demo's preset with the command line's stage settings: LoRA, noise, adaptive clipping."""
    if args.dataset == "image":
        if args.lora_rank is not None:
            raise ValueError("argument --lora-rank: LoRA applies to the text demo's GPT-2 only")
        from dpmix_jax.pipeline.presets import image_demo_config

        config = image_demo_config()
    else:
        from dpmix_jax.pipeline.text_presets import text_demo_config

        try:
            config = text_demo_config(lora_rank=args.lora_rank)
        except ValueError as err:
            raise ValueError(f"argument --lora-rank: {err}") from err
    return _with_adaptive_clipping(_with_noise(config, args), args)


def _with_adaptive_clipping(config: Any, args: argparse.Namespace) -> Any:
    """`config` with --adaptive-clipping applied to its fine-tuning and DP-MixMin stages."""
    if args.target_quantile is not None and not args.adaptive_clipping:
        raise ValueError("argument --target-quantile: needs --adaptive-clipping")
    if not args.adaptive_clipping:
        return config
    from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping

    quantile = 0.5 if args.target_quantile is None else args.target_quantile
    try:
        adaptive = AdaptiveClipping(target_quantile=quantile)
        return dataclasses.replace(
            config,
            mixture=dataclasses.replace(config.mixture, adaptive_clipping=adaptive),
            finetune=dataclasses.replace(config.finetune, adaptive_clipping=adaptive),
        )
    except ValueError as err:
        raise ValueError(f"arguments --adaptive-clipping/--target-quantile: {err}") from None


def _check_demo_arguments(args: argparse.Namespace) -> None:
    """Refuses, before any work, a privacy setting the pipeline would refuse at its first
    private stage: δ, and each stage's share of every ε against the calibration range."""
    from dpmix_jax.pipeline.common import stage_epsilons
    from dpmix_jax.privacy import accounting, validation

    validation.check_delta(args.delta, "argument --delta")
    config = _demo_config(args)
    low, high = accounting.CALIBRATION_EPSILON_RANGE
    for epsilon in args.epsilons:
        validation.check_epsilon(epsilon, "argument --epsilons")
        stages = stage_epsilons(epsilon, config.composition, config.sequential_mixture_share)
        if not all(low <= stage <= high for stage in stages):
            raise ValueError(
                f"argument --epsilons: {epsilon:g} gives the private stages ε = "
                f"{', '.join(f'{stage:g}' for stage in stages)} ({config.composition} "
                f"composition); each must be in [{low:g}, {high:g}]"
            )


def _with_noise(config: Any, args: argparse.Namespace) -> Any:
    """`config` with --noise/--bands applied to its fine-tuning and DP-MixMin stages."""
    if args.noise is None and args.bands is None:
        return config
    try:
        settings = {"noise": args.noise or "independent", "bands": args.bands}
        return dataclasses.replace(
            config,
            finetune=dataclasses.replace(config.finetune, **settings),
            mixture=dataclasses.replace(config.mixture, **settings),
        )
    except ValueError as err:
        raise ValueError(f"arguments --noise/--bands: {err}") from None


def output_lock(out: pathlib.Path) -> contextlib.AbstractContextManager:
    """The lock of the output folder `out` (`folders.folder_lock`), held by process 0 of a
    multi-process run; taken before the data and the proxies, a second run on the folder stops
    at once."""
    from dpmix_jax import parallel
    from dpmix_jax.pipeline import folders

    return folders.folder_lock(out) if parallel.is_main_process() else contextlib.nullcontext()


def _demo(args: argparse.Namespace) -> int:
    from dpmix_jax.pipeline import METHODS

    use_mesh(args)
    _check_out_dir(args.out)
    with output_lock(args.out):
        return _run_demo(args, [m for m in METHODS if m in args.methods])


def _run_demo(args: argparse.Namespace, methods: list[str]) -> int:
    from dpmix_jax.pipeline import run_comparison
    from dpmix_jax.pipeline.common import use_compilation_cache

    start = time.time()
    use_compilation_cache(args.out / "xla_cache")
    config = dataclasses.replace(
        _demo_config(args), delta=args.delta, allow_large_delta=args.allow_large_delta
    )
    if args.dataset == "image":
        from dpmix_jax.pipeline.image import ImagePipeline
        from dpmix_jax.pipeline.presets import digit_task

        task = digit_task()
        pipeline = ImagePipeline(task, config, args.out / "stages", reproducible=args.reproducible)
        metric, higher = "test AUC", True
    else:
        from dpmix_jax.pipeline.text import TextPipeline
        from dpmix_jax.pipeline.text_presets import text_task

        task = text_task()
        pipeline = TextPipeline(task, config, args.out / "stages", reproducible=args.reproducible)
        metric, higher = "test perplexity", False
    results = run_comparison(
        pipeline,
        dataset=task.name,
        metric=metric,
        higher_is_better=higher,
        methods=methods,
        epsilons=args.epsilons,
        seeds=args.seeds,
        out_dir=args.out,
        true_weights=task.true_weights,
        source_names=task.source_names,
        progress=not args.quiet,
    )
    print((args.out / "results.md").read_text())
    print(f"{len(results['runs'])} runs in {time.time() - start:.0f} s; outputs in {args.out}/")
    return 0


def _check_out_dir(out: pathlib.Path) -> None:
    """Creates `out` if needed; a file or an unwritable folder there is a one-line error."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; give a folder path for the outputs")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise ValueError(
            f"--out {out} cannot be written ({err.strerror or err}); choose a folder you can "
            "write to"
        ) from err


def _initialize_distributed() -> None:
    from dpmix_jax import parallel

    def env_int(name: str) -> int | None:
        return int(os.environ[name]) if name in os.environ else None

    parallel.initialize(
        parallel.MeshConfig(
            distributed=True,
            coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=env_int("JAX_NUM_PROCESSES"),
            process_id=env_int("JAX_PROCESS_ID"),
        )
    )


def _run_experiment(args: argparse.Namespace) -> int:
    global _experiment_prog
    module = f"experiments.{args.experiment}"
    if importlib.util.find_spec(module) is None:
        raise SystemExit(
            f"dpmix run: {module} is not importable; run dpmix from the project checkout "
            "(the experiments/ folder) or install the project with `pip install -e .`."
        )
    sys.argv = [module, *args.args]
    shortcut = args.command in _SHORTCUTS
    _experiment_prog = f"dpmix {args.command}" if shortcut else f"dpmix run {args.experiment}"
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        _experiment_prog = None
    return 0


def _report(args: argparse.Namespace) -> int:
    from dpmix_jax.pipeline import numbers, report

    for item in args.add:
        name, sep, run_dir = item.partition("=")
        if not sep or not name or not run_dir:
            raise SystemExit(f"dpmix report: --add takes NAME=RUN_DIR, got {item!r}")
        copied = report.add_results(name, pathlib.Path(run_dir), args.results)
        print(f"copied {', '.join(str(p) for p in copied)}")
    documents = args.readme or report.documents(pathlib.Path("."))
    problems, counts = [], Counter()
    for path in documents:
        if args.check:
            problems += report.stale_tables(path, args.results)
        else:
            updated = report.update_markdown(path, args.results)
            if updated:
                print(f"rebuilt {len(updated)} table(s) in {path}: {', '.join(updated)}")
        prose_problems, prose_counts = numbers.check_file(path, args.results)
        problems += prose_problems
        counts += prose_counts
    print(
        f"numbers in the prose: {counts['derived']} derived from stored runs or formulas, "
        f"{counts['paper']} are the papers', {counts['setting']} settings, {counts['unstored']} "
        "measured outside a stored run"
    )
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


_TEXT_DEFAULT_TEACHERS = 512  # teachers on the text default (the Hot PATE experiment's n)


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    """Adds `dpmix generate`: private synthetic text with Hot PATE (`pate.synthesize`)."""
    generate = commands.add_parser(
        "generate",
        help="private synthetic text from a folder of documents with Hot PATE",
        description=textwrap.fill(
            "Splits the documents among teachers over a public GPT-2, in context or fine-tuned "
            "(a unit is a "
            "document, or a user when the records carry a user field), calibrates the "
            "aggregator's noise to --epsilon at --delta for the longest possible run, and "
            "writes the samples (samples.jsonl) and the ε the accountant gives for the calls "
            "that ran (report.json) to --out. Without --documents and --model it runs on the "
            "embedded text default: its e-mail sentences, and a small GPT-2 trained on its "
            "public domains (stored under --out/stages and read back by later runs)."
        ),
        epilog=_examples(
            "dpmix generate",
            "",
            "--documents notes/ --num-teachers 64 --model gpt2-folder/ --prompt 'Dear'",
            "--num-samples 8 --method independent --seed 0 --out runs/generate_seeded",
            "--teachers fine-tuned --out runs/generate_fine_tuned",
        ),
        formatter_class=HelpFormatter,
    )
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
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="a transformers GPT-2 folder (config.json, weights, tokenizer) or a model stored by "
        "dpmix; default: the text default's public GPT-2, trained on first use",
    )
    generate.add_argument("--prompt", default="", help="public text every sample starts from")
    generate.add_argument(
        "--epsilon", type=float, default=1.0, help="total ε of the run (data independent)"
    )
    generate.add_argument(
        "--delta", type=float, default=1e-5, help="total δ; must be below 1/n for n teachers"
    )
    generate.add_argument("--num-samples", type=int, default=4, metavar="N", help="texts")
    generate.add_argument(
        "--method",
        choices=("coordinated", "independent", "invisibleink", "amin", "pmixed"),
        default="coordinated",
        help="Hot PATE's vote histograms, coordinated (hot, shared sampling noise) or "
        "independent (cold), or a peer on the same teachers: invisibleink (clipped logit "
        "differences, top-k+), amin (clipped logits and a sparse-vector test, Amin et al. 2024) "
        "or pmixed (mixtures projected onto a Rényi ball around the public model)",
    )
    generate.add_argument(
        "--aggregator",
        choices=("confident_gnmax", "dpargmax_laplace", "dpws"),
        default="confident_gnmax",
        help="DP aggregator of the votes (confident_gnmax also releases a data-dependent ε)",
    )
    generate.add_argument(
        "--max-new-tokens", type=int, default=16, metavar="T", help="tokens per sample at most"
    )
    generate.add_argument(
        "--teachers",
        choices=("in-context", "fine-tuned"),
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
        "(required with --documents; the text default uses 512); with --accounting individual "
        "every unit is a teacher: omit it, or give the number of units",
    )
    generate.add_argument(
        "--accounting",
        choices=("standard", "individual"),
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
        help="output folder: samples.jsonl, report.json, stages/ (the default model)",
    )
    generate.add_argument(
        "--seed",
        type=parse_seed,
        default=None,
        help="seed the partition, the samplers and the noise (reproducible; not private against "
        "anyone who knows it); default: secret randomness from the operating system",
    )
    generate.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def _generate(args: argparse.Namespace) -> int:
    """`dpmix generate`: checks the arguments, loads documents and model, writes the outputs."""
    from dpmix_jax.privacy import accounting, validation

    validation.check_epsilon(args.epsilon, "argument --epsilon")
    low, high = accounting.CALIBRATION_EPSILON_RANGE
    if not low <= args.epsilon <= high:
        raise ValueError(f"argument --epsilon must be in [{low:g}, {high:g}], got {args.epsilon:g}")
    individual = args.accounting == "individual"
    num_teachers = _TEXT_DEFAULT_TEACHERS if args.num_teachers is None else args.num_teachers
    if not individual or args.num_teachers is not None:  # else δ < 1/units, checked on the data
        validation.check_delta_for_units(
            args.delta, max(num_teachers, 1), unit="teachers", name="argument --delta"
        )
    for name in ("num_samples", "max_new_tokens"):
        validation.check_steps(getattr(args, name), f"argument --{name.replace('_', '-')}")
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
    _check_out_dir(args.out)
    with output_lock(args.out):
        return _run_generate(args)


def _check_individual_arguments(args: argparse.Namespace) -> None:
    """`synthesize.check_individual_accounting` on the command line's settings, before any
    model is loaded: one line naming --accounting and what it refuses."""
    from dpmix_jax.pate import synthesize

    try:
        synthesize.check_individual_accounting(
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

    from dpmix_jax.pate import finetuned, public, synthesize
    from dpmix_jax.privacy import randomness

    start = time.time()

    def log(message: str) -> None:
        if not args.quiet:
            print(f"[generate] {message}", file=sys.stderr, flush=True)

    if args.documents is None:
        documents, documents_source = synthesize.text_default_documents(), "text default"
    else:
        documents, documents_source = synthesize.load_documents(args.documents), args.documents
    log(f"{len(documents)} documents from {documents_source}")
    if args.model is None:
        log("public model: the text default's (trained on first use, then read back)")
        model = public.text_default_model(args.out / "stages", log=log)
    else:
        model = public.load_public_model(args.model)
    key = None if args.seed is None else randomness.prng_key(args.seed)
    tuning = None
    if args.tuning_steps is not None:
        tuning = finetuned.TeacherTuning(steps=args.tuning_steps)
    if args.teachers == "fine-tuned":
        log("fine-tuning one adapter per teacher on its own documents")
    bar = tqdm(total=args.num_samples * args.max_new_tokens, unit="tok", disable=args.quiet)

    def on_step() -> None:
        if bar.n == 0:  # the rate counts from the first token, after the teachers are built
            bar.reset(total=bar.total)
        bar.update(1)

    num_teachers = args.num_teachers
    if num_teachers is None and args.accounting == "standard":
        num_teachers = _TEXT_DEFAULT_TEACHERS
    with bar:
        result = synthesize.synthesize(
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


def main(argv: list[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`); returns the exit status.

    Bad input and Ctrl-C end with one line on stderr and no traceback (see `one_line_errors`).
    """
    parser = _parser()
    try:
        # Ctrl-C while the demo's arguments are checked (loading the library) also ends here.
        # The results name the code the run started from.
        with one_line_errors(parser.prog), checkout.pinned_commit():
            args, extra = parser.parse_known_args(argv)
            if args.command in _SHORTCUTS:
                args.args = extra
            elif extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            if args.command == "demo":
                try:
                    _check_demo_arguments(args)
                except ValueError as err:
                    parser.error(str(err))
            return _command(args)
    finally:
        parallel = sys.modules.get("dpmix_jax.parallel")  # not loaded: no mesh was set
        if parallel is not None:
            parallel.set_active_mesh(None)  # the mesh belongs to this command only


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises: a `ValueError` from the library, a file that cannot be read or
    written, a document nested too deep to parse, an image too large to decode."""
    from PIL import Image

    return ValueError, OSError, RecursionError, Image.DecompressionBombError


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Ends bad input and Ctrl-C inside the block with one line on stderr, without a traceback.

    Bad input (`_input_errors`) prints `PROG: error: ...` and exits with status 2; Ctrl-C prints
    `PROG: interrupted; ...` (how to resume) and exits with status 130. A Ctrl-C that lands in a
    callback Python cannot raise from stops the run at its next step or stage
    (`interrupt.stop_on_interrupt`). Set the environment variable DPMIX_DEBUG=1 to see the
    traceback instead.
    """
    debug = os.environ.get(DEBUG_ENV, "0") != "0"
    try:
        with interrupt.stop_on_interrupt():
            yield
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: {INTERRUPTED}", file=sys.stderr)
        raise SystemExit(INTERRUPTED_STATUS) from None
    except _input_errors() as err:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    if (large := _large_delta(err)) is not None:  # a command without an override flag
        text = large.message(None)
    elif isinstance(err, OSError) and err.filename is not None:
        text = f"{err.strerror or err}: {err.filename}; check the path and its permissions"
    elif isinstance(err, RecursionError):
        text = f"input nested too deeply to read ({err})"
    else:
        text = str(err) or type(err).__name__
    # Readers may quote raw bytes of a corrupt file: show them escaped, and not too many.
    text = " ".join("".join(map(_printable, text)).split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 1] + "…"


def _printable(char: str) -> str:
    if char.isprintable() or char.isspace():
        return char
    return repr(char)[1:-1]


def _large_delta(err: BaseException):
    """`err` if it is a `validation.LargeDeltaError` (whose module is then loaded), else None."""
    validation = sys.modules.get("dpmix_jax.privacy.validation")
    return err if validation and isinstance(err, validation.LargeDeltaError) else None


@contextlib.contextmanager
def _delta_override(flag: str | None) -> Iterator[None]:
    """Reports a δ >= 1/n refusal as `argument --delta: ...`, naming the command's `flag`."""
    try:
        yield
    except ValueError as err:
        if (large := _large_delta(err)) is None:
            raise
        raise ValueError(f"argument --delta: {large.message(flag)}") from None


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        if args.out is None:
            args.out = pathlib.Path("runs/demo" if args.dataset == "image" else "runs/demo_text")
        with _delta_override("--allow-large-delta"):
            return _demo(args)
    if args.command == "report":
        return _report(args)
    if args.command == "generate":
        with _delta_override(None):
            return _generate(args)
    if args.command == "experiments":
        width = max(map(len, EXPERIMENTS))
        for name, text in EXPERIMENTS.items():
            print(f"{name:<{width}}  {text}")
        return 0
    return _run_experiment(args)


if __name__ == "__main__":
    # Through the imported module, so that experiments see the program name it sets.
    from dpmix_jax.cli import main as _main

    sys.exit(_main())
