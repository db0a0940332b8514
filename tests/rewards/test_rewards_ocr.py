"""OCR reward: the pure scoring rule, target extraction, and real PP-OCRv4 reads of rendered text (CPU)."""

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

pytest.importorskip("rapidocr_onnxruntime")  # the flowrl[rewards] extra, which setup.sh installs

from flowrl.rewards_api import Reward, RewardError, build_reward, score  # noqa: E402
from rewards.ocr import OcrReward, normalise, ocr_score, quoted_text  # noqa: E402

W, H = 384, 128
FONT_SIZE = 64
_DEJAVU = ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf")


def _font(size: int):
    font = ImageFont.load_default(size=size)  # scalable in Pillow >= 10.1 when built with FreeType
    if isinstance(font, ImageFont.FreeTypeFont):
        return font
    for path in _DEJAVU:
        if Path(path).exists():
            return ImageFont.truetype(path, size)
    pytest.skip("no scalable TrueType font to render test text")


def render(text: str) -> torch.Tensor:
    """Large black text centred on white -> [3, H, W] float in [0, 1]."""
    im = Image.new("RGB", (W, H), "white")
    ImageDraw.Draw(im).text((W // 2, H // 2), text, fill="black", font=_font(FONT_SIZE), anchor="mm")
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255


def blank() -> torch.Tensor:
    return torch.ones(3, H, W)


@pytest.fixture(scope="module")
def reward():
    return OcrReward(num_workers=2, num_threads=1)


# ------------------------------------------------------------------------------ pure scoring

@pytest.mark.parametrize("recognised, target, expected", [
    ("hallo", "hello", 0.8),                 # one substitution in 5
    ("helo", "hello", 0.8),                  # one deletion in 5
    ("open", "opening", 1 - 3 / 7),          # three missing characters in 7
    ("", "hello", 0.0),                      # nothing read
    ("zzzzzzzzzz", "ab", 0.0),               # distance 10 > length 2: clamped at 0
    ("xx hello yy", "hello", 1.0),           # target contained
    ("HeLLo  World", "hello world", 1.0),    # case and spaces ignored
    ("hel lo", "Hello", 1.0),
    ("ｈｅｌｌｏ！", "hello!", 1.0),          # full-width (NFKC)
    ("world", "hello", 0.2),
])
def test_ocr_score_hand_cases(recognised, target, expected):
    assert ocr_score(recognised, target) == pytest.approx(expected)


def test_ocr_score_rejects_blank_target():
    with pytest.raises(ValueError):
        ocr_score("hello", " \t ")


def test_normalise():
    assert normalise(" Hello\tWORLD \n!") == "helloworld!"


@pytest.mark.parametrize("prompt, expected", [
    ('a neon sign that says "Open Late"', "Open Late"),
    ("a sign that says 'hello'", "hello"),
    ("a poster reading “Grand Opening”", "Grand Opening"),
    ("a label ‘fragile’ on a box", "fragile"),
    ("«bonjour» written in chalk", "bonjour"),
    ("a cat's sign that says 'good boy'", "good boy"),     # apostrophe is not a quote
    ("it's a 'don't stop' sign", "don't stop"),
    ('first "one" then \'two\'', "one"),                   # the leftmost span wins
    ("a sign with no text", None),
    ('an empty "" quote', None),
])
def test_quoted_text(prompt, expected):
    assert quoted_text(prompt) == expected


def test_target_metadata_wins(reward):
    assert reward.target_for('a sign "world"', {"text": "hello"}) == "hello"
    assert reward.target_for('a sign "world"', {}) == "world"
    assert reward.target_for('a sign "world"', None) == "world"
    assert reward.target_for("no quotes", {"text": "hello"}) == "hello"
    assert reward.target_for("no quotes", {}) is None


# ------------------------------------------------------------------------------ real OCR

def test_is_a_reward_and_builds_by_path():
    built = build_reward("rewards.ocr:OcrReward", num_workers=1, min_side=128)
    assert isinstance(built, Reward) and built.name == "ocr"
    with pytest.raises(ValueError, match="missing_target"):
        build_reward("rewards.ocr:OcrReward", missing_target="zero")


def test_right_word_wrong_word_blank(reward):
    images = torch.stack([render("hello"), render("world"), blank()])
    prompts = ['a sign that says "hello"'] * 3
    out = reward(images, prompts, [{}] * 3)
    assert set(out) == {"ocr", "ocr/exact", "ocr/recognised_len"}
    assert all(v.shape == (3,) and v.dtype == torch.float32 for v in out.values())
    right, wrong, empty = out["ocr"].tolist()
    assert right >= 0.9
    assert wrong <= 0.5
    assert empty == 0.0  # nothing written is a valid score, not NaN
    assert out["ocr/exact"].tolist() == [1.0, 0.0, 0.0]
    assert out["ocr/recognised_len"][2].item() == 0.0


def test_metadata_target_overrides_quotes(reward):
    images = torch.stack([render("hello"), render("hello")])
    prompts = ['a sign that says "world"'] * 2
    out = reward(images, prompts, [{"text": "hello"}, {}])
    assert out["ocr"][0].item() >= 0.9
    assert out["ocr"][1].item() <= 0.5


def test_nan_pixels_score_nan_and_batch_goes_on(reward, caplog):
    bad = render("hello")
    bad[:, 10:20, 10:20] = math.nan
    images = torch.stack([render("hello"), bad, render("world")])
    prompts = ['say "hello"', 'the broken one "hello"', 'say "world"']
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.ocr"):
        out = reward(images, prompts, [{}] * 3)
    main = out["ocr"]
    assert math.isnan(main[1]) and math.isnan(out["ocr/exact"][1])
    assert main[0].item() >= 0.9 and main[2].item() >= 0.9
    lines = [r.getMessage() for r in caplog.records if r.name == "flowrl.rewards.ocr"]
    assert any("the broken one" in line for line in lines)


def test_engine_failure_scores_nan(caplog):
    class Flaky(OcrReward):
        def read(self, img):
            if img.mean() < 250:  # the image with text
                raise RuntimeError("engine exploded")
            return ""

    images = torch.stack([render("hello"), blank()])
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.ocr"):
        out = Flaky(num_workers=2)(images, ['a "hello"', 'b "hello"'], [{}, {}])
    assert math.isnan(out["ocr"][0]) and out["ocr"][1].item() == 0.0
    assert any("engine exploded" in r.getMessage() and "'a \"hello\"'" in r.getMessage()
               for r in caplog.records)


def test_batch_equals_one_by_one(reward):
    words = ["hello", "flow", "world", "open", "hello"]
    images = torch.stack([render(w) for w in words[:-1]] + [blank()])
    prompts = [f'a sign "{w}"' for w in ["hello", "flow", "hello", "open", "hello"]]
    batched = reward(images, prompts, [{}] * 5)
    for i in range(5):
        single = reward(images[i:i + 1], prompts[i:i + 1], [{}])
        for key, value in batched.items():
            assert single[key][0].item() == pytest.approx(value[i].item()), (key, i)


def test_missing_target_raises_one_line(reward):
    images = torch.stack([render("hello"), blank()])
    with pytest.raises(ValueError) as info:
        reward(images, ['a "hello"', "a plain red apple"], [{}, {}])
    msg = str(info.value)
    assert "\n" not in msg and "a plain red apple" in msg
    with pytest.raises(RewardError, match="a plain red apple"):  # through the scoring seam
        score([reward], images, ["a plain red apple", 'a "hello"'], [{}, {}])


def test_missing_target_nan_mode(caplog):
    lenient = OcrReward(num_workers=1, missing_target="nan")
    images = torch.stack([render("hello"), blank()])
    with caplog.at_level(logging.WARNING, logger="flowrl.rewards.ocr"):
        out = lenient(images, ['a "hello"', "a plain red apple"], [{}, {}])
    assert out["ocr"][0].item() >= 0.9 and math.isnan(out["ocr"][1])
    assert any("a plain red apple" in r.getMessage() for r in caplog.records)


def test_small_image_upscaled(reward):
    small = torch.nn.functional.interpolate(render("hello")[None], scale_factor=0.5, mode="area")  # 192x64
    out = reward(small, ['"hello"'], [{}])
    assert out["ocr"].item() >= 0.9


def test_engine_that_cannot_be_built_raises(monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("no onnx model")

    monkeypatch.setattr("rewards.ocr.RapidOCR", broken)
    with pytest.raises(RuntimeError, match="no onnx model"):  # a broken install is not a NaN image
        OcrReward(num_workers=2)(torch.stack([blank(), blank()]), ['"a"', '"b"'], [{}, {}])
