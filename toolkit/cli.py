"""The `toolkit` command: a table of typed entry functions turned into subcommands by jsonargparse.

`toolkit --help` imports nothing heavy: the table holds import paths, and only the chosen
subcommand's module is imported. Every subcommand takes `--config file.yaml` and dotted overrides.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from typing import Callable, Optional

from toolkit.errors import Preempted, UserError, closest, did_you_mean

# subcommand -> (module:function, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "pretrain": ("toolkit.pretrain:pretrain", "Pretrain a model from scratch on text or litdata streams."),
    "finetune_full": ("toolkit.finetune.full:finetune_full", "Fine-tune every weight of a checkpoint on instruction data."),
    "finetune_lora": ("toolkit.finetune.lora:finetune_lora", "Fine-tune LoRA adapters (QLoRA with --quantize) on instruction data."),
    "finetune": ("toolkit.finetune.lora:finetune_lora", "The same as finetune_lora."),
    "merge_lora": ("toolkit.finetune.lora:merge_lora", "Merge a LoRA adapter into its base model."),
    "generate": ("toolkit.generate:generate", "Sample text from a checkpoint."),
    "list": ("toolkit.cli:list_models", "List the model presets."),
    "convert_from_hf": ("toolkit.convert:convert_from_hf", "Convert a Hugging Face checkpoint to a toolkit checkpoint."),
    "convert_to_hf": ("toolkit.convert:convert_to_hf", "Export a toolkit checkpoint as a Hugging Face model directory."),
    "convert_pretrained_checkpoint": (
        "toolkit.convert:convert_pretrained_checkpoint",
        "Turn a training checkpoint (with optimizer state) into an inference checkpoint.",
    ),
    "download": ("toolkit.download:download", "Download a model from the Hugging Face Hub and convert it."),
    "estimate": ("toolkit.memory.estimator:estimate", "Estimate memory per device and recommend settings that fit."),
}


def list_models(hf: bool = False) -> None:
    """List the model presets, grouped by family.

    Args:
        hf: Also show the Hugging Face repository each preset mirrors.
    """
    from toolkit.models.presets import presets_by_family

    for number, (title, presets) in enumerate(presets_by_family().items()):
        print(("\n" if number else "") + title)
        for preset in presets:
            aliases = preset.get("aliases", [])
            line = "  " + preset["name"] + (f"  (alias: {', '.join(aliases)})" if aliases else "")
            if hf and preset.get("hf_repo_id"):
                line += f"  [{preset['hf_repo_id']}]"
            print(line)


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: toolkit <command> [--config FILE.yaml] [--option value ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run `toolkit <command> --help` for a command's options."]
    return "\n".join(lines)


def _load(target: str) -> Callable:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def _option_names(parser) -> list[str]:
    names = []
    for action in parser._actions:
        names.extend(s for s in action.option_strings if s.startswith("--"))
    return names


def build_parser(name: str, function: Callable, prog: Optional[str] = None):
    from jsonargparse import ActionConfigFile, ArgumentParser

    doc = (function.__doc__ or "").strip().split("\n\n")[0]
    parser = ArgumentParser(prog=prog or f"toolkit {name}", description=doc, exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file with any of the options below.")
    parser.add_function_arguments(function, as_positional=True)
    return parser


# The options that take no value: every other `--key` takes the next word, unless written `--key=value`.
_OPTIONS_WITHOUT_VALUE = ("-h", "--help", "--print_config")


def positional_after_config(argv: list[str]) -> list[str]:
    """`argv` with the positional arguments given before the last `--config FILE` (`toolkit
    finetune_lora CKPT --config recipe.yaml`, `toolkit finetune_lora --devices 2 CKPT --config ...`,
    `toolkit convert_from_hf IN OUT --config ...`) moved, in their order, just after it, so that they
    win over the files' values as they would given after them: jsonargparse lets a file override
    what comes before it, and a recipe names its own checkpoint. Options keep their places (before
    --config: overridden by the file; after: overriding it)."""
    end = None  # just after the last `--config FILE` (each file overrides what precedes it)
    for at, word in enumerate(argv):
        if word.startswith("--config="):
            end = at + 1
        elif word == "--config" and at + 1 < len(argv):  # (without its file: for the parser to explain)
            end = at + 2
    if end is None:
        return argv
    options, positionals, value_next = [], [], False
    for word in argv[:end]:
        if value_next:  # an option's value, whatever it looks like (`--seed -1`)
            options.append(word)
            value_next = False
        elif word.startswith("-") and len(word) > 1:
            options.append(word)
            value_next = "=" not in word and word not in _OPTIONS_WITHOUT_VALUE
        else:
            positionals.append(word)
    if not positionals:
        return argv
    return options + positionals + argv[end:]


def dict_options_merged(function: Callable, argv: list[str]) -> list[str]:
    """`argv` where a dictionary option given on the line (`--model_overrides '{n_layer: 4}'`) adds
    its keys to those of the same option in a `--config` file before it, instead of replacing them
    all, which is what jsonargparse does: a recipe's `model_overrides: {n_expert: 8, ...}` and
    `--model_overrides '{n_layer: 4}'` train 8 experts in 4 layers. Later keys win, in line order;
    `--option null` clears what came before. Where a file and the line both give the option, the
    merged value is given once, at the end; otherwise `argv` is left as it is. A file or a value
    that cannot be read is left for the parser to explain."""
    import json
    import typing

    import yaml

    try:
        hints = typing.get_type_hints(function)
    except Exception:
        return argv
    options = {"--" + name for name, hint in hints.items()
               if dict in (typing.get_origin(hint), *(typing.get_origin(a) or a for a in typing.get_args(hint)))}
    loader = _yaml_loader()
    for option in options:
        merged: Optional[dict] = None
        kept, on_the_line, in_a_file, value_next = [], False, False, None
        for at, word in enumerate(argv):
            name, equals, inline = word.partition("=")
            if value_next is not None:
                value_next, text = None, word
            elif name == option and equals:
                text = inline
            elif word == option and at + 1 < len(argv):
                value_next = word
                continue
            else:
                if name == "--config" and (equals or at + 1 < len(argv)):
                    try:
                        with open(inline if equals else argv[at + 1]) as f:
                            recipe = yaml.load(f, Loader=loader)
                    except (OSError, yaml.YAMLError):
                        return argv
                    if isinstance(recipe, dict) and option[2:] in recipe:
                        part = recipe[option[2:]]
                        if not (part is None or isinstance(part, dict)):
                            return argv
                        merged, in_a_file = (None if part is None else {**(merged or {}), **part}), True
                kept.append(word)
                continue
            try:
                part = yaml.load(text, Loader=loader)
            except yaml.YAMLError:
                return argv
            if not (part is None or isinstance(part, dict)):
                return argv
            merged, on_the_line = (None if part is None else {**(merged or {}), **part}), True
        if on_the_line and in_a_file:
            argv = kept + [option, "null" if merged is None else json.dumps(merged)]
    return argv


def _yaml_loader():
    """PyYAML's safe loader that also reads `1e-5` and `5e5` as numbers, as jsonargparse does (YAML
    1.1 wants a dot in a float)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def print_config_last(argv: list[str]) -> list[str]:
    """`argv` with `--print_config` (or `--print_config=FLAGS`) moved to its end: jsonargparse prints
    the configuration as soon as it reads a `--config` file given after it, so `--print_config
    --config recipe.yaml --seed 7` would show neither the seed nor a checkpoint given on the line."""
    flags = [word for word in argv if word == "--print_config" or word.startswith("--print_config=")]
    return [word for word in argv if word not in flags] + flags


def recipe_estimate_options(path: str) -> list[str]:
    """`toolkit estimate` options that describe a training recipe's step (`--recipe FILE`): its model,
    devices and nodes, micro-batch and sequence, precision, sharding, checkpointing, CPU offload,
    expert parallelism, adapters, quantized base and objective, as the run would plan them
    (`plan_run`); the start-up pre-flight's figure is this estimate's peak. The recipe's command is
    told by its keys: `model_name` pretrains, `lora` or `quantize` is finetune_lora, else
    finetune_full. A fine-tuning recipe's model is its checkpoint_dir where it exists, else the
    preset whose Hugging Face repo id ends that path (`checkpoints/Qwen/Qwen3-30B-A3B`)."""
    import json
    from pathlib import Path

    import yaml

    from toolkit.models.config import Config
    from toolkit.models.presets import find_preset
    from toolkit.parallel.plan import plan_run

    recipe = Path(path)
    try:
        raw = yaml.safe_load(recipe.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"--recipe {path}: cannot read it ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise UserError(f"--recipe {path}: not a recipe (a YAML mapping of a training command's options)")
    command = "pretrain" if "model_name" in raw else "finetune_lora" if {"lora", "quantize"} & set(raw) else "finetune_full"
    if command != "pretrain" and "checkpoint_dir" not in raw:
        raise UserError(f"--recipe {path}: names neither model_name (pretraining) nor checkpoint_dir (fine-tuning)")
    parser = build_parser(command, _load(COMMANDS[command][0]))
    try:
        args = parser.instantiate(parser.parse_args(["--config", str(recipe)]))
    except Exception as error:  # jsonargparse's errors, or a refusal of the recipe's values
        cause = _user_error_in(error)
        raise UserError(f"--recipe {path}: {cause or _condense(str(error))}") from None
    if command == "pretrain":
        overrides = args["model_overrides"] or {}
        model, config = args["model_name"], Config.from_name(args["model_name"], **overrides)
    else:
        overrides, checkpoint = {}, Path(args["checkpoint_dir"])
        if checkpoint.is_dir():
            model, config = str(checkpoint), Config.from_file(checkpoint)
        else:
            model = "/".join(checkpoint.parts[-2:])
            try:
                config = Config.from_name(find_preset(model)["name"])
            except UserError:
                raise UserError(f"--recipe {path}: checkpoint_dir {checkpoint} is not here and names no preset; "
                                "give the model first: toolkit estimate <model> --recipe ...") from None
    train = args["train"]
    plan = plan_run(args["devices"], args["num_nodes"], args["precision"], args["distributed"], train,
                    train.sequence_length(config), quantize=args.get("quantize"),
                    accelerator="cuda" if args["precision"] else "cpu")
    strategy, batches = plan.strategy, plan.batches
    options = [model, "--devices", str(strategy.devices), "--num_nodes", str(strategy.num_nodes),
               "--micro_batch_size", str(batches.micro_batch_size), "--max_seq_length", str(batches.max_seq_length),
               "--precision", strategy.precision,
               "--activation_checkpointing", str(strategy.activation_checkpointing).lower(),
               "--cpu_offload", str(strategy.cpu_offload).lower(), "--expert_parallel", str(strategy.expert_parallel)]
    if strategy.kind == "fsdp":
        options += ["--strategy", "fsdp", "--sharding", strategy.sharding]
    elif strategy.kind == "ddp":
        options += ["--strategy", "ddp"]
    if overrides:
        options += ["--model_overrides", json.dumps(overrides)]
    if command != "pretrain":
        options += ["--finetune", "lora" if command == "finetune_lora" else "full"]
    if command == "finetune_lora":
        lora = args["lora"]
        options += ["--lora_r", str(lora.r), "--lora_targets", "[" + ",".join(lora.targets) + "]",
                    "--lora_dropout", str(lora.dropout)]
        if plan.quantize:
            options += ["--quantize", plan.quantize]
    objective = args.get("objective")
    name = type(objective).__name__.lower() if objective is not None else "sft"
    if name in ("dpo", "ipo", "simpo", "orpo"):
        options += ["--objective", name]
        if getattr(objective, "precompute_reference", False):
            options += ["--precompute_reference", "true"]
    return options


def _with_recipe(argv: list[str]) -> list[str]:
    """`toolkit estimate` arguments with `--recipe FILE` replaced by the recipe's options
    (`recipe_estimate_options`), which the other arguments given override; a model given first
    replaces the recipe's."""
    for at, word in enumerate(argv):
        if word == "--recipe" or word.startswith("--recipe="):
            path = word.partition("=")[2] if "=" in word else (argv[at + 1] if at + 1 < len(argv) else "")
            if not path:
                raise UserError("--recipe needs a file: toolkit estimate --recipe config_hub/finetune/<model>/<recipe>.yaml")
            rest = argv[:at] + argv[at + (1 if "=" in word else 2):]
            model, *options = recipe_estimate_options(path)
            if rest and not rest[0].startswith("-"):  # a model given first
                return rest[:1] + options + rest[1:]
            return [model, *options, *rest]
    return argv


def class_names_in_their_case(function: Callable, argv: list[str]) -> list[str]:
    """`argv` with each class chosen by name on the command line (`--data alpaca`, `--objective dpo`)
    spelt as the class is (Alpaca, DPO): a name may be written in any case. A name that is not one
    of the option's classes, or that two of them share in some case, is left as it was (for
    jsonargparse to explain)."""
    spellings = _class_spellings(function)
    out = []
    for i, word in enumerate(argv):
        option, equals, value = word.partition("=")
        if equals and option in spellings:
            word = option + "=" + spellings[option].get(value.lower(), value)
        elif i and argv[i - 1] in spellings and not word.startswith("-"):
            word = spellings[argv[i - 1]].get(word.lower(), word)
        out.append(word)
    return out


def _class_spellings(function: Callable) -> dict[str, dict[str, str]]:
    """For each option of `function` that takes a class by name (`--data`, `--objective`): the
    lower-case name of each of its concrete classes -> the class's own spelling."""
    import inspect
    import typing

    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that cannot be resolved here: jsonargparse will say so
        return {}
    spellings: dict[str, dict[str, str]] = {}
    for name, hint in hints.items():
        for cls in typing.get_args(hint) or (hint,):
            if not inspect.isclass(cls) or not cls.__subclasses__():
                continue
            classes, todo = [], [cls]
            while todo:
                current = todo.pop()
                classes.append(current)
                todo.extend(current.__subclasses__())
            names: dict[str, set[str]] = {}
            for c in classes:
                if not inspect.isabstract(c):
                    names.setdefault(c.__name__.lower(), set()).add(c.__name__)
            spellings[f"--{name}"] = {lower: found.pop() for lower, found in names.items() if len(found) == 1}
            spellings[f"--{name}.help"] = spellings[f"--{name}"]
    return spellings


def _explain_parse_error(parser, argv: list[str], error: Exception, function: Optional[Callable] = None) -> str:
    """One line: what was wrong; for a misspelled option, that option and the closest valid names;
    for an unknown class name (`--objective dpoo`), the classes the option takes."""
    message = str(error)
    see = f"See `{parser.prog} --help`."
    unknown_class = re.search(r'Parser key "(\w+)":.*?Expected a dot import path string: (\S+)', message, re.DOTALL)
    if unknown_class and function is not None:
        option, given = f"--{unknown_class.group(1)}", unknown_class.group(2)
        spelt = _class_spellings(function).get(option, {})  # lower-case name -> class name
        if spelt:
            near = [spelt[name] for name in closest(given.lower(), sorted(spelt))]
            hint = f" Did you mean: {', '.join(near)}?" if near else ""
            return f"Unknown {option} {given!r}; choose one of: {', '.join(sorted(spelt.values()))} (any case).{hint} {see}"
    # A misspelled option of a dataclass group or of the command: "unrecognized arguments: --a 1 --b".
    unrecognized = re.match(r"unrecognized arguments: (.*)", message.strip(), re.DOTALL)
    if unrecognized:
        unknown = [word.split("=", 1)[0] for word in unrecognized.group(1).split() if word.startswith("--")]
        if unknown:
            option = unknown[0]
            return f"Unknown option {option}.{did_you_mean(option, _option_names(parser))} {see}"
    # A misspelled option of a class chosen on the command line (--data TextFiles --data.x).
    rejected = re.search(
        r'Parser key "([\w.]+)".*?class_path \'([\w.]+)\':\s*Option \'(\w+)\' is not accepted', message, re.DOTALL
    )
    if rejected:
        key, class_path, field = rejected.groups()
        option = f"--{key}.{field}"
        cls = _import_class(class_path)
        if cls is not None and cls.__subclasses__():  # the option came before `--key <class>`
            choices = ", ".join(sub.__name__ for sub in cls.__subclasses__())
            return f"{option} needs its class first: pass --{key} <{choices}> before it. {see}"
        fields = [f"--{key}.{name}" for name in _init_parameters(cls)]
        owner = f" for {class_path.rsplit('.', 1)[-1]}"
        return f"Unknown option {option}{owner}.{did_you_mean(option, fields)} {see}"
    # nan and inf parse as Python floats but no setting takes them: jsonargparse refuses them as
    # "Expected a <class 'float'>", which reads as if they were not numbers at all.
    not_finite = re.search(r'Parser key "([\w.]+)":.*Expected a <class \'float\'>', message, re.DOTALL)
    if not_finite:
        option = f"--{not_finite.group(1)}"
        given = _value_given(argv, option)
        if given is not None and given.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
            return f"{option} must be a finite number, got {given}. {see}"
    return f"{_condense(message) or type(error).__name__} {see}"


def _value_given(argv: list[str], option: str) -> Optional[str]:
    """The value `option` was given on the command line (its last occurrence), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(option + "="):
            value = word[len(option) + 1:]
    return value


def _user_error_in(error: BaseException) -> Optional[UserError]:
    """The UserError that `error` is, or that caused it (jsonargparse wraps what a dataclass raises)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _import_class(path: str):
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_parameters(cls) -> list[str]:
    import inspect

    if cls is None:
        return []
    return [name for name in inspect.signature(cls).parameters if not name.startswith("_")]


_NOISE = ("Subtypes:", "Given value", "Errors:", "Does not validate against any", "- Expected a <class 'NoneType'>")


def _condense(message: str) -> str:
    """jsonargparse explains a bad value over many indented lines; keep the informative ones."""
    lines = [line.strip().lstrip("- ").strip() for line in message.strip().splitlines()]
    kept = [line for line in lines if line and not any(line.startswith(n.lstrip("- ")) for n in _NOISE)]
    return " ".join(kept)


def _show_toolkit_logs() -> None:
    """The toolkit's own INFO messages (data preparation, cache reuse) go to stderr as plain lines.

    Two of Lightning's INFO lines are dropped: "Seed set to N" (at every seeding) and "Using
    bfloat16 Automatic Mixed Precision", which the toolkit's start-up table already says.
    """
    logger = logging.getLogger("toolkit")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logging.getLogger("lightning_fabric.utilities.seed").setLevel(logging.WARNING)
    # peft imports torchao and bitsandbytes whenever they are installed and not left out
    # (`toolkit.process`: a LoRA run keeps out those its --quantize does not use); their
    # import-time warnings say nothing about what the run uses: torchao 0.18 "Failed to load
    # .../_C_cutlass_90a.abi3.so" (a Hopper GPU kernel), bitsandbytes 0.50.2 "Failed to load CPU
    # gemm_4bit_forward from kernels-community" (an optional package), and torch 2.13's pytree
    # notices that torchao registers Enum classes the old way. Their errors still show.
    for name in ("torchao", "bitsandbytes.backends.cpu.ops", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rank_zero = logging.getLogger("lightning_fabric.utilities.rank_zero")  # Fabric's rank-zero messages
    if not any(isinstance(f, _DropPrecisionNotice) for f in rank_zero.filters):
        rank_zero.addFilter(_DropPrecisionNotice())


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each message, not as it was when the handler was made
    (`run` is also called in-process, e.g. by tests that capture and then close stderr)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _DropPrecisionNotice:
    def filter(self, record) -> bool:
        return "Automatic Mixed Precision" not in record.getMessage()


def run(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from toolkit import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        matches = closest(name, COMMANDS)
        hint = f" Did you mean: {', '.join(matches)}?" if matches else ""
        _say(f"toolkit: error: unknown command {name!r}.{hint} Run `toolkit --help` for the list.")
        return 2
    if name == "estimate":
        try:
            rest = _with_recipe(rest)
        except UserError as error:
            _say(f"toolkit estimate: error: {error}")
            return 2
    return run_function(f"toolkit {name}", _load(COMMANDS[name][0]), rest)


def run_function(prog: str, function: Callable, argv: list[str]) -> int:
    """Parse `argv` against `function`'s typed signature and call it; the exit code.

    Every command goes through here, and so can an extension's own command (`python -m
    extensions.<name>`): `--config`, `--help` and one-line errors (prefixed with `prog`) work alike.
    """
    _show_toolkit_logs()
    parser = build_parser(prog, function, prog=prog)
    argv = print_config_last(positional_after_config(dict_options_merged(function, class_names_in_their_case(function, argv))))
    try:
        cfg = parser.parse_args(argv)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except Exception as error:  # jsonargparse's ArgumentError and friends
        cause = _user_error_in(error)
        _say(f"{prog}: error: {cause or _explain_parse_error(parser, argv, error, function)}")
        return 2
    try:
        init = parser.instantiate(cfg)
    except Exception as error:  # an argument class refused its values (jsonargparse wraps the UserError)
        cause = _user_error_in(error)
        if cause is None:
            raise
        _say(f"{prog}: error: {cause}")
        return 2
    try:
        function(**{k: v for k, v in init.items() if k != "config"})
    except UserError as error:
        _say(f"{prog}: error: {error}")
        # A UserError after the ranks started (bad data found by rank 0, a checkpoint that does not fit)
        # is raised between collectives, on every rank: release the group as a finished run does.
        # Not after Ctrl-C or a peer's failure, where a collective may still be under way.
        _release_process_group()
        return 1
    except KeyboardInterrupt:
        _say(f"{prog}: interrupted")
        return 130
    except Preempted as stopped:  # SIGTERM / SIGUSR1: the run saved what it could (toolkit.training.preemption)
        _say(f"{prog}: {stopped}")
        _release_process_group()
        return stopped.exit_code
    except Exception as error:
        if _interrupted(error):  # Ctrl-C, which a library raised as its own error
            _say(f"{prog}: interrupted")
            return 130
        failure = _peer_failure_line(error)
        if failure is None:
            raise
        _say(f"{prog}: error: {failure}")
        return 1
    except BaseException as error:  # torch's CheckpointException (a BaseException) holding Ctrl-C
        if isinstance(error, (SystemExit, GeneratorExit)) or not _interrupted(error):
            raise
        _say(f"{prog}: interrupted")
        return 130
    _release_process_group()
    return 0


def _interrupted(error: BaseException) -> bool:
    """Whether `error` came of Ctrl-C: raised from it, or met by this process after it received
    SIGINT (a peer that stopped on it fails this process's collective first)."""
    from toolkit.errors import caused_by_interrupt
    from toolkit.training.preemption import interrupt_received

    return caused_by_interrupt(error) or interrupt_received()


def _say(line: str) -> None:
    """Write `line` to stderr in one system call: the ranks of a run share one stderr, and
    `print`'s separate write of the newline lets their identical error lines run together."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stderr with no file behind it (captured by a test)
        sys.stderr.write(line + "\n")


def _release_process_group() -> None:
    if "torch.distributed" in sys.modules:  # a distributed run happened in this process
        from toolkit.training.failures import release_process_group

        release_process_group()


def _peer_failure_line(error: Exception) -> Optional[str]:
    """One line when `error` came from another process of a distributed run failing (else None)."""
    if "torch.distributed" not in sys.modules:  # no process group: not a distributed failure
        return None
    from toolkit.training.failures import explain_peer_failure

    return explain_peer_failure(error)


# Environment defaults of a toolkit process (a value the user set wins), read by libraries at first use.
ENVIRONMENT_DEFAULTS = {
    # Keep tokenizers' Rust thread pool from fighting with forked data workers.
    "TOKENIZERS_PARALLELISM": "false",
    # torch's oneDNN matrix products (bfloat16 on CPU) keep one primitive, with its memory, per shape,
    # up to 1024 of them: fine-tuning's varying lengths grew a pythia-14m LoRA run at bf16-mixed to
    # 2.15 GB of resident memory (1.39 GB with 16; no slower, benchmarks/README.md).
    "LRU_CACHE_CAPACITY": "16",
}


def set_environment_defaults(environ=os.environ) -> None:
    for name, value in ENVIRONMENT_DEFAULTS.items():
        environ.setdefault(name, value)


def main() -> None:
    from toolkit.process import runs_one_command

    set_environment_defaults()
    runs_one_command()
    try:
        code = run()
    except BrokenPipeError:  # the reader went away (`toolkit list | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    end_process(code)


def end_process(code: int) -> None:
    """Exit with `code`, without Python's teardown of every imported module.

    A toolkit process imports torch, Fabric and their libraries; tearing their thousands of modules
    down at exit costs 0.4-1 s of CPU in every rank of every command (`import torch, lightning_fabric`
    then exit: 0.6 s of teardown on this project's CPU), and nothing a finished command wrote depends
    on it. What an exit must do is done here, in the interpreter's order: threads still at work
    finish, the atexit handlers run (logging's flush, the libraries' own clean-up), the standard
    streams are flushed. It also leaves no communication thread to be destroyed mid-teardown.

    The threads end as the interpreter ends them (`threading._shutdown`): first the hooks that tell
    idle pools to stop, then the join. Joining first waited forever on the idle workers of the
    thread pool inductor compiles with, which only that hook stops: every compiled run that had
    compiled anything (a cold cache) hung after its work.
    """
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # CPython 3.8 to 3.13
    if shutdown is not None:
        shutdown()
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a stream already closed
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
