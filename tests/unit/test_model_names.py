"""Model settings resolve in one place: local folders, embedded names (``lightning-rlhf/...``) and hub ids, with
an immediate error (no retries) for a hub id that is not cached while the hub cannot be reached."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from lightning_rlhf import GRPOModule
from lightning_rlhf.config.models import EMBEDDED_MODELS, hub_reachable, resolve_model_path
from lightning_rlhf.demo import addition_reward, prepare_demo_model
from lightning_rlhf.demo.families import FAMILIES
from tests.conftest import failure_text, run_cli

CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, so a connection is refused at once


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The hub at an address that refuses connections, an empty hub cache, HF_HUB_OFFLINE unset."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub_reachable.cache_clear()
    yield cache
    hub_reachable.cache_clear()


@pytest.fixture
def cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("LIGHTNING_RLHF_CACHE", str(tmp_path / "lr-cache"))
    return tmp_path / "lr-cache"


def test_unknown_hub_id_fails_at_once_when_the_hub_cannot_be_reached(
    no_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request to the hub, then the error: no retries (transformers' own took about 30 s here). Counted, not
    timed, so that a busy machine cannot fail it."""
    from huggingface_hub.utils import get_session

    client = type(get_session())  # every request of huggingface_hub's HTTP client goes through its send()
    sent: list[str] = []
    real_send = client.send

    def counting_send(self: object, request: object, *args: object, **kwargs: object) -> object:
        sent.append(f"{request.method} {request.url}")  # type: ignore[attr-defined]
        return real_send(self, request, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(client, "send", counting_send)
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("someone/made-up-model", setting="RLHFModule(actor=...)")
    assert sent == [f"HEAD {CLOSED}"], sent
    message = str(err.value)
    assert message.startswith("RLHFModule(actor=...)='someone/made-up-model': not a local folder, not in the hub cache")
    assert f"the hub ({CLOSED}) did not answer" in message and "HINT:" in message
    assert "lightning-rlhf/tiny-addition" in message  # the fix offered: an embedded model, among others


def test_hf_hub_offline_is_honoured_without_asking_the_hub(no_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"critic=\.\.\.\)='org/model': .* while HF_HUB_OFFLINE is set"):
        resolve_model_path("org/model", setting="RLHFModule(critic=...)")
    assert hub_reachable.cache_info().currsize == 0  # the hub was never asked


def test_a_cached_hub_id_is_used_without_the_hub(no_hub: Path, tiny_model: str) -> None:
    snapshot = no_hub / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snapshot)
    (no_hub / "models--org--tiny" / "refs").mkdir()
    (no_hub / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    assert resolve_model_path("org/tiny", setting="RLHFModule(actor=...)") == "org/tiny"
    assert hub_reachable.cache_info().currsize == 0


def test_local_folders(tmp_path: Path, tiny_model: str) -> None:
    assert resolve_model_path(tiny_model, setting="s") == tiny_model
    with pytest.raises(FileNotFoundError, match=r"s='\./no/model': no such folder\. HINT: check the path"):
        resolve_model_path("./no/model", setting="s")
    tok_only = tmp_path / "tok"
    tok_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_model, name), tok_only / name)
    assert resolve_model_path(str(tok_only), setting="s", tokenizer_only=True) == str(tok_only)
    with pytest.raises(FileNotFoundError, match=r"the folder has no config\.json"):
        resolve_model_path(str(tok_only), setting="s")


def test_embedded_names_build_once_and_resolve_to_the_cached_folder(cache_dir: Path) -> None:
    families = {f"lightning-rlhf/random-{name}" for name in FAMILIES}  # built at a real size: by the real-size run
    assert set(EMBEDDED_MODELS) == {
        "lightning-rlhf/tiny-addition",
        "lightning-rlhf/tiny-random",
        "lightning-rlhf/tiny-tools",
        "lightning-rlhf/tiny-vision",
        *families,
    }  # the tool model (a minute of warm start) is built by the tool task's tests, the vision model by docs/vision.md's
    path = resolve_model_path("lightning-rlhf/tiny-addition", setting="s")
    assert path == prepare_demo_model(str(cache_dir)) and os.path.isfile(os.path.join(path, "config.json"))
    random_path = resolve_model_path("lightning-rlhf/tiny-random", setting="s")
    assert random_path.startswith(str(cache_dir)) and random_path != path
    assert resolve_model_path("lightning-rlhf/tiny-random", setting="s") == random_path  # cached
    assert not [n for n in os.listdir(cache_dir) if n.startswith(".")]  # no temporary folder left
    with pytest.raises(ValueError, match=r"s='lightning-rlhf/tiny-adition': names no embedded model .* Did you mean "):
        resolve_model_path("lightning-rlhf/tiny-adition", setting="s")


def test_module_takes_an_embedded_name(cache_dir: Path) -> None:
    module = GRPOModule("lightning-rlhf/tiny-addition", reward=addition_reward, reference=True)
    folder = prepare_demo_model(str(cache_dir))
    assert module.actor.path == folder and module.reference is not None and module.reference.path == folder
    assert module.tokenizer.name_or_path == folder
    ids = module.tokenizer("Which is larger, 41 or 19? Answer:")["input_ids"]
    assert module.tokenizer.decode(ids, skip_special_tokens=True) == "Which is larger, 41 or 19? Answer:"


def test_missing_pad_token_falls_back_to_eos_with_a_warning(
    tmp_path: Path, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "nopad"
    shutil.copytree(tiny_model, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["pad_token"] = None
    config_file.write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="lightning_rlhf.config.models"):
        module = GRPOModule(str(folder), reward=addition_reward)
    assert module.tokenizer.pad_token == "</s>" and module.tokenizer.pad_token_id == module.tokenizer.eos_token_id
    (record,) = [r for r in caplog.records if "no pad token" in r.getMessage()]
    assert str(folder) in record.getMessage() and "'</s>' (id 2)" in record.getMessage()


def test_command_line_fails_fast_on_an_unreachable_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)  # read by huggingface_hub when the CLI's process imports it
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    proc = run_cli("fit", "--config", "recipes/demo.yaml", "--model.actor", "someone/made-up-model", timeout=120)
    assert proc.returncode != 0, failure_text(proc)
    assert "RLHFModule(actor=...)='someone/made-up-model'" in proc.stderr and "did not answer" in proc.stderr
    assert "Retrying" not in proc.stderr


def test_embedded_models_cached_by_an_older_version_are_not_reused(cache_dir: Path, tiny_model: str) -> None:
    """A cache written before the chat template and the 256 positions (issue 31) is not what the names resolve
    to: the folder names carry the cache version, so the new models are built beside the old ones."""
    from transformers import AutoConfig, AutoTokenizer

    from lightning_rlhf.demo.warmstart import CACHE_VERSION

    old = cache_dir / "tiny-random-v3-seed0"  # what the previous version cached: 64 positions, no template
    shutil.copytree(tiny_model, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    (old / "chat_template.jinja").unlink()
    assert CACHE_VERSION != "v3"
    folder = resolve_model_path("lightning-rlhf/tiny-random", setting="s")
    assert os.path.basename(folder) == f"tiny-random-{CACHE_VERSION}-seed0"
    assert AutoConfig.from_pretrained(folder).max_position_embeddings == 256
    assert AutoTokenizer.from_pretrained(folder).chat_template is not None
