"""Vision-language prompts: the data module's image column, the processor's placeholders, both engines' log-probs
against the trainer's with images, and the bad inputs refused before training (docs/vision.md)."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.data.vision import VISION_COLUMN, collapse_image_tokens, expand_image_tokens
from lightning_rlhf.demo.tiny_vlm import IMAGE_PAD, save_tiny_vlm
from lightning_rlhf.demo.vision_task import count_reward, draw_squares, vision_dataset
from lightning_rlhf.engines.hybrid import rollout_params
from lightning_rlhf.engines.rollout.vllm import vllm_available
from lightning_rlhf.engines.train.vision import placeholder_ids, vision_kwargs
from tests.conftest import failure_text, run_script
from tests.scripts.vision_agreement import agreement, episode_agreement

AGREEMENT = 1e-5
"""The largest gap allowed between an engine's log-prob of a sampled token and the trainer's (float32)."""


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), seed=0)


def _data(path: str, train: datasets.Dataset, **kw: object) -> PromptDataModule:
    data = PromptDataModule(train, tokenizer=path, batch_size=4, max_prompt_length=128, **kw)  # type: ignore[arg-type]
    data.setup("fit")
    return data


def test_image_column_gives_expanded_placeholders_and_the_processors_inputs(vlm: str) -> None:
    data = _data(vlm, vision_dataset(8), image_column="image")
    batch = next(iter(data.train_dataloader()))
    image_id = data._tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert batch["prompts"].shape[0] == 4
    # one placeholder per merged patch: a 56 x 56 image is 4 x 4 patches, merged 2 x 2 into 4 tokens
    assert ((batch["prompts"] == image_id) & batch["prompt_mask"].bool()).sum(1).tolist() == [4, 4, 4, 4]
    vision = batch[VISION_COLUMN]
    assert [tuple(v.pixel_values.shape) for v in vision] == [(16, 1176)] * 4
    assert [v.image_grid_thw.tolist() for v in vision] == [[[1, 4, 4]]] * 4
    assert all(v.images[0].mode == "RGB" for v in vision)
    # the reward functions still get the image column, decoded
    assert all(len(images) == 1 for images in batch["image"])


def test_chats_place_their_images_where_their_items_are(vlm: str) -> None:
    rows = vision_dataset(4)
    chats = [
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": p}],
            }
        ]
        for p in rows["prompt"]
    ]
    data = _data(vlm, rows.add_column("messages", chats), image_column="image", messages_column="messages")
    batch = next(iter(data.train_dataloader()))
    text = data._tokenizer.decode(batch["prompts"][0][batch["prompt_mask"][0].bool()])
    assert text.index("Look:") < text.index(IMAGE_PAD) < text.index("How many squares?")


def test_a_chat_whose_image_items_do_not_match_its_images_is_refused(vlm: str) -> None:
    rows = vision_dataset(4)
    two_items = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Hi"}]}]
    bad = rows.add_column("messages", [two_items] * 4)
    with pytest.raises(ValueError, match=r"image_column='image'.*row 0.*1 images and 2 image items"):
        _data(vlm, bad, image_column="image", messages_column="messages")


def test_an_image_that_cannot_be_decoded_is_refused_naming_the_row(vlm: str, tmp_path: Path) -> None:
    good = io.BytesIO()
    draw_squares([0], random.Random(0)).save(good, format="PNG")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    rows = datasets.Dataset.from_dict(
        {"prompt": ["a", "b", "c", "d", "e"], "picture": [good.getvalue()] * 3 + [str(broken), good.getvalue()]}
    )
    with pytest.raises(ValueError, match=r"image_column='picture'.*row 3 of the training data.*cannot be decoded"):
        _data(vlm, rows, image_column="picture")


def test_a_missing_image_column_is_refused(vlm: str) -> None:
    with pytest.raises(KeyError, match=r"image_column='pictures'.*no such column"):
        _data(vlm, vision_dataset(4), image_column="pictures")


def test_placeholders_in_the_prompt_text_are_refused(vlm: str) -> None:
    rows = datasets.Dataset.from_dict(
        {"prompt": [f"{IMAGE_PAD} where?"] * 4, "image": list(vision_dataset(4)["image"])}
    )
    with pytest.raises(ValueError, match=r"row 0.*2 image tokens in the prompt for 1 images"):
        _data(vlm, rows, image_column="image")


def test_expanding_and_collapsing_placeholders_are_inverse() -> None:
    ids = [1, 7, 9, 7, 3]
    expanded = expand_image_tokens(ids, 7, [3, 2])
    assert expanded == [1, 7, 7, 7, 9, 7, 7, 3]
    assert collapse_image_tokens(expanded, 7) == ids
    with pytest.raises(ValueError, match="2 image tokens in the prompt for 1 images"):
        expand_image_tokens(ids, 7, [3])


def test_a_sampled_placeholder_ends_the_response_and_is_not_taken_for_an_image(vlm: str) -> None:
    data = _data(vlm, vision_dataset(4), image_column="image")
    batch = next(iter(data.train_dataloader()))
    image_id = data._tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert image_id in placeholder_ids(vlm)
    params = rollout_params(batch, RolloutConfig(), data._tokenizer, model_path=vlm)
    assert image_id in params.stop_token_ids  # a sampled placeholder ends the response
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(vlm)
    sampled = torch.cat([batch["prompts"], torch.full((4, 1), image_id)], dim=1)
    extra = vision_kwargs(config, sampled, batch[VISION_COLUMN])
    assert extra["mm_token_type_ids"].sum(1).tolist() == [4, 4, 4, 4]  # the prompt's placeholders only
    assert (extra["input_ids"][:, -1] != image_id).all() and (extra["input_ids"][:, :-1] == sampled[:, :-1]).all()
    with pytest.raises(ValueError, match="rows hold"):
        vision_kwargs(config, batch["prompts"][:, -3:], batch[VISION_COLUMN])  # a prompt cut short of its images


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_transformers_engine_log_probs_with_images_are_the_trainers(
    vlm: str, family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = vlm if family == "qwen2_vl" else save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm-2.5"), model_type=family)
    report = agreement("generate", path)
    assert report["max"] <= AGREEMENT and report["tokens"] > 50 and report["distinct"] > 4, report


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_log_probs_with_images_after_a_weight_hand_off_are_the_trainers(vlm: str, tmp_path: Path) -> None:
    """vLLM gets one placeholder per image and the images (its own processor makes the inputs), its weights by the
    hand-off (load_format='dummy'); its log-probs of the sampled tokens are the trainer's with the same images."""
    proc = run_script("vision_agreement.py", "--model", vlm, "--engine", "vllm", "--out", str(tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "agreement.json").read_text())
    assert report["max"] <= AGREEMENT and report["tokens"] > 50 and report["distinct"] > 4, report


def _check_episodes(report: dict) -> None:
    """Two-turn episodes with an image in reset's messages and one in the observation (CountTwiceEnvironment)."""
    assert report["max"] <= AGREEMENT and report["tokens"] > 50, report
    assert report["two_turns"] >= 2, report  # some episodes sampled a turn after the observed image
    images, placeholders = report["images"], report["placeholders"]
    assert set(images) <= {1, 2} and 2 in images, images
    # the observation's image sits in the response, its 4 placeholders (2x2 merged patches) observed, never sampled
    assert placeholders == [4 * (n - 1) for n in images] and report["sampled_placeholders"] == 0, report
    messages = report["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"][0] == {"type": "image"}  # the episode keeps the item, not the pixels


def test_episodes_with_images_in_reset_and_observations_agree_with_the_trainer(vlm: str) -> None:
    """The transformers engine (its request queue serves requests with images through generate, from the whole
    prompt); the rows' vision column holds each episode's images in order, so the trainer's forward matches."""
    _check_episodes(episode_agreement("generate", vlm))


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_episodes_with_images_agree_with_the_trainer(vlm: str, tmp_path: Path) -> None:
    """vLLM's continuous request queue: each request hands the episode's images with one placeholder per image."""
    proc = run_script("vision_agreement.py", "--model", vlm, "--engine", "vllm", "--episodes", "--out", str(tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    _check_episodes(json.loads((tmp_path / "agreement.json").read_text()))


class _Lens:
    """An environment whose tool runs in the rollout's process and returns an image with a caption."""

    in_process = True

    def __init__(self) -> None:
        self.tools = [self.look]

    def look(self, quadrant: int) -> list[object]:
        """Zoom into one quadrant of the picture.

        Args:
            quadrant: 0 top left, 1 top right, 2 bottom left, 3 bottom right.
        """
        return [draw_squares([quadrant], random.Random(quadrant)), f"quadrant {quadrant}"]

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": "Look closer."}]

    def step(self, message: dict) -> None:
        return None

    def reward(self, episode: object) -> float:
        return 0.0


def test_an_in_process_tool_returning_an_image_is_observed_and_kept_out_of_the_loss(vlm: str) -> None:
    """A tool's image goes into its tool message as an image item: the observation's placeholders (never sampled),
    the episode's images, the message kept with a bare item and the caption."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from lightning_rlhf.agents import register_agent_loop
    from lightning_rlhf.agents.env import Environment
    from lightning_rlhf.agents.parsing import ToolCall
    from lightning_rlhf.agents.rollout import EpisodeRunner, episode_rows
    from lightning_rlhf.config import EpisodeConfig
    from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams

    @register_agent_loop("test-vision-look-once")
    async def look_once(episode) -> None:  # type: ignore[no-untyped-def]
        if (await episode.generate()).truncated:
            return
        if episode.observe(await episode.call_tools([ToolCall("look", {"quadrant": 2})])):
            await episode.generate()

    tok = AutoTokenizer.from_pretrained(vlm)
    model = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, device="cpu")
    episode = EpisodeConfig(max_turns=2, tool_workers=1, max_episode_tokens=96, agent_loop="test-vision-look-once")
    runner = EpisodeRunner(
        type("Lens", (_Lens, Environment), {}), tok, RolloutConfig(max_new_tokens=4, episode=episode), model_name=vlm
    )
    image_id = tok.convert_tokens_to_ids(IMAGE_PAD)
    # a vision rollout's stop ids hold the placeholder (engines/hybrid.py); digits and vowels end a random model's turn
    stops = (tok.eos_token_id, image_id, *tok.convert_tokens_to_ids(list("0123456789aeiou")))
    try:
        episodes, _, _ = runner.run(
            engine, [{"prompt": ""}] * 8, SamplingParams(max_new_tokens=4, seed=1, stop_token_ids=stops)
        )
    finally:
        runner.close()
    rows = episode_rows(Batch({"uid": torch.arange(8)}), episodes, [False] * 8, pad_id=tok.pad_token_id)
    looked = [ep.info.turns == 2 for ep in episodes]
    assert sum(looked) >= 2, looked
    placeholders = rows["responses"] == image_id
    assert (
        placeholders.sum(1).tolist() == [4 * k for k in looked]
        and not (placeholders & rows["sampled_mask"].bool()).any()
    )
    assert [0 if v is None else len(v.images) for v in rows[VISION_COLUMN]] == [int(k) for k in looked]
    tool = episodes[looked.index(True)].info.messages[2]
    assert tool["role"] == "tool" and tool["content"] == [{"type": "image"}, {"type": "text", "text": "quadrant 2"}]


def test_image_items_in_episode_messages_are_checked(vlm: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from lightning_rlhf.data.vision import ChatImages

    images = ChatImages(AutoTokenizer.from_pretrained(vlm), vlm)
    picture = draw_squares([1], random.Random(0))
    messages, decoded = images.split(
        [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "image": picture}]}],
        where="the observation",
    )
    assert messages[0]["content"][1] == {"type": "image"} and decoded[0].size == picture.size
    with pytest.raises(ValueError, match=r"the observation: an image item .* holds no image"):
        images.split([{"role": "user", "content": [{"type": "image"}]}], where="the observation")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"reset's messages holds an image that cannot be decoded"):
        images.split([{"role": "user", "content": [{"type": "image", "path": str(broken)}]}], where="reset's messages")
    text_model = ChatImages(AutoTokenizer.from_pretrained(vlm), str(tmp_path))  # a folder with no image processor
    with pytest.raises(ValueError, match=r"no image processor.*vision-language actor"):
        text_model.expand([1, 2], decoded, where="x")


def test_torchvision_imports_beside_the_cpu_torch_in_a_fresh_interpreter() -> None:
    """The vision path imports torchvision (transformers' Qwen2-VL processor, vLLM's Qwen2-VL); a process that has not
    imported lightning_rlhf (vLLM's own subprocesses) gets the import hook from the venv's .pth line."""
    for code in ("import torchvision.transforms", "import lightning_rlhf, torchvision.transforms"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, (code, proc.stderr[-2000:])


def test_count_reward_reads_the_answer() -> None:
    assert count_reward(["p"] * 3, [" 1", "2", "3 "], ["1", "1", "3"]) == [1.0, 0.0, 1.0]


def test_batch_without_images_has_no_vision_inputs() -> None:
    assert vision_kwargs(object(), torch.zeros(2, 3, dtype=torch.long), None) == {}
    assert VISION_COLUMN not in Batch({"prompts": torch.zeros(2, 3)})


def test_samples_show_a_thumbnail_of_each_prompts_image(
    vlm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """samples.jsonl names a PNG thumbnail of each sample's image; the wandb table has the image beside the
    completion."""
    import types

    import wandb
    from lightning.pytorch.loggers import WandbLogger

    import lightning_rlhf.callbacks.samples as samples
    from lightning_rlhf.callbacks import RolloutSamples

    data = _data(vlm, vision_dataset(4), image_column="image")
    rollout = next(iter(data.train_dataloader()))
    rollout["completion"] = ["1", "2", "3", "4"]
    rollout["scores"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    tables: list[dict[str, object]] = []
    monkeypatch.setattr(logger, "log_table", lambda key, columns, data, step: tables.append({"c": columns, "d": data}))
    monkeypatch.setattr(samples, "step_of", lambda trainer: 9)
    trainer = types.SimpleNamespace(is_global_zero=True, loggers=[logger], default_root_dir=str(tmp_path))
    RolloutSamples(every_n_steps=10, num_samples=2).on_train_batch_end(
        trainer,
        types.SimpleNamespace(last_rollout=rollout),
        None,
        None,
        0,  # type: ignore[arg-type]
    )
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["images"]) == 1 for r in rows)
    from PIL import Image

    assert Image.open(tmp_path / rows[0]["images"][0]).size == (56, 56)  # at most THUMBNAIL: the image itself here
    table = tables[0]
    assert table["c"][-1] == "image" and all(isinstance(line[-1], wandb.Image) for line in table["d"])  # type: ignore[index,union-attr]


def test_lora_on_a_vlm_adapts_the_language_model_only(vlm: str) -> None:
    """``lora={"r": 8}`` ("all-linear") on a vision-language actor: adapters on the language model's linear layers,
    none on the vision tower (frozen, and vLLM serves adapters on the language model only)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from lightning_rlhf.compat.peft import target_layers
    from lightning_rlhf.engines.train.lora import resolve_lora

    config = resolve_lora({"r": 8}, setting="RLHFModule(lora=...)", task_type="CAUSAL_LM", model=vlm)
    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(vlm))
    names = [name for name, _ in target_layers(skeleton, config)]
    assert names and all(".language_model." in name for name in names), names
    assert any(name.endswith("self_attn.q_proj") for name in names)


def test_what_does_not_take_an_image_column_is_refused_before_any_model_loads() -> None:
    import types

    from lightning_rlhf.config import AlgorithmConfig
    from lightning_rlhf.data.vision import check_image_prompts

    plain = types.SimpleNamespace(environment=None, algorithm=AlgorithmConfig(), sequence_parallel=1)
    check_image_prompts(plain, setting="image_column='image'")  # GRPO, colocated: fine
    episodes = types.SimpleNamespace(environment=object(), algorithm=AlgorithmConfig(), sequence_parallel=1)
    with pytest.raises(ValueError, match=r"image_column='image'.*with an environment.*reset\(row\)"):
        check_image_prompts(episodes, setting="image_column='image'")
    with pytest.raises(ValueError, match=r"sequence_parallel=2"):
        check_image_prompts(
            types.SimpleNamespace(environment=None, algorithm=AlgorithmConfig(), sequence_parallel=2), setting="x"
        )


def test_prompts_of_different_lengths_left_padded_with_images_agree(vlm: str) -> None:
    """transformers' ``generate`` left-pads prompts of 32 to 74 tokens (its 3D positions from the attention mask); the
    trainer left-aligns them: the sampled tokens' log-probs agree within :data:`AGREEMENT`."""
    from transformers import AutoModelForImageTextToText

    from lightning_rlhf.engines.rollout import HFRolloutEngine, SamplingParams
    from lightning_rlhf.engines.train import forward_response

    rows = vision_dataset(8, seed=1).map(lambda r, i: {"prompt": "How many? " + "x " * (3 * i)}, with_indices=True)
    data = PromptDataModule(rows, image_column="image", tokenizer=vlm, batch_size=8, max_prompt_length=200)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert len(set(batch["prompt_mask"].sum(1).tolist())) == 8  # eight lengths
    model = AutoModelForImageTextToText.from_pretrained(vlm).eval()
    tok = data._tokenizer
    engine = HFRolloutEngine(
        model,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        device=torch.device("cpu"),
        decode="generate",
    )
    prompts = [r[m.bool()].tolist() for r, m in zip(batch["prompts"], batch["prompt_mask"], strict=True)]
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3), batch[VISION_COLUMN])
    scored = batch.select(torch.arange(8).repeat_interleave(2))
    width = max(map(len, out.responses))
    scored["responses"] = torch.tensor([r + [0] * (width - len(r)) for r in out.responses])
    scored["response_mask"] = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in out.responses])
    with torch.no_grad():
        trainer = forward_response(model, scored, output="logprobs")["logprobs"]
    sampled = torch.tensor([r + [0.0] * (width - len(r)) for r in out.logprobs or []])
    assert float((trainer - sampled).abs()[scored["response_mask"].bool()].max()) <= AGREEMENT
