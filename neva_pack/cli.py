"""``neva-pack``: parse -> config -> work -> print summary -> exit code.

Heavy libraries (torch, Megatron-Core, transformers) are imported only by the
subcommand that needs them, so ``neva-pack --help`` answers at once (the packing
registry, which the choices come from, costs only numba's import).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from neva_pack.config import GROUPS, NEMO, OURS, SampleConfig, base_type, flag_of, help_of, options, settings
from neva_pack.core import ConfigError, NevaPackError
from neva_pack.files import PACKED_NAME, location
from neva_pack.formats import FORMATS
from neva_pack.packing import ALGORITHMS, DEFAULT_ALGORITHM, RECOMMENDED_ALGORITHM


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2, as every other bad argument's
    (docs/bad_input.md): argparse's default prints the whole usage first, 45 lines for
    ``preprocess``, which buries the one line that says what is wrong. Subcommand parsers are of the
    same class (argparse makes them of the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def add_preprocess_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (``neva_pack.config``: name, help, section, choices from the field's
    Option), NeMo's section first; the command line's own flags (--hparams_file, --quiet) beside them.
    Every flag defaults to None: the field's default applies after the hparams file, so an explicit
    flag always wins over it."""
    groups = _add_setting_flags(parser)
    groups[NEMO].add_argument("--hparams_file", type=Path, help="NeMo YAML config: model.data.*, model.mm_cfg.* keys are read")
    groups[OURS].add_argument("--quiet", action="store_true", help="no progress bars")


def _add_setting_flags(parser: argparse.ArgumentParser, names: set[str] | None = None) -> dict:
    """The flags of the config fields (``names`` only, if given), in their --help sections."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for spec, opt in settings():
        flag = flag_of(spec)
        if flag is None or (names is not None and spec.name not in names):
            continue  # hparams-only, or not asked for
        kind = base_type(spec)
        arguments = {"dest": spec.name, "default": None, "help": help_of(spec)}
        if kind == "bool":
            arguments["action"] = "store_false" if spec.default is True else "store_true"
        else:
            arguments["type"] = {"Path": location, "int": int, "float": float, "str": str, "tuple[int, ...]": int}[kind]
            if kind.startswith("tuple["):
                arguments["nargs"] = "+"
        if opt.choices is not None:
            arguments["choices"] = list(opt.choices())
        if opt.metavar is not None:
            arguments["metavar"] = opt.metavar
        groups[opt.group].add_argument(flag, **arguments)
    return groups


PREPROCESS_HELP = "tokenize, preprocess images, pack, write packed_seq_dataset"


def preprocess_parser(prog: str = "neva-pack preprocess") -> argparse.ArgumentParser:
    """The ``preprocess`` command's flags on a parser of their own (what ``neva-pack preprocess``
    and ``scripts/preprocess_dataset.py`` accept)."""
    parser = OneLineErrors(prog=prog, description=PREPROCESS_HELP)
    add_preprocess_flags(parser)
    return parser


PLAN_DESCRIPTION = """\
Compare candidate pack sizes x packing algorithms: packs, efficiency, padding, samples per pack,
samples truncated or skipped at each size. The sample lengths come from

  an existing output (or its sample store), no re-tokenization:
    neva-pack plan OUTPUT_DIR --pack_sizes 4096 8192

  or straight from the input, before any pixel is decoded: each record is tokenized with the run's
  template and tokenizer, and each image's token count read from its file's header, by the same
  sample builder a preprocess run uses (the same sample flags give the same lengths):
    neva-pack plan --data_path data.json --image_folder images/ --tokenizer_path tok/ \\
        --conv_template llava_mistral_instruct --hf_vision_encoder llava-hf/llava-v1.6-mistral-7b-hf \\
        --output_format compact --pack_sizes 4096 8192 16384 --max_image_tokens_per_pack 8192
  Records a run would skip for a reason known before decoding are counted by reason; skips that
  only decoding finds (corrupt image data, a size other than the header's) are not predicted.
"""

PLAN_INPUT_SETTINGS = {spec.name for spec, _ in options(SampleConfig)} | {"output_format", "num_workers"}
"""The config fields ``plan --data_path`` takes from --hparams_file and its flags: what makes a sample,
and how many workers lay records out (its pack sizes and alignment are its own flags')."""
PLAN_OUTPUT_DIR = Path(os.devnull)
"""The output directory of ``plan --data_path``'s config: a plan writes nothing, but a run's config
names where it would write (never opened)."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="neva-pack", description="Sequence packing for multimodal (NeVA / LLaVA) fine-tuning.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("preprocess", help=PREPROCESS_HELP)
    add_preprocess_flags(pre)
    stats = sub.add_parser("stats", help="show how well an output packed (and plot it)")
    stats.add_argument("output", type=location, help="output directory or packed prefix (any NeMo-layout prefix), or s3://")
    stats.add_argument("--json", action="store_true", help="print the report as JSON")
    stats.add_argument("--plot", type=Path, help="write a PNG: sample lengths, pack fill, samples per pack")
    stats.add_argument("--global_batch_size", type=_positive_int, help="unpacked GBS, to print the packed GBS to train with")
    stats.add_argument("--crop_size", type=int, nargs=2, metavar=("H", "W"), help="for a prefix without meta")
    stats.add_argument("--max_seq_length", type=int, help="for a prefix without meta (default: longest pack)")
    stats.add_argument("--data_parallel", type=int, metavar="N", help="model the straggler overhead of N ranks: random, attention and modelled order")
    stats.add_argument("--step_cost_model", default="auto", metavar="PRESET", help="with --data_parallel: a preset, auto (the output's model), a JSON file, attention")
    explore = sub.add_parser(
        "plan", help="compare pack sizes and algorithms from the stored sample lengths, or from the input",
        description=PLAN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    explore.add_argument("output", type=Path, nargs="?", help="output directory (or its sample store); or give --data_path")
    _add_setting_flags(explore, PLAN_INPUT_SETTINGS)
    explore.add_argument("--hparams_file", type=Path, help="with --data_path: NeMo YAML config (its sample settings)")
    explore.add_argument("--pack_sizes", type=int, nargs="+", required=True, help="candidate max_seq_length values")
    explore.add_argument("--algorithms", nargs="+", choices=sorted(ALGORITHMS), default=[DEFAULT_ALGORITHM, RECOMMENDED_ALGORITHM])
    explore.add_argument("--seed", type=int, default=0)
    explore.add_argument("--global_batch_size", type=_positive_int, help="unpacked GBS, for the GBS column")
    explore.add_argument("--json", action="store_true", help="print the table as JSON")
    # alignment padding, as preprocess's training-side flags (default: the output's own multiple)
    explore.add_argument("--pad_to_multiple_of", type=int, help="pad every sample to a multiple of M before packing")
    explore.add_argument("--context_parallel_size", type=int, help="CP size: samples padded to a multiple of 2*CP")
    explore.add_argument("--tensor_parallel_size", type=int, help="TP size (with --sequence_parallel: multiple of CP*TP)")
    explore.add_argument("--sequence_parallel", action="store_true", help="Megatron sequence parallelism is on")
    # visual budgets, as preprocess's (a sample over one is skipped, as a run skips it)
    explore.add_argument("--max_images_per_pack", type=int, help="cap on images per pack")
    explore.add_argument("--max_image_tokens_per_pack", type=int, help="cap on image tokens per pack")
    check = sub.add_parser("verify", help="recompute checksums and check every invariant of an output")
    check.add_argument("output", type=location, help="output directory (or packed_seq_dataset prefix), or s3://")
    check.add_argument("--data_path", type=location, help="also check that every input record is packed once or skipped")
    check.add_argument("--quiet", action="store_true", help="no progress bar")
    convert = sub.add_parser("convert", help="rewrite an output in another format (e.g. compact -> nemo where you train)")
    convert.add_argument("source", type=Path, help="output directory (or prefix) to convert")
    convert.add_argument("dest", type=Path, help="directory to write the converted output to (new or empty)")
    convert.add_argument("--to", required=True, choices=sorted(FORMATS), help="target format")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    shards = sub.add_parser("shards", help="a sharded run's shards: which are done, and what to resubmit")
    shards_sub = shards.add_subparsers(dest="shards_command", required=True)
    status = shards_sub.add_parser(
        "status", help="each shard done, running, stale, missing or made with other settings; the resubmission lines",
        description="Each shard of a sharded run (--num_shards) in OUTPUT: done, running (holding its lock), stale "
        "(started, no live holder: --resume continues it), missing, or made with other settings; then the lines that "
        "resubmit exactly the stale and missing ones (SLURM, Kubernetes, Ray). Exit 0 when every shard is done, 1 if not.",
    )  # fmt: skip
    status.add_argument("output", type=location, help="the sharded run's --output_dir (or s3://)")
    status.add_argument("--num_shards", type=int, help="the run's --num_shards (default: read from its parts)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    return parser


def _positive_int(text: str) -> int:
    """An argument that counts something (0 or -5 as --global_batch_size advised a packed GBS of 1)."""
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be a positive integer")
    return value


_positive_int.__name__ = "int"  # argparse names the type in its refusal of a non-number ("invalid int value: 'x'")


def config_from_args(args: argparse.Namespace, names: set[str] | None = None, **given):
    """The run's config from parsed arguments: field defaults (NeMo's for NeMo's flags) < --hparams_file
    < explicit flags < ``given``. ``names``: the settings the command takes from the hparams file and
    its flags (None: every one, as preprocess); ``given``: those the command decides itself (``plan``'s
    candidate sizes and alignment). The one way both ``preprocess`` and ``plan --data_path`` build theirs,
    so that the same flags make the same samples."""
    from neva_pack.config import PreprocessConfig, read_hparams, required_settings

    names = PreprocessConfig.field_names() if names is None else names
    values = {}
    if args.hparams_file is not None:
        values.update({k: v for k, v in read_hparams(args.hparams_file).items() if k in names})
    values.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if "num_shards" in names:
        from neva_pack.records import resolve_shards

        # inside a SLURM job array, the array is the sharding
        values["num_shards"], values["shard_index"] = resolve_shards(values.get("num_shards"), values.get("shard_index"), os.environ)
    for required in required_settings():
        if required in names and values.get(required) is None:
            raise ConfigError(f"--{required} is required")
    return PreprocessConfig(**values, **given)


def _run_preprocess(args) -> int:
    config = config_from_args(args)
    from neva_pack.pipeline import preprocess
    from neva_pack.commands import format_summary
    from neva_pack.files import skipped_path

    shown = _as_given(config.run.output_dir)
    try:
        result = preprocess(config, progress=not args.quiet)
    except NevaPackError as error:
        raise type(error)(shown(str(error))) from None
    for note in result.notes:
        print(shown(note))
    for size, report in result.reports.items():
        if len(result.reports) > 1:
            print(f"== pack size {size}")
        print(shown(format_summary(report)))
    if result.exit_code:
        sized = len(result.reports) > 1
        for size, report in result.reports.items():
            if report.records.skipped:
                report_file = skipped_path(Path(config.run.output_dir), size if sized else None)
                print(f"error: --strict: {report.records.skipped} record(s) skipped; see {report_file}", file=sys.stderr)
    return result.exit_code


def _on_local_copy(command, keep=lambda name: True):
    """``command(args)`` on a temporary local copy of an ``s3://`` output (``files.remote_copy``; a
    prefix given is copied with its directory), its printed lines and errors naming the URL again."""
    import contextlib
    import io

    from neva_pack.files import is_remote, local_copy, remote_copy

    def run(args) -> int:
        if getattr(args, "data_path", None) is not None and is_remote(args.data_path):
            args = argparse.Namespace(**{**vars(args), "data_path": local_copy(args.data_path, "--data_path")})
        if not is_remote(args.output):
            return command(args)
        url = args.output.rstrip("/")
        directory, name = url.rsplit("/", 1)
        whole = name.startswith(PACKED_NAME) and not name.endswith("/")
        with remote_copy(directory if whole else url, keep) as local:
            target = local / name if whole else local
            shown = (str(target), url)
            buffer = io.StringIO()
            try:
                with contextlib.redirect_stdout(buffer):
                    return command(argparse.Namespace(**{**vars(args), "output": target, "output_url": (target, url)}))
            except NevaPackError as error:
                raise type(error)(str(error).replace(*shown).replace(str(local), directory if whole else url)) from None
            finally:
                sys.stdout.write(buffer.getvalue().replace(*shown).replace(str(local), directory if whole else url))

    return run


def _progress_file(name: str) -> bool:
    """What ``shards status`` reads of a sharded output: its parts' (and the joined store's) progress files,
    and their lock objects (a running part may have committed nothing yet)."""
    from neva_pack.files import LOCK_FILE
    from neva_pack.sample_store import PROGRESS_FILE

    return name.rsplit("/", 1)[-1] in (PROGRESS_FILE, LOCK_FILE)


def _as_given(output_dir):
    """Text naming the output as the user gave it: an ``s3://`` output's staging directory (where the
    run wrote before mirroring) replaced by its URL."""
    from neva_pack.files import is_remote
    from neva_pack.pipeline import staged_output

    if not is_remote(output_dir):
        return lambda text: text
    import re

    staged = re.compile(re.escape(str(staged_output(output_dir))) + r"/run-[^/\s]*")
    return lambda text: staged.sub(lambda _: output_dir.rstrip("/"), text)


def _run_verify(args) -> int:
    from neva_pack.commands import verify

    result = verify(args.output, data_path=args.data_path, progress=not args.quiet)
    for problem in result.problems:
        print(f"FAIL {problem}")
    if result.problem_count > len(result.problems):
        print(f"FAIL ... and {result.problem_count - len(result.problems)} more")
    checked = ", ".join(f"{value if not isinstance(value, list) else len(value)} {key}" for key, value in result.checked.items())
    print(f"{'OK' if result.ok else 'FAILED'}: checked {checked}; {result.problem_count} problem(s)")
    return 0 if result.ok else 1


def _run_stats(args) -> int:
    """One report per prefix: a --pack_sizes output prints each size (JSON: a list), plots get _<size>."""
    import json

    from neva_pack.commands import format_summary, load_outputs, plot, with_batch_size

    outputs = load_outputs(args.output, crop_size=args.crop_size, max_seq_length=args.max_seq_length)
    reports = []
    for n, (report, arrays) in enumerate(outputs):
        report = with_batch_size(report, args.global_batch_size)
        if args.data_parallel is not None:
            report = report.replace(balance=_modelled_balance(arrays, args.data_parallel, args.step_cost_model))
        reports.append(report)
        if not args.json:
            if len(outputs) > 1:
                print(f"{'' if n == 0 else chr(10)}== pack size {arrays.capacity}")
            print(format_summary(report))
        if args.plot:
            target = args.plot if len(outputs) == 1 else args.plot.with_name(f"{args.plot.stem}_{arrays.capacity}{args.plot.suffix}")
            dataset = report.dataset or Path(report.data_prefix).parent.name
            title = f"{dataset}: {report.algorithm or 'unknown algorithm'}, max_seq_length {arrays.capacity:,}"
            plot(arrays, target, title)
            if not args.json:
                print(f"plot           {target}")
    if args.json:
        print(json.dumps(reports[0].to_json() if len(reports) == 1 else [r.to_json() for r in reports], indent=2))
    return 0


def _modelled_balance(arrays, data_parallel: int, setting: str):
    """``stats --data_parallel N``: the balance report of the output's packs over N ranks (one line on a bad value)."""
    from neva_pack.commands import step_balance

    try:
        return step_balance(arrays, data_parallel, setting)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _run_plan(args) -> int:
    import dataclasses
    import json

    from neva_pack.commands import explore, format_table, load_lengths

    lengths = _planned_from_input(args) if args.data_path is not None else None
    if lengths is None:
        if args.output is None:
            raise ConfigError("plan: give an output directory, or --data_path (and the run's sample flags) to plan from the input")
        lengths = load_lengths(args.output)
    rows = explore(
        lengths, args.pack_sizes, args.algorithms, seed=args.seed, global_batch_size=args.global_batch_size,
        pad_to_multiple_of=_plan_alignment(args), max_images_per_pack=args.max_images_per_pack,
        max_image_tokens_per_pack=args.max_image_tokens_per_pack,
    )  # fmt: skip
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=2))
    else:
        print(format_table(lengths, rows))
    return 0


def _planned_from_input(args):
    """The input's records laid out as a preprocess run with the same sample flags would build them
    (``config_from_args``: < --hparams_file < flags), cut for the candidate sizes with the plan's
    alignment flags."""
    from neva_pack.pipeline import lengths_from_input

    if args.output is not None:
        raise ConfigError(f"plan: {args.output} and --data_path: plan from an output or from the input, not both")
    config = config_from_args(
        args, PLAN_INPUT_SETTINGS, output_dir=PLAN_OUTPUT_DIR, pack_sizes=args.pack_sizes, **_alignment_flags(args)
    )
    return lengths_from_input(config.sample, config.pack, workers=config.run.num_workers)


def _alignment_flags(args) -> dict:
    """The plan's alignment flags that were given, by the preprocess setting each is."""
    given = {"pad_to_multiple_of": args.pad_to_multiple_of, "context_parallel_size": args.context_parallel_size,
             "tensor_parallel_size": args.tensor_parallel_size, "sequence_parallel": args.sequence_parallel or None}  # fmt: skip
    return {name: value for name, value in given.items() if value is not None}


def _plan_alignment(args) -> int | None:
    """The alignment multiple the plan flags ask for (the run's lcm rule), or None: the output's own."""
    from neva_pack.packing import alignment_multiple

    flags = _alignment_flags(args)
    for name, value in flags.items():
        if name != "sequence_parallel" and value < 1:
            raise ConfigError(f"--{name} {value}: must be >= 1")
    if not flags:
        return None
    return alignment_multiple(
        flags.get("pad_to_multiple_of"), flags.get("context_parallel_size", 1), flags.get("tensor_parallel_size", 1),
        flags.get("sequence_parallel", False),
    )  # fmt: skip


def _run_convert(args) -> int:
    from neva_pack.commands import convert

    for prefix in convert(args.source, args.dest, args.to, progress=not args.quiet):
        print(f"wrote {prefix} ({args.to})")
    return 0


def _run_shards(args) -> int:
    """``shards status``: one line per shard and the resubmission lines (or JSON); exit 1 until every
    shard is done, so that a script can wait on it."""
    import json

    from neva_pack.pipeline import shards_status

    if getattr(args, "output_url", None):  # a local copy of an s3:// output: the locks are the bucket's objects
        from neva_pack.files import remote_lock_holder, url_join

        copy, url = args.output_url

        def holder(part):
            return remote_lock_holder(url_join(url, Path(part).relative_to(copy).as_posix()))

        status = shards_status(args.output, args.num_shards, holder=holder)
    else:
        status = shards_status(args.output, args.num_shards)
    print(json.dumps(status.to_json(), indent=2) if args.json else "\n".join(status.lines()))
    return 0 if status.done else 1


COMMANDS = {"preprocess": _run_preprocess, "stats": _on_local_copy(_run_stats), "plan": _run_plan,
            "verify": _on_local_copy(_run_verify), "convert": _run_convert,
            "shards": _on_local_copy(_run_shards, keep=_progress_file)}  # fmt: skip


class Terminated(BaseException):
    """SIGTERM, turned into an exception so that the run unwinds (workers shut down, lock released)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def _interrupted(args, code: int) -> int:
    what = "interrupted" if code == EXIT_INTERRUPTED else "terminated"
    if args.command == "preprocess" and args.output_dir is not None:
        from neva_pack.files import is_remote

        if is_remote(args.output_dir):  # what was committed or published is in the bucket (mirrored as it stopped)
            print(f"neva-pack: {what}; committed work is kept in {args.output_dir}: run the same command with --resume "
                  "to continue", file=sys.stderr)  # fmt: skip
        else:
            print(f"neva-pack: {what}; {_published_now(Path(args.output_dir))}", file=sys.stderr)
    else:
        print(f"neva-pack: {what}", file=sys.stderr)
    return code


def _published_now(output_dir: Path) -> str:
    """What an interrupted run leaves: the prefixes published (a meta written) before the signal, and
    how to go on."""
    from neva_pack.files import paths

    try:
        published = [prefix.name for prefix in paths.packed_prefixes(output_dir) if paths.meta_path(prefix).is_file()]
    except (OSError, NevaPackError):
        published = []
    if not published:
        return (f"nothing was published, committed work is kept in {output_dir}: run the same command with "
                "--resume to continue")  # fmt: skip
    were = "was" if len(published) == 1 else "were"
    return (f"{', '.join(published)} in {output_dir} {were} published before it (complete, verifiable); run the same "
            "command with --resume to finish what remains")  # fmt: skip


EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report Ctrl-C."""
EXIT_TERMINATED = 143
"""128 + SIGTERM."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import signal
    import threading

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return _interrupted(args, EXIT_INTERRUPTED)
    except Terminated:
        return _interrupted(args, EXIT_TERMINATED)
    except NevaPackError as error:
        if args.debug:
            raise
        print(f"neva-pack: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the environment failed us (disk full, permissions): one line, no traceback
        if args.debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        print(f"neva-pack: error: {where}{error.strerror or error}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
