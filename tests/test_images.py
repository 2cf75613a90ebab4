"""Images in the prompt: exact under speculation, batching and the prefix cache, with mlx-vlm's
own generation on the same checkpoint and images as the oracle."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from dflash_server import stream_generate
from dflash_server.adaptive.policy import FixedBlock
from dflash_server.engine.prefix_cache import PrefixCache
from dflash_server.engine.prefix_disk import PrefixDisk
from dflash_server.generation.batch import BatchDecoder
from dflash_server.generation.images import PromptImages
from dflash_server.generation.row import Row
from dflash_server.generation.sampling import SamplingParams, TokenSampler
from dflash_server.generation.speculative import SpeculativeDecoder
from dflash_server.generation.target import TargetModel
from dflash_server.generation.text import encode
from dflash_server.models.mrope import prompt_positions
from dflash_server.models.vision import ImageInput, expand_pads
from dflash_server.testing import ReplayDrafter, random_drafter

N = 40


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """A deterministic random RGB picture of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


PICTURES = [picture(1, (96, 64)), picture(2, (64, 128)), picture(3, (96, 64))]


def chat_text(tokenizer: Any, images: int, question: str = "What is in this picture?") -> str:
    """A user turn with ``images`` image parts and a question, as the chat template renders it."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    parts.append({"type": "text", "text": question})
    messages = [{"role": "user", "content": parts}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def image_prompt(
    vl: tuple, pictures: list[Image.Image], question: str = "What is in this picture?"
):
    """(prompt ids with each image's tokens, the images as the processor made them, the text)."""
    _, tokenizer, vision = vl
    text = chat_text(tokenizer, len(pictures), question)
    images = [vision.prepare(p) for p in pictures]
    ids = expand_pads(
        encode(tokenizer, text), vision.tokens.image, [vision.count(i) for i in images]
    )
    return ids, images, text


@pytest.fixture(scope="module")
def vlm(tiny_vl_path: Path) -> tuple[Any, Any]:
    """mlx-vlm's own (model, processor) of the same checkpoint: the oracle."""
    from mlx_vlm.utils import load

    return load(str(tiny_vl_path))


def vlm_greedy(
    vlm: tuple[Any, Any], text: str, pictures: list[Image.Image], n: int = N
) -> list[int]:
    """mlx-vlm's plain greedy decoding of ``text`` with ``pictures``."""
    from mlx_vlm.generate import stream_generate as vlm_stream

    model, processor = vlm
    steps = vlm_stream(model, processor, text, image=pictures, max_tokens=n, temperature=0.0)
    return [r.token for r in steps][:n]


def vlm_logits(vlm: tuple[Any, Any], text: str, pictures: list[Image.Image], more: list[int]):
    """mlx-vlm's logits ([L, V]) over the prompt and ``more`` tokens, in one forward."""
    model, processor = vlm
    inputs = processor(text=[text], images=pictures, return_tensors="np")
    ids = mx.array([*inputs["input_ids"][0].tolist(), *more])[None]
    grid = mx.array(inputs["image_grid_thw"])
    embedded = model.get_input_embeddings(
        ids, mx.array(inputs["pixel_values"]), image_grid_thw=grid
    )
    out = model.language_model(ids, inputs_embeds=embedded.inputs_embeds,
                               position_ids=embedded.position_ids)  # fmt: skip
    return out.logits[0].astype(mx.float32)


def image_row(vl: tuple, draft: Any, ids: list[int], images: list[ImageInput], block: int = 1,
              **kw: Any) -> Row:  # fmt: skip
    """A row of ``ids`` with ``images`` (``draft=None``: plain decoding)."""
    model, _, vision = vl
    taps = tuple(draft.config.target_layer_ids) if draft is not None else ()
    target = TargetModel(model, taps)
    target.place_positions()
    sampler = TokenSampler(kw.pop("sampling", SamplingParams()), kw.pop("seed", None))
    policy = kw.pop("policy", None) or FixedBlock(block)
    prompt = PromptImages(vision, images, ids) if images else None
    return Row(target, draft, sampler, policy, images=prompt, **kw)


def decode(row: Row, ids: list[int], n: int = N) -> list[int]:
    return [t for c in SpeculativeDecoder(row).generate(ids, n) for t in c.tokens]


# -- the prompt -------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2])
def test_prompt_and_positions_equal_mlx_vlm(tiny_vl: tuple, vlm: tuple, count: int) -> None:
    """Our image tokens, patches and 3-D positions are mlx-vlm's processor's and rope index's."""
    ids, images, text = image_prompt(tiny_vl, PICTURES[:count])
    model, processor = vlm
    inputs = processor(text=[text], images=PICTURES[:count], return_tensors="np")
    assert ids == inputs["input_ids"][0].tolist()
    assert np.array_equal(np.concatenate([i.pixels for i in images]), inputs["pixel_values"])
    grid = mx.array(inputs["image_grid_thw"])
    positions, delta = model.language_model.get_rope_index(mx.array([ids]), grid)
    ours, shift = prompt_positions(ids, tiny_vl[2].tokens.image, [i.grid for i in images], 2)
    assert np.array_equal(np.array(positions)[:, 0], ours) and shift == delta.item() < 0


def test_prompt_positions_refuse_a_mismatch() -> None:
    with pytest.raises(ValueError, match="2 images"):
        prompt_positions([1, 9, 9, 9, 9, 2], 9, [(1, 4, 4), (1, 4, 4)], 2)
    with pytest.raises(ValueError, match="image tokens in a row"):
        prompt_positions([1, 9, 9, 2, 9, 9], 9, [(1, 4, 4)], 2)
    assert expand_pads([1, 9, 2, 9], 9, [2, 3]) == [1, 9, 9, 2, 9, 9, 9]
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_pads([1, 9, 2], 9, [2, 3])


def test_pixel_caps_and_decoding(tiny_vl: tuple) -> None:
    """Images are resized within the server's cap and the processor's own min and max; files
    decode as PNG, JPEG, WebP or GIF only, up to a pixel limit, and anything else says why."""
    import io

    from dflash_server.models.vision import open_image

    vision = tiny_vl[2]
    big = picture(7, (256, 256))
    assert vision.count(vision.prepare(big)) == 64  # the processor's 256 x 256 at most
    assert vision.count(vision.prepare(big, 128 * 128)) == 16
    assert vision.count(vision.prepare(big, 10)) == vision.min_pixels // 32**2
    buffer = io.BytesIO()
    big.save(buffer, format="BMP")
    with pytest.raises(ValueError, match="BMP images are not supported"):
        open_image(buffer.getvalue())
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    with pytest.raises(ValueError, match="more than the 100 this server decodes"):
        open_image(buffer.getvalue(), 100)
    with pytest.raises(ValueError, match="does not decode"):
        open_image(buffer.getvalue()[:200])
    with pytest.raises(ValueError, match="not an image"):
        open_image(b"GIF89a but not really")


# -- greedy, logprobs ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2])
def test_greedy_equals_mlx_vlm(tiny_vl: tuple, vlm: tuple, count: int) -> None:
    """Plain decoding, DFlash at every acceptance length, a random drafter, and a prefill whose
    chunks end inside the images: all token-identical to mlx-vlm's greedy decoding."""
    pictures = PICTURES[:count]
    ids, images, text = image_prompt(tiny_vl, pictures)
    reference = vlm_greedy(vlm, text, pictures)
    model = tiny_vl[0]
    assert decode(image_row(tiny_vl, None, ids, images), ids) == reference
    inner = random_drafter(model)
    for block in (4, 8):
        replay = ReplayDrafter(ids + reference, list(range(block)), inner)
        row = image_row(tiny_vl, replay, ids, images, block)
        assert decode(row, ids) == reference, block
        assert all(row.stats.acceptance_histogram), row.stats.acceptance_histogram
    assert decode(image_row(tiny_vl, inner, ids, images, 4, prefill_step_size=5), ids) == reference


def test_images_change_the_answer(tiny_vl: tuple) -> None:
    """Sanity for the oracle: another image (same text) or no image gives other tokens."""
    outputs = []
    for pictures in ([PICTURES[0]], [PICTURES[1]], []):
        ids, images, _ = image_prompt(tiny_vl, pictures)
        outputs.append(decode(image_row(tiny_vl, None, ids, images), ids, 12))
    assert len({tuple(o) for o in outputs}) == 3


def test_logprobs_equal_mlx_vlm(tiny_vl: tuple, vlm: tuple) -> None:
    """The Python API with two images: each token's logprob within 1e-4 of mlx-vlm's."""
    model, tokenizer, vision = tiny_vl
    pictures = PICTURES[:2]
    text = chat_text(tokenizer, 2)
    inner = random_drafter(model, block_size=4)
    out = list(stream_generate(model, inner, tokenizer, text, 4, max_tokens=16, logprobs=2,
                               images=pictures, vision=vision))  # fmt: skip
    tokens = [t for r in out for t in r.tokens]
    logprobs = [lp for r in out for lp in r.logprobs or []]
    logits = vlm_logits(vlm, text, pictures, tokens)
    start = logits.shape[0] - len(tokens) - 1
    reference = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = [reference[start + i, t].item() for i, t in enumerate(tokens)]
    assert tokens == vlm_greedy(vlm, text, pictures, 16)
    assert np.max(np.abs(np.array(want) - np.array(logprobs))) < 1e-4


def test_original_layout_loads_and_equals_mlx_vlm(tmp_path: Path) -> None:
    """The original checkpoint layout (model.visual.*, PyTorch tensors, norm offsets): mlx-lm
    and load_vision read it, mlx-vlm too, and the answers agree."""
    import mlx_lm
    from mlx_vlm.utils import load as vlm_load

    from dflash_server.models.vision import load_vision
    from dflash_server.testing.vision import build_vision_target

    path = build_vision_target(tmp_path / "original", layout="original", seed=3)
    model, tokenizer = mlx_lm.load(str(path))
    vl = (model, tokenizer, load_vision(path))
    ids, images, text = image_prompt(vl, PICTURES[:1])
    reference = vlm_greedy(vlm_load(str(path)), text, PICTURES[:1], 16)
    assert decode(image_row(vl, None, ids, images), ids, 16) == reference


def test_the_positions_hook_checks_itself(tiny_vl_path: Path) -> None:
    """An mlx-lm whose attention no longer rotates through its RoPE module fails at load."""
    import mlx.nn as nn
    import mlx_lm

    from dflash_server.generation.target import check_positions
    from dflash_server.models.hooks import HookError, TargetHooks

    model, _ = mlx_lm.load(str(tiny_vl_path))  # its own copy: the hooks are changed below
    hooks = TargetHooks.of(model)
    hooks.place_positions()
    check_positions(hooks)
    for layer in hooks.parts.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.rope = nn.RoPE(16)  # rotates, but not through the hook
    with pytest.raises(HookError, match="0 rotations"):
        check_positions(hooks)


def test_text_only_checkpoint_has_no_vision(tiny_hybrid_path: Path) -> None:
    from dflash_server.models.vision import load_vision

    assert load_vision(tiny_hybrid_path) is None


# -- suffix drafts, batching, the prefix cache ------------------------------------------------


def test_suffix_copies_use_the_true_positions(tiny_vl: tuple, vlm: tuple) -> None:
    """Copies (wider than a drafter block) verified after an image equal mlx-vlm's greedy."""
    from dflash_server.adaptive.controller import BlockController
    from dflash_server.drafters.suffix import SharedSuffixIndex, SuffixProposer
    from test_suffix import cheap_verify

    ids, images, text = image_prompt(tiny_vl, PICTURES[:1])
    reference = vlm_greedy(vlm, text, PICTURES[:1], 60)
    shared = SharedSuffixIndex(1 << 20)
    shared.add(reference)  # an earlier answer: copies of it run past a drafter block
    row = image_row(tiny_vl, None, ids, images, policy=BlockController(1, cheap_verify()),
                    suffix=SuffixProposer(ids, shared, max_tokens=48))  # fmt: skip
    assert decode(row, ids, 60) == reference
    assert row.stats.sources["suffix"]["widest"] > 16


def test_batched_image_rows_equal_their_lone_runs(tiny_vl: tuple) -> None:
    """An image row beside text rows and beside another image row (each its own shift), one
    of them prefilling in chunks while the others decode: every row as alone."""
    from test_batching import step_rows, tokens_of

    model, tokenizer, _ = tiny_vl
    inner = random_drafter(model)
    one, images1, _ = image_prompt(tiny_vl, PICTURES[:1])
    two, images2, _ = image_prompt(tiny_vl, PICTURES[1:3], "Compare them.")
    text = list(tokenizer.encode("The quick brown fox"))

    specs = {
        "one": (lambda: image_row(tiny_vl, inner, one, images1, 4), one, 30),
        "two": (lambda: image_row(tiny_vl, inner, two, images2, 8, prefill_step_size=7), two, 30),
        "text": (lambda: image_row(tiny_vl, inner, text, [], 4), text, 30),
        "plain": (lambda: image_row(tiny_vl, None, text, []), text, 30),
    }
    batch = BatchDecoder(TargetModel(model, tuple(inner.config.target_layer_ids)))
    rows = {k: (make(), prompt, n) for k, (make, prompt, n) in specs.items()}
    out = step_rows(batch, rows, start={"two": 2, "plain": 1})
    for key, (make, prompt, n) in specs.items():
        assert tokens_of(out[key]) == decode(make(), prompt, n), key
    assert max(batch.histogram) >= 3 and batch.rows == []


def test_the_batch_decodes_while_an_image_prompt_prefills(
    tiny_vl: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image prompt prefills alone, one chunk per step (the image encoded once, at the
    chunk that first needs it), while a running row commits tokens at every one of those
    steps."""
    from dflash_server.generation.cycle import PREFILL_CHUNK

    model, tokenizer, vision = tiny_vl
    inner = random_drafter(model)
    ids, images, _ = image_prompt(tiny_vl, PICTURES[:2])
    text = list(tokenizer.encode("The quick brown fox"))
    batch = BatchDecoder(TargetModel(model, tuple(inner.config.target_layer_ids)))
    running = image_row(tiny_vl, inner, text, [], 4)
    batch.add(running, text, 200)
    while running not in batch.rows:
        batch.step()
    row = image_row(tiny_vl, inner, ids, images, 4, prefill_step_size=6)
    encoded = []
    encode_image = vision.encode
    monkeypatch.setattr(vision, "encode", lambda i: encoded.append(i.digest) or encode_image(i))
    batch.add(row, ids, 8)
    chunks = 0
    while (outcome := batch.step())[row] is PREFILL_CHUNK:
        chunks += 1
        assert outcome[running].tokens  # the running row went on meanwhile
    ends = set(range(6, len(ids), 6)) | {len(ids) - 1, len(ids)}  # the last token: a chunk
    assert chunks == len(ends) - 1 and encoded == [i.digest for i in images]


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_prefix_cache_hit_on_a_repeated_image(
    tiny_vl: tuple, tmp_path: Path, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second turn that repeats the conversation with its image restores the first's prefix
    (from RAM, or from the disk tier after a restart), encodes no image again and equals the
    cold run; the same text with another image never hits past the image."""
    model, tokenizer, vision = tiny_vl
    inner = random_drafter(model)
    first, images, _ = image_prompt(tiny_vl, PICTURES[:1])
    reply = list(tokenizer.encode("A picture.<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"))
    second = first + reply + list(tokenizer.encode("<|im_start|>assistant\n"))
    other, other_images, _ = image_prompt(tiny_vl, PICTURES[2:3])  # same size: same tokens
    assert other == first and other_images[0].digest != images[0].digest
    cut = (len(first) - 3,)  # a message boundary after the image

    def run(ids: list[int], imgs: list[ImageInput], cache: Any) -> tuple[list[int], Row]:
        row = image_row(tiny_vl, inner, ids, imgs, 4, prefix=cache, checkpoints=cut)
        return decode(row, ids, 24), row

    cold = run(second, images, None)[0]
    encoded = Counter[bytes]()
    encode_image = vision.encode
    monkeypatch.setattr(vision, "encode", lambda i: encoded.update([i.digest]) or encode_image(i))
    cache = PrefixCache(1 << 30, PrefixDisk(tmp_path, 1 << 30, "vl") if tier == "disk" else None)
    run(first, images, cache)
    if tier == "disk":  # a restart: only the disk tier holds the first turn
        cache.close()
        cache = PrefixCache(1 << 30, PrefixDisk(tmp_path, 1 << 30, "vl"))
    tokens, row = run(second, images, cache)
    assert tokens == cold and row.stats.cached_tokens >= cut[0]
    assert encoded[images[0].digest] == 1  # the hit covered the image: not encoded again
    _, row = run(second, other_images, cache)
    assert row.stats.cached_tokens < first.index(vision.tokens.image)
    if cache.disk is not None:
        assert cache.disk.stats()["reads"] == 1
        cache.close()


# -- sampling ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_sampling_with_an_image_follows_the_target_law(tiny_vl: tuple, vlm: tuple) -> None:
    """Joint law of the first 3 tokens after an image, speculative (drafts accepted, rejected
    and resampled), against the exact law from mlx-vlm's logits."""
    from test_sampling import joint_law, total_variation, tv_tolerance

    model, _, _ = tiny_vl
    ids, images, text = image_prompt(tiny_vl, PICTURES[:1])
    params = SamplingParams(temperature=1.5, top_k=2, repetition_penalty=1.2)

    def law(prefix: list[int]) -> dict[int, float]:
        sampler = TokenSampler(params)
        logits = vlm_logits(vlm, text, PICTURES[:1], prefix)[-1:]
        logits = sampler.process(logits, mx.array((ids + prefix)[-20:]))
        probs = mx.exp(sampler.logprobs(logits))[0].tolist()
        return {i: p for i, p in enumerate(probs) if p > 0}

    exact = joint_law(law)
    best = max(exact, key=exact.get)
    inner = random_drafter(model, block_size=4)
    n, counts = 300, Counter[tuple[int, ...]]()
    for seed in range(n):
        draft = ReplayDrafter(ids + list(best) + [0] * 8, [3], inner)
        row = image_row(tiny_vl, draft, ids, images, 4, sampling=params, seed=seed)
        counts[tuple(decode(row, ids, 3))] += 1
    assert total_variation(counts, exact, n) < tv_tolerance(len(exact), n, factor=2.0)
