"""``lightning-rlhf`` (or ``python -m lightning_rlhf.cli``): the command line, docs/cli.md. LightningCLI over any
RLHFModule and PromptDataModule (``fit``, ``validate``), plus ``export``, ``sft`` and ``plan``.

The strategy defaults to ``RLHFStrategy``, metrics are logged every step, and ``ExportActor`` writes the actor to
``<run folder>/actor`` when ``fit`` ends. A key that no class takes fails before any model loads, with the
closest valid name."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
import warnings
from typing import Any, NoReturn

import torch
from jsonargparse import ActionYesNo, ArgumentParser, Namespace
from jsonargparse.typing import get_registered_type, register_type
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_rlhf.callbacks.export import ExportActor
from lightning_rlhf.callbacks.progress import RLHFProgressBar
from lightning_rlhf.checkpoint.export import best_checkpoint, export_checkpoint
from lightning_rlhf.config.settings import flat_names
from lightning_rlhf.data import PromptDataModule, SFTDataModule
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.sft import SFTModule
from lightning_rlhf.strategy.checkpoint_io import check_resume_path

__all__ = [
    "RLHFCLI",
    "SFTCLI",
    "TRAINER_DEFAULTS",
    "RLHFArgumentParser",
    "export_parser",
    "main",
    "setting_names",
    "unknown_key_message",
]

TRAINER_DEFAULTS: dict[str, Any] = {
    "strategy": {"class_path": "lightning_rlhf.RLHFStrategy"},  # recipes need not name it
    "log_every_n_steps": 1,  # an RL step takes seconds to minutes: log each one (Lightning's default is 50)
}
"""Trainer arguments whose defaults differ from Lightning's."""

_CALLABLE_ARGS = ("reward", "cost")  # module arguments that take a function (import path) or a model path


def _parse_dtype(value: str) -> torch.dtype:
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype (e.g. bfloat16, float16, float32).")
    return dtype


if get_registered_type(torch.dtype) is None:  # `param_dtype: bfloat16` in a recipe
    register_type(torch.dtype, serializer=lambda d: str(d).removeprefix("torch."), deserializer=_parse_dtype)


_UNKNOWN_KEY = re.compile(
    r"Option '(?P<a>[^']+)' is not accepted"
    r"|does not accept option '(?P<b>[^']+)'"
    r"|unrecognized arguments: --?(?P<c>[^\s=]+)"
    r"|No action for key \"(?P<d>[^\"]+)\""
)
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
_PARSER_KEY = re.compile(r"Parser key \"([^\"]+)\"")


def setting_names(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` to the parent classes (as jsonargparse
    does), e.g. ``GRPOModule`` -> ``actor``, ``reward``, ``critic``, ...; a grouped config's settings by their
    nested path (``kl.coef``), not their deprecated flat names. Runs on: any process."""
    if flat := flat_names(cls):
        return [f.name for f in dataclasses.fields(cls)] + [f"{group}.{name}" for group, name in flat.values()]
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def unknown_key_message(message: str, parsers: list[ArgumentParser]) -> str | None:
    """Rewrite jsonargparse's error about a key no class takes into one line that names the key, its owner and the
    closest valid name (as :func:`lightning_rlhf.config.config_from_dict` does); None for other errors. Runs on: any
    process, while the command line is parsed (before anything is instantiated). ``parsers``: those whose keys are valid
    at the top level (the main one and its subcommands')."""
    found = _UNKNOWN_KEY.search(message)
    if found is None:
        return None
    key = next(v for v in found.groups() if v)
    before = message[: found.start()]
    owners = _CLASS_PATH.findall(before)
    path = [k for k in _PARSER_KEY.findall(before) if k not in ("init_args", "dict_kwargs")]
    full = ".".join([*path, key])
    if owners:  # a class's argument, e.g. model.init_args.rollout.max_new_token -> RolloutConfig
        module_name, _, class_name = owners[-1].rpartition(".")
        try:
            owner: Any = getattr(importlib.import_module(module_name), class_name)
            valid = setting_names(owner)
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        head, _, rest = key.partition(".")
        close = difflib.get_close_matches(head, valid, n=1)
        what = f": {class_name} has no setting '{head}'."
        suggestion = ".".join([*path, close[0], *([rest] if rest else [])]) if close else None
    else:  # a top-level key, e.g. trainer.max_step
        valid = sorted({a.dest for p in parsers for a in p._actions if a.dest not in ("help", "==SUPPRESS==")})
        close = difflib.get_close_matches(key, valid, n=1)
        what = "."
        suggestion = close[0] if close else None
    hint = f" Did you mean '{suggestion}'?" if suggestion else f" Valid keys: {', '.join(valid)}."
    return (
        f"unknown key '{full}'{what}{hint} HINT: `lightning-rlhf fit --config ... --print_config` shows every "
        "key with its value."
    )


class RLHFArgumentParser(LightningArgumentParser):
    """LightningCLI's parser whose unknown-key errors name the closest valid key. Runs on: every process (each
    rank parses the same command line)."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Report ``message``, made concise: unknown keys with the closest valid name, type mismatches as their
        innermost reason. Runs on: every process, while the command line is parsed."""
        if not self.exit_on_error:  # a nested parser (a class's arguments): the outermost one rewrites the message
            super().error(message, ex)
        parsers: list[ArgumentParser] = [self]
        subcommands = getattr(self, "_subcommands_action", None)
        if subcommands is not None:
            parsers += list(getattr(subcommands, "_name_parser_map", {}).values())
        reason = _innermost_reason(message)
        path = ".".join(k for k in _PARSER_KEY.findall(message) if k not in ("init_args", "dict_kwargs"))
        concise = f"{path}: {reason}" if reason and path else reason
        super().error(unknown_key_message(message, parsers) or concise or message, ex)


class RLHFCLI(LightningCLI):
    """``LightningCLI`` for lightning_rlhf: any RLHFModule subclass as ``model`` (by ``class_path``), any
    PromptDataModule as ``data``, ``RLHFStrategy`` by default, ``ExportActor`` always added. Runs on: every process
    (Lightning re-runs the command line for the other ranks). ``args``: the arguments (without the program name; None
    reads ``sys.argv``); ``run=False`` only instantiates (``cli.model``, ``cli.datamodule``, ``cli.trainer``)."""

    def __init__(self, args: list[str] | None = None, *, run: bool = True) -> None:
        no_abbrev = {"allow_abbrev": False}  # `--trainer.max_step` must not silently mean max_steps
        parser_kwargs = {**no_abbrev, **{name: dict(no_abbrev) for name in self.subcommands()}}
        argv = sys.argv[1:] if args is None else args
        # A resume writes into its run's folder (the recipes' fixed `version: ""`): its config.yaml is replaced.
        resume = any(a == "--ckpt_path" or a.startswith("--ckpt_path=") for a in argv)
        kwargs = {**_cli_kwargs(parser_kwargs), **({"save_config_kwargs": {"overwrite": True}} if resume else {})}
        super().__init__(RLHFModule, PromptDataModule, **kwargs, args=args, run=run)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` (``test``/``predict`` have no RLHF meaning)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate")}

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """LightningCLI's parser, with ``export`` listed among the subcommands (``main`` runs it)."""
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        subcommands = getattr(self.parser, "_subcommands_action", None)
        if add_subcommands and subcommands is not None:
            subcommands.add_subcommand("export", export_parser(), help=_first_line(export_checkpoint.__doc__))
            listing = ArgumentParser(prog="lightning-rlhf sft", description=_first_line(SFTCLI.__doc__))
            subcommands.add_subcommand("sft", listing, help=_first_line(SFTCLI.__doc__))  # `main` runs it

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``export_actor.*``: the settings of the always-present :class:`ExportActor` callback."""
        parser.add_lightning_class_args(ExportActor, "export_actor")

    @override
    def instantiate_classes(self) -> None:
        """Instantiate; a settings error (a config's ``__post_init__``, a strategy argument) that jsonargparse
        wrapped in its type-matching report is shown as the original one-line message."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            reason = _innermost_reason(str(err))
            if reason is None:
                raise
            self.parser.error(reason)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with :class:`~lightning_rlhf.callbacks.RLHFProgressBar` (steps out of the run's steps)
        unless the config lists a progress bar or sets ``enable_progress_bar: false``: Lightning's default bars
        count epochs, which read ``Epoch 37/-2`` in a ``max_steps`` run."""
        config = self.config_init.get(str(self.subcommand), self.config_init).get("trainer") or {}
        listed = config.get("callbacks") or []
        listed = listed if isinstance(listed, list) else [listed]
        wants_bar = config.get("enable_progress_bar") is not False
        if wants_bar and "callbacks" not in kwargs and not any(isinstance(c, ProgressBar) for c in listed):
            kwargs["callbacks"] = [*listed, RLHFProgressBar()]
        return super().instantiate_trainer(**kwargs)

    @override
    def before_instantiate_classes(self) -> None:
        """Fail on a reward given as an import path that does not import, or a ``ckpt_path`` that is missing or
        incomplete, before anything loads."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        try:
            check_resume_path(config.get("ckpt_path"))
        except (FileNotFoundError, ValueError) as err:
            self.parser.error(str(err))
        init_args = config.get("model", Namespace()).get("init_args") or Namespace()
        for name in _CALLABLE_ARGS:
            value = init_args.get(name)
            named = dict(value) if isinstance(value, dict | Namespace) else {"": value}  # {name: fn} rewards too
            for part, item in named.items():
                problem = _import_problem(item) if isinstance(item, str) else None
                if problem:
                    key = f"model.init_args.{name}" + (f".{part}" if part else "")
                    self.parser.error(
                        f"{key}={item!r} is neither a local model folder nor an importable function ({problem}). "
                        "HINT: give the function as `package.module.function`, importable from the current folder "
                        "or an installed package."
                    )


class SFTCLI(RLHFCLI):
    """Supervised fine-tuning with SFTModule and SFTDataModule, e.g. a warm start before RL.

    ``lightning-rlhf sft --config recipes/sft_demo.yaml [--ckpt_path CKPT] [--key value ...]``: the same recipe format
    and defaults as ``fit`` (``RLHFStrategy``, ``ExportActor`` writing ``<run folder>/actor``), with any SFTModule
    subclass as ``model`` and any SFTDataModule as ``data``; ``--ckpt_path`` resumes a run. Runs on: every process
    (Lightning re-runs the command line for the other ranks). ``args``: the arguments after ``sft`` (None reads
    ``sys.argv[2:]``); ``run=False`` only instantiates."""

    def __init__(self, args: list[str] | None = None, *, run: bool = True) -> None:
        argv, description = sys.argv[2:] if args is None else args, _first_line(SFTCLI.__doc__)
        parser_kwargs = {"allow_abbrev": False, "prog": "lightning-rlhf sft", "description": description}
        with warnings.catch_warnings():  # the args are sys.argv minus `sft`, on purpose
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            # One command, no subcommand: `fit` is called below.
            LightningCLI.__init__(self, SFTModule, SFTDataModule, **_cli_kwargs(parser_kwargs), args=argv, run=False)
        if run:
            self.trainer.fit(self.model, datamodule=self.datamodule, ckpt_path=self.config.get("ckpt_path"))

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``export_actor.*`` (as for ``fit``) and ``--ckpt_path`` (resume from a checkpoint)."""
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--ckpt_path", type=str | None, default=None, help="resume from this checkpoint (Trainer.fit's ckpt_path)"
        )


_UNION_REPORT = "Does not validate against any of the Union subtypes"
_STRUCTURE = ("Parser key", _UNION_REPORT, "Subtypes:", "Errors:", "Given value", "Problem with given class_path")


def _innermost_reason(message: str) -> str | None:
    """The last specific reason in jsonargparse's nested type-matching report (e.g. ``AlgorithmConfig.advantage=
    'nope' is invalid: ...``), skipping its structure and the "not None either" lines; None for other messages."""
    if _UNION_REPORT not in message:
        return None
    reasons = []
    for line in message.splitlines():
        text = line.strip().removeprefix("- ")
        if text and not text.startswith(_STRUCTURE) and not re.fullmatch(r"Expected a <class '[^']+'>", text):
            reasons.append(text)
    return reasons[-1] if reasons else None


def _import_problem(value: str) -> str | None:
    """Why ``value``, a dotted name that is not a path, does not import (None: it imports or is no import path)."""
    if os.path.exists(value) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value):
        return None  # a folder, or a hub id ("org/name"): a model path
    module_name, _, attr = value.rpartition(".")
    try:
        getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _cli_kwargs(parser_kwargs: dict[str, Any]) -> dict[str, Any]:
    """LightningCLI's arguments that ``fit`` and ``sft`` share."""
    return {
        "subclass_mode_model": True,
        "subclass_mode_data": True,
        "trainer_defaults": TRAINER_DEFAULTS,
        "parser_class": RLHFArgumentParser,
        "parser_kwargs": parser_kwargs,
        "auto_configure_optimizers": False,  # the roles own their optimizers (OptimConfig)
    }


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""


_EXPORT_FLAGS = {
    "best": "export the best checkpoint by the metric a ModelCheckpoint(monitor=...) watched, which CHECKPOINT "
    "(any checkpoint of the run, e.g. last.ckpt) names, instead of CHECKPOINT itself",
    "merge": "LoRA runs: write the merged model (a transformers folder vLLM loads) instead of the adapter folder "
    "(what peft.PeftModel.from_pretrained(base, OUT) loads); a full-weight run's folder is the same either way",
}
"""``export``'s yes/no options: flags (``--merge``; ``--no_merge``), ``--merge true``/``false`` still taken."""


def export_parser() -> ArgumentParser:
    """The parser of ``lightning-rlhf export CKPT OUT [--dtype D] [--base MODEL] [--best] [--merge]``, from
    :func:`~checkpoint.export.export_checkpoint`'s signature and docstring. Runs on: any process."""
    parser = ArgumentParser(
        prog="lightning-rlhf export", description=_first_line(export_checkpoint.__doc__), allow_abbrev=False
    )
    parser.add_function_arguments(export_checkpoint, as_positional=True, skip=set(_EXPORT_FLAGS))
    for name, help_text in _EXPORT_FLAGS.items():
        parser.add_argument(f"--{name}", action=ActionYesNo, default=False, help=help_text)
    return parser


def export_flags(argv: list[str]) -> list[str]:
    """``argv`` with ``--merge true``/``--merge false`` (the form the flags had before) as ``--merge``/
    ``--no_merge``, for :func:`export_parser`. Runs on: any process."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        out.append(word)
        if word.startswith("--") and word[2:] in _EXPORT_FLAGS and (value := next(words, None)) is not None:
            if value.lower() in ("true", "false"):
                out[-1] = word if value.lower() == "true" else f"--no_{word[2:]}"
            else:
                out.append(value)
    return out


def main(args: list[str] | None = None) -> None:
    """The ``lightning-rlhf`` console script: ``args`` without the program name (None reads ``sys.argv``). Runs on:
    every process: ``fit`` with several devices starts the other ranks by re-running this command line."""
    if os.getcwd() not in sys.path and "" not in sys.path:  # `reward: rewards.fn` next to the recipe, as `python -m`
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        parsed = export_parser().parse_args(export_flags(argv[1:]))
        checkpoint = parsed.checkpoint
        if parsed.best:  # ModelCheckpoint's best, named by the checkpoint given: say which one
            found = best_checkpoint(checkpoint)
            print(f"best checkpoint: {found.describe()}")
            checkpoint = found.path
        out = export_checkpoint(checkpoint, parsed.out, dtype=parsed.dtype, base=parsed.base, merge=parsed.merge)
        print(f"exported: {os.path.abspath(out)}")
        return
    if argv[:1] == ["plan"]:
        from lightning_rlhf.placement.cost_model import InfeasiblePlacementError
        from lightning_rlhf.placement.plan import main as plan_main

        try:
            plan_main(argv[1:])
        except InfeasiblePlacementError as err:
            raise SystemExit(f"lightning-rlhf plan: {err}") from None
        return
    if argv[:1] == ["sft"]:
        SFTCLI(argv[1:])
        return
    RLHFCLI(args)


if __name__ == "__main__":
    main()
