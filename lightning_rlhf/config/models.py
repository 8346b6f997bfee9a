"""Model settings: a local folder, a hub id, or an embedded model's name, resolved to what ``from_pretrained`` loads.

Every model setting (``actor``, ``critic``, ``reference``, a reward model, a tokenizer) goes through
:func:`resolve_model_path` before anything loads, so a bad value fails at once, naming the setting. What each kind
of name means, and the embedded models (:data:`EMBEDDED_MODELS`), are in docs/training-script.md ("Choose the model").
"""

from __future__ import annotations

import difflib
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "EMBEDDED_MODELS",
    "EMBEDDED_PREFIX",
    "HUB_TIMEOUT_S",
    "embedded_cache_dir",
    "ensure_pad_token",
    "hub_reachable",
    "register_embedded_model",
    "resolve_model_path",
]

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "lightning-rlhf/"
"""Reserved prefix of the embedded models' names; a value starting with it is never looked up on the hub."""
HUB_TIMEOUT_S = 3.0
"""Seconds the hub has to answer one request before a model id that is not in the cache is refused."""
CACHE_ENV = "LIGHTNING_RLHF_CACHE"
"""Environment variable naming the cache folder of the embedded models (default ``~/.cache/lightning_rlhf``)."""


def embedded_cache_dir() -> str:
    """The folder where embedded models are built and cached: ``$LIGHTNING_RLHF_CACHE`` or
    ``~/.cache/lightning_rlhf``. Runs on: any process."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "lightning_rlhf")


_PROVIDERS = ("lightning_rlhf.demo.catalogue",)
"""Modules that register embedded models (:func:`register_embedded_model`) when imported."""

_Entry = tuple[Callable[[str], str], str]


class _EmbeddedModels(Mapping[str, _Entry]):
    """Embedded models by name, ``(build(cache_dir) -> folder, description)``; ``_PROVIDERS`` fill it at first read."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}

    def _entries(self) -> dict[str, _Entry]:
        for module in _PROVIDERS:  # registers its models when first imported (later: a lookup in sys.modules)
            importlib.import_module(module)
        return self.entries

    def __getitem__(self, name: str) -> _Entry:
        return self._entries()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


EMBEDDED_MODELS = _EmbeddedModels()
"""Embedded models by name: ``(build(cache_dir) -> folder, description)``, built on first use into
:func:`embedded_cache_dir` (shared by concurrent processes). The first read imports the modules that register them."""


def register_embedded_model(name: str, build: Callable[[str], str], description: str) -> None:
    """Serve ``name`` (under :data:`EMBEDDED_PREFIX`) as an embedded model that ``build(cache_dir)`` makes. Runs on:
    any process (at import of a module that provides embedded models, e.g. the demo's ``catalogue``).

    Raises:
        ValueError: when ``name`` does not start with :data:`EMBEDDED_PREFIX`.
    """
    if not name.startswith(EMBEDDED_PREFIX):
        raise ValueError(
            f"register_embedded_model(name={name!r}): an embedded model's name must start with {EMBEDDED_PREFIX!r}. "
            f"HINT: name={EMBEDDED_PREFIX + name.rsplit('/', 1)[-1]!r}."
        )
    EMBEDDED_MODELS.entries[name] = (build, description)


@functools.lru_cache(maxsize=4)
def hub_reachable(endpoint: str | None = None, timeout_s: float = HUB_TIMEOUT_S) -> bool:
    """Whether the hub at ``endpoint`` (default ``huggingface_hub``'s: ``HF_ENDPOINT``, else huggingface.co) answers one
    HEAD request within ``timeout_s`` seconds, even with an error status (asked once per process). Runs on: any."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    url = endpoint or constants.ENDPOINT
    try:
        get_session().head(url, timeout=timeout_s)
    except Exception as err:  # DNS failure, refused connection, timeout, proxy error: all mean "cannot reach"
        log.debug("hub %s not reachable: %s", url, err)
        return False
    return True


def _hub_offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return bool(constants.HF_HUB_OFFLINE) or value in {"1", "ON", "YES", "TRUE"}


def _in_hub_cache(repo_id: str, filenames: tuple[str, ...]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for filename in filenames:
        try:
            found = try_to_load_from_cache(repo_id, filename)
        except Exception:  # not a valid repo id
            return False
        if isinstance(found, str):
            return True
    return False


def _resolve_embedded(name: str, *, setting: str) -> str:
    entry = EMBEDDED_MODELS.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(EMBEDDED_MODELS), n=1)
        suggestion = f" Did you mean {close[0]!r}?" if close else ""
        listing = ", ".join(f"{n!r} ({desc})" for n, (_, desc) in EMBEDDED_MODELS.items())
        raise ValueError(
            f"{setting}={name!r}: names no embedded model ({EMBEDDED_PREFIX!r} is reserved for them).{suggestion} "
            f"HINT: use one of {listing}, or a local folder or hub id."
        )
    build, _ = entry
    return build(embedded_cache_dir())


def resolve_model_path(path: str, *, setting: str, tokenizer_only: bool = False) -> str:
    """Turns a model setting's value into what ``from_pretrained`` loads, or fails at once naming the setting.

    Runs on: any process, before models load (builds an embedded model on first use; reads no weights). ``path``:
    a local folder, an embedded name (:data:`EMBEDDED_MODELS`) or a hub id; ``setting`` names it in errors
    (``"RLHFModule(actor=...)"``); with ``tokenizer_only`` a folder needs a tokenizer file, not ``config.json``.
    Returns a local folder, or the hub id when it is in the local cache or the hub answers.

    Raises:
        FileNotFoundError: A folder that does not exist or holds no model/tokenizer; a hub id that is not in the
            cache while the hub is offline (``HF_HUB_OFFLINE``) or unreachable; a hub id the hub does not know.
        ValueError: An unknown name under the reserved prefix ``lightning-rlhf/``.
    """
    if not isinstance(path, str) or not path:
        raise TypeError(f"{setting}={path!r}: expected a model folder, hub id or embedded name (a non-empty string).")
    if path.startswith(EMBEDDED_PREFIX):
        return _resolve_embedded(path, setting=setting)
    local = os.path.expanduser(path)
    wanted = ("tokenizer.json", "tokenizer_config.json", "config.json") if tokenizer_only else ("config.json",)
    if os.path.isdir(local):
        if not any(os.path.isfile(os.path.join(local, name)) for name in wanted):
            raise FileNotFoundError(
                f"{setting}={path!r}: the folder has no {' or '.join(wanted)}. HINT: point it at a folder written by "
                "`save_pretrained` (config.json + weights + tokenizer files)."
            )
        return local
    looks_local = path.startswith((".", "/", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path)
    if looks_local:
        raise FileNotFoundError(
            f"{setting}={path!r}: no such folder. HINT: check the path (relative paths start from the current "
            f"folder, {os.getcwd()!r}), or pass a hub id or an embedded name such as 'lightning-rlhf/tiny-addition'."
        )
    if _in_hub_cache(path, wanted):
        return path
    names = ", ".join(repr(n) for n in EMBEDDED_MODELS)
    if _hub_offline():
        raise FileNotFoundError(
            f"{setting}={path!r}: not a local folder, and not in the hub cache while HF_HUB_OFFLINE is set. "
            f"HINT: download it beforehand on a machine with access (`hf download {path}`), pass a local folder, "
            f"or use an embedded model ({names})."
        )
    from huggingface_hub import constants

    if not hub_reachable(constants.ENDPOINT):
        raise FileNotFoundError(
            f"{setting}={path!r}: not a local folder, not in the hub cache ({constants.HF_HUB_CACHE}), and the hub "
            f"({constants.ENDPOINT}) did not answer within {HUB_TIMEOUT_S:g} s. HINT: check the name and the network, "
            f"download it beforehand (`hf download {path}`), pass a local folder, or use an embedded model ({names})."
        )
    from transformers import AutoConfig, AutoTokenizer

    try:
        (AutoTokenizer if tokenizer_only else AutoConfig).from_pretrained(path)
    except Exception as err:
        raise FileNotFoundError(
            f"{setting}={path!r}: not a local folder, and the hub could not load it ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). HINT: check the hub id (and access to gated models: "
            "`hf auth login`), or pass a local folder."
        ) from None
    return path


def ensure_pad_token(tokenizer: Any, *, source: str) -> None:
    """Gives a tokenizer without a pad token its end-of-sequence token for padding, with a warning saying so.

    Padded positions are masked out everywhere, so the token changes no result; the choice is logged, naming
    ``source`` (the folder or hub id), because it is made for the user. Runs on: any process (every rank logs it).

    Raises:
        ValueError: The tokenizer has neither a pad token nor an end-of-sequence token.
    """
    if tokenizer.pad_token_id is not None:
        return
    if tokenizer.eos_token is None:
        raise ValueError(
            f"The tokenizer of {source!r} has neither a pad token nor an end-of-sequence token, so batches cannot be "
            "padded. HINT: give it one before training (`tokenizer.add_special_tokens({'pad_token': ...})` and "
            "`save_pretrained`), or pass RLHFModule(tokenizer=<a folder whose tokenizer has one>)."
        )
    tokenizer.pad_token = tokenizer.eos_token
    log.warning(
        "The tokenizer of %r has no pad token: padding with its end-of-sequence token %r (id %d). Padded positions "
        "are masked, so this changes no result. To choose another, set `pad_token` in the tokenizer's folder.",
        source,
        tokenizer.eos_token,
        tokenizer.pad_token_id,
    )
