"""The verifier: hand-drawn images with known scores, rendered prompts score 1, mismatches less."""

import functools

import numpy as np
import pytest

from g2rpo_jax.data import world
from g2rpo_jax.rewards import verifier

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
YELLOW, WHITE = (255, 255, 0), (255, 255, 255)


def blank(size=32):
    return np.zeros((size, size, 3), np.uint8)


def disk(radius):
    d = np.arange(-radius, radius + 1)
    return d[:, None] ** 2 + d[None, :] ** 2 <= radius * radius + radius


def triangle(height):
    """Upright: row i from the top is 2·⌊(i+1)/2⌋ + 1 wide."""
    rows = [np.abs(np.arange(height) - height // 2) <= (i + 1) // 2 for i in range(height)]
    return np.array(rows)


# ---------------------------------------------------------------------------------------------
# Segmentation and connected components
# ---------------------------------------------------------------------------------------------


def test_segment_nearest_palette_colour_with_threshold():
    image = blank(4)
    image[0, 0] = (240, 20, 10)  # near red
    image[0, 1] = (0, 0, 230)  # near blue
    image[0, 2] = (128, 128, 128)  # grey: far from everything
    image[0, 3] = (255, 255, 30)  # near yellow
    image[1, 0] = (20, 20, 20)  # near background
    image[1, 1] = (128, 0, 0)  # halfway between red and black
    masks = verifier.segment(image)
    assert set(masks) == {"background", "red", "green", "blue", "yellow", "white", "off_palette"}
    assert masks["red"][0, 0] and masks["blue"][0, 1] and masks["yellow"][0, 3]
    assert masks["off_palette"][0, 2] and masks["off_palette"][1, 1]
    assert masks["background"][1, 0] and masks["background"][3, 3]
    assert int(masks["off_palette"].sum()) == 2
    stacked = np.stack(list(masks.values()))
    assert (stacked.sum(0) == 1).all()  # a partition
    # Floats in [0, 1] read the same as uint8.
    floats = verifier.segment(image.astype(np.float32) / 255)
    for name in masks:
        np.testing.assert_array_equal(floats[name], masks[name])


def test_connected_components_hand_made_mask():
    mask = np.array([
        [1, 1, 0, 0, 1],
        [1, 0, 0, 1, 1],
        [0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0],
    ], bool)
    labels, count = verifier.connected_components(mask)
    assert count == 4  # diagonal neighbours are not connected
    expected = np.array([
        [1, 1, 0, 0, 2],
        [1, 0, 0, 2, 2],
        [0, 0, 3, 0, 0],
        [4, 0, 3, 0, 0],
    ])
    np.testing.assert_array_equal(labels, expected)
    stats = verifier.component_stats(labels, count)
    np.testing.assert_array_equal(stats.area, [3, 3, 2, 1])
    np.testing.assert_allclose(stats.centroid, [[1 / 3, 1 / 3], [2 / 3, 11 / 3], [2.5, 2], [3, 0]])
    np.testing.assert_array_equal(stats.bbox, [[0, 0, 1, 1], [0, 3, 1, 4], [2, 2, 3, 2],
                                               [3, 0, 3, 0]])


def test_connected_components_long_spiral_and_empty():
    # A spiral path of 1s: one component however winding.
    mask = np.zeros((9, 9), bool)
    mask[0, :] = True
    mask[:, 8] = True
    mask[8, :] = True
    mask[2:, 0] = True
    mask[2, :7] = True
    mask[2:7, 6] = True
    mask[6, 2:7] = True
    mask[4:7, 2] = True
    mask[4, 2:5] = True
    labels, count = verifier.connected_components(mask)
    assert count == 1 and (labels[mask] == 1).all() and (labels[~mask] == 0).all()
    labels, count = verifier.connected_components(np.zeros((5, 6), bool))
    assert count == 0 and not labels.any()
    checker = (np.arange(6)[:, None] + np.arange(6)[None, :]) % 2 == 0
    assert verifier.connected_components(checker)[1] == 18


def test_classify_shape_hand_drawn():
    assert verifier.classify_shape(np.ones((6, 6), bool)) == "square"
    assert verifier.classify_shape(np.ones((7, 7), bool)) == "square"
    assert verifier.classify_shape(disk(3)) == "circle"
    assert verifier.classify_shape(disk(5)) == "circle"
    assert verifier.classify_shape(triangle(7)) == "triangle"
    assert verifier.classify_shape(triangle(11)) == "triangle"
    assert verifier.classify_shape(triangle(11)[::-1]) is None  # upside down
    assert verifier.classify_shape(np.ones((2, 10), bool)) is None  # a bar
    ring = np.ones((9, 9), bool)
    ring[2:7, 2:7] = False
    assert verifier.classify_shape(ring) is None  # hollow: solidity 56/81
    u_shape = np.ones((9, 9), bool)
    u_shape[:6, 3:6] = False
    assert verifier.classify_shape(u_shape) is None
    holed = disk(5).copy()
    holed[5, 5] = False  # one missing pixel: still a circle
    assert verifier.classify_shape(holed) == "circle"


def test_detect_objects_hand_drawn():
    image = blank()
    image[3:10, 3:10] = RED  # small square, 7 px
    image[15:26, 15:26][disk(5)] = BLUE  # large circle, 11 px
    image[30, 30] = GREEN  # a 1 px speck: noise
    blobs = verifier.detect_objects(image)
    assert [(b.colour, b.shape, b.size, b.area) for b in blobs] == [
        ("red", "square", "small", 49), ("blue", "circle", "large", 97)]
    assert blobs[0].centroid == (6.0, 6.0) and blobs[0].bbox == (3, 3, 9, 9)
    assert blobs[1].centroid == (20.0, 20.0)


# ---------------------------------------------------------------------------------------------
# Scores of hand-drawn images
# ---------------------------------------------------------------------------------------------


def one_red_square():
    image = blank()
    image[5:11, 5:11] = RED  # 6×6: small (side < 9)
    return image


@pytest.mark.parametrize("prompt, expected", [
    ("a red square", 1.0),
    ("a small red square", 1.0),
    ("a large red square", 2 / 3),  # colour 1, shape 1, size 0
    ("a red circle", 0.5),  # colour 1, shape 0
    ("a red triangle", 0.5),
    ("two red squares", 0.5),  # colour 1/2, shape 1/2
    ("three red squares", 1 / 3),
    ("three small red squares", 1 / 3),
    ("a blue square", 0.0),  # nothing blue; the red square is extra
    ("a red square left of a blue circle", 0.25),  # attributes (1+0+1+0)/4, relation 0
    ("a red square above a red circle", (0.5 + 1 + 0) / 3 / 2),  # red 1/2, red square 1, circle 0
])
def test_hand_drawn_single_square(prompt, expected):
    assert verifier.score(one_red_square(), prompt) == pytest.approx(expected)


def test_hand_drawn_relation_scene():
    image = blank()
    image[10:17, 2:9] = RED  # small red square, centre column 5
    image[9:18, 19:28][disk(4)] = BLUE  # blue circle, centre column 23, same row as the square
    assert verifier.score(image, "a red square left of a blue circle") == 1.0
    assert verifier.score(image, "a blue circle right of a red square") == 1.0
    assert verifier.score(image, "a red square right of a blue circle") == 0.5
    assert verifier.score(image, "a red square above a blue circle") == 0.5  # same row
    assert verifier.score(image, "a red square below a blue circle") == 0.5
    # Wrong subject shape: colours 1, 1; shapes 0, 1; no candidate pair → (3/4 + 0) / 2.
    assert verifier.score(image, "a red circle left of a blue circle") == pytest.approx(3 / 8)
    # Count prompt on a two-object image: the blue circle is an extra object.
    assert verifier.score(image, "a red square") == pytest.approx(0.5)
    image[25:29, 2:6] = GREEN  # a third, unrelated object: exclusivity 2 / 3
    assert verifier.score(image, "a red square left of a blue circle") == pytest.approx(2 / 3)


def test_hand_drawn_counts_and_sizes():
    image = blank()
    image[2:13, 2:13][disk(5)] = YELLOW  # large
    image[2:9, 20:27][disk(3)] = YELLOW  # small
    image[18:29, 10:21][triangle(11)] = WHITE  # large triangle
    assert verifier.score(image, "two yellow circles") == pytest.approx(2 / 3)  # white extra
    assert verifier.score(image, "two large yellow circles") == pytest.approx(
        (1 + 1 + 0.5) / 3 * 2 / 3)
    assert verifier.score(image, "a large white triangle") == pytest.approx(1 / 3)  # 2 extras
    # Yellow 1/2, white 1, yellow circles 1/2, white triangle 1, the relation holds; strictly,
    # the second yellow circle is beyond the prompt's one yellow object: exclusivity 2 / 3.
    expected = ((0.5 + 1 + 0.5 + 1) / 4 + 1) / 2
    assert verifier.score(image, "a white triangle below a yellow circle") == pytest.approx(
        expected)
    assert verifier.score(image, "a white triangle below a yellow circle",
                          strict=True) == pytest.approx(expected * 2 / 3)
    image[2:9, 20:27] = 0
    assert verifier.score(image, "a white triangle below a yellow circle") == 1.0
    assert verifier.score(image, "a yellow circle above a white triangle") == 1.0
    assert verifier.score(image, "a yellow circle right of a white triangle") == 0.5


def test_strict_rule_gives_extra_and_unrecognised_objects_no_credit():
    score = functools.partial(verifier.score, strict=True)
    image = blank()
    image[2:9, 2:9][disk(3)] = RED
    assert score(image, "a red circle") == 1.0
    image[20:27, 20:27][disk(3)] = RED  # a second red circle: beyond the count
    assert score(image, "a red circle") == pytest.approx((0.5 + 0.5) / 2 * 1 / 2)
    assert score(image, "two red circles") == 1.0
    image[20:27, 20:27] = 0
    image[20:22, 16:30] = RED  # a red bar: no shape of the world (aspect 2 / 14)
    assert verifier.detect_objects(image)[-1].shape is None
    # The bar counts for no colour and is extra: colour 1, shape 1, exclusivity 1 / 2.
    assert score(image, "a red circle") == pytest.approx(0.5)
    # Asked for two, the bar does not make up the count: colour 1/2, shape 1/2, and it is
    # still extra: exclusivity 2 / 3.
    assert score(image, "two red circles") == pytest.approx(0.5 * 2 / 3)
    # Hedging between two colours scores below drawing the right one.
    hedge = blank()
    hedge[2:9, 2:9][disk(3)] = RED
    hedge[20:27, 20:27][disk(3)] = BLUE
    assert score(hedge, "a red circle") == pytest.approx(0.5)
    # The default rule counts the bar for red and a second red circle as no extra.
    assert verifier.score(image, "a red circle") == pytest.approx((0.5 + 1) / 2)


def test_rendered_prompts_score_one_under_the_strict_rule():
    rng = np.random.default_rng(5)
    for prompt in world.all_prompts()[::9]:
        image = world.render_prompt(prompt, rng, grid=4)
        assert verifier.score(image, prompt, strict=True) == 1.0, prompt


def test_all_background_scores_zero_for_every_prompt():
    image = blank()
    for prompt in world.all_prompts():
        assert verifier.score(image, prompt) == 0.0
    assert verifier.quality(image) == 1.0


def test_bad_prompt_raises():
    with pytest.raises(ValueError, match="purple"):
        verifier.score(blank(), "a purple circle")


# ---------------------------------------------------------------------------------------------
# Rendered prompts: their own prompt scores 1, mismatched ones score less
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [1, 4])  # any pixel; the shapes configs' placement grid
def test_every_rendered_prompt_scores_one_on_its_own_prompt(grid):
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        for prompt in world.all_prompts():
            image = world.render_prompt(prompt, rng, grid=grid)
            assert verifier.score(image, prompt) == 1.0, prompt
            assert verifier.quality(image) == 1.0, prompt


def test_rendered_prompts_score_one_on_other_canvases():
    rng = np.random.default_rng(2)
    for size in (24, 48, 64):
        for prompt in world.all_prompts()[::13]:
            image = world.render_prompt(prompt, rng, size=size)
            assert verifier.score(image, prompt) == 1.0, (size, prompt)


def test_training_prompts_as_floats_score_one():
    rng = np.random.default_rng(3)
    for prompt in world.split_prompts()["train"][::5]:
        image = world.render_prompt(prompt, rng).astype(np.float32) / 255
        assert verifier.score(image, prompt) == 1.0


OTHER = {"left": "right", "right": "left", "above": "below", "below": "above"}
VALID = frozenset(world.all_prompts())


def mutations(prompt):
    """Hand-written edits of a prompt: (kind, edited prompt) for every valid one."""
    words = prompt.split()
    out = []
    for i, word in enumerate(words):
        if word in world.COLOURS:
            for colour in world.COLOURS:
                if colour != word:
                    out.append(("colour", words[:i] + [colour] + words[i + 1:]))
        singular = word[:-1] if word.endswith("s") else word
        if singular in world.SHAPES:
            for shape in world.SHAPES:
                if shape != singular:
                    noun = shape + ("s" if word.endswith("s") else "")
                    out.append(("shape", words[:i] + [noun] + words[i + 1:]))
        if word in OTHER:
            out.append(("relation", words[:i] + [OTHER[word]] + words[i + 1:]))
    if words[0] in ("two", "three") or (words[0] == "a" and len(words) <= 4):
        noun = words[-1].rstrip("s")
        for count in ("a", "two", "three"):
            if count != words[0]:
                out.append(("count", [count, *words[1:-1], noun if count == "a" else noun + "s"]))
    return [(kind, " ".join(w)) for kind, w in out if " ".join(w) in VALID]


def test_mismatched_prompts_score_clearly_lower():
    rng = np.random.default_rng(4)
    scores = {"colour": [], "shape": [], "count": [], "relation": []}
    for prompt in world.all_prompts()[::2]:
        image = world.render_prompt(prompt, rng)
        for kind, other in mutations(prompt):
            value = verifier.score(image, other)
            assert value < 1.0, (prompt, other)
            scores[kind].append(value)
    assert all(len(v) > 50 for v in scores.values())
    means = {kind: float(np.mean(v)) for kind, v in scores.items()}
    assert means["colour"] < 0.25  # the drawn colour is now an extra object
    assert means["shape"] < 0.45
    assert means["count"] < 0.55  # ratios 1/3 … 2/3
    assert means["relation"] == 0.5  # the objects are right, the relation is not
    assert float(np.mean(np.concatenate(list(scores.values())))) < 0.5


# ---------------------------------------------------------------------------------------------
# Quality
# ---------------------------------------------------------------------------------------------


def test_quality_exposes_noise():
    rng = np.random.default_rng(5)
    uniform = rng.random((32, 32, 3))
    assert verifier.quality(uniform) < 0.5
    # Salt-and-pepper in exact palette colours: on-palette, but speckled.
    palette = np.array([(0, 0, 0), RED, GREEN, BLUE, YELLOW, WHITE], np.uint8)
    speckle = palette[rng.integers(6, size=(32, 32))]
    assert verifier.quality(speckle) < 0.5
    clean = world.render_prompt("two red circles", rng)
    assert verifier.quality(clean) == 1.0
    # Gaussian noise on a rendered image: quality falls as the noise grows.
    noisy = [verifier.quality(np.clip(clean / 255 + rng.normal(0, sigma, clean.shape), 0, 1))
             for sigma in (0.05, 0.2, 0.4)]
    assert noisy[0] > 0.95 and noisy[0] > noisy[1] > noisy[2]
    assert noisy[2] < 0.5


def test_quality_hand_made():
    image = one_red_square()
    image[20, 20] = (128, 128, 128)  # one off-palette pixel
    assert verifier.quality(image) == pytest.approx(1 - 1 / 1024)
    image[25, 25] = GREEN  # one isolated on-palette pixel
    assert verifier.quality(image) == pytest.approx(1 - 2 / 1024)
    image[0, 0:3] = BLUE  # a 3 px speck at the border (< MIN_AREA)
    assert verifier.quality(image) == pytest.approx(1 - 5 / 1024)
    image[0, 3] = BLUE  # now 4 px: an object, not noise
    assert verifier.quality(image) == pytest.approx(1 - 2 / 1024)


def test_batches():
    rng = np.random.default_rng(6)
    prompts = world.all_prompts()[::100]
    images = np.stack([world.render_prompt(p, rng) for p in prompts])
    np.testing.assert_array_equal(verifier.score_batch(images, prompts), np.ones(len(prompts)))
    shifted = prompts[1:] + prompts[:1]
    expected = [verifier.score(img, p) for img, p in zip(images, shifted)]
    np.testing.assert_allclose(verifier.score_batch(images, shifted), expected)
    assert verifier.score_batch(images, shifted).dtype == np.float32
    np.testing.assert_array_equal(verifier.quality_batch(images), np.ones(len(prompts)))
    with pytest.raises(ValueError, match="prompts"):
        verifier.score_batch(images, prompts[:2])


def test_object_counts_hand_drawn_and_rendered():
    """Detected objects, the unrecognised among them (an elongated bar, a square with a hole) and
    the objects the prompt asks for, counted by hand."""
    image = blank()
    image[3:10, 3:10] = RED             # a square
    image[15:26, 15:26][disk(5)] = BLUE  # a circle
    image[28:30, 2:14] = GREEN          # a 2 × 12 bar: elongated, no shape of the world
    image[14:22, 2:10] = YELLOW         # an 8 × 8 square ...
    image[16:20, 4:8] = 0               # ... with a hole: not solid
    image[0, 31] = WHITE                # a 1 px speck: noise, not an object
    rng = np.random.default_rng(0)
    prompts = ["two red squares", "a red square left of a blue circle"]
    rendered = world.render_prompt(prompts[1], rng)
    counts = verifier.object_counts_batch(np.stack([image, rendered]), prompts)
    assert {k: v.tolist() for k, v in counts.items()} == {
        "objects": [4, 2], "unrecognised_objects": [2, 0], "objects_asked": [2, 2]}
    assert all(v.dtype == np.int32 for v in counts.values())
    with pytest.raises(ValueError, match="prompts"):
        verifier.object_counts_batch(image[None], prompts)
