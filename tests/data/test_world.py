"""The embedded world: grammar, splits, parsing, scene sampling and rendering (hand-made cases)."""

import numpy as np
import pytest

from g2rpo_jax.data import world
from g2rpo_jax.data.world import Constraints, ObjectSpec, Relation

RGB = {
    "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
    "white": (255, 255, 255),
}
# Pixel areas of the rendered shapes on a 32 px canvas, counted by hand from the documented
# footprints (square (2r+1)²; circle dx² + dy² ≤ r² + r; triangle rows 1, 3, 3, 5, 5, ...).
AREA = {
    ("square", "small"): 49, ("square", "large"): 121,
    ("circle", "small"): 37, ("circle", "large"): 97,
    ("triangle", "small"): 31, ("triangle", "large"): 71,
}
VOCABULARY = [
    "a", "above", "below", "blue", "circle", "circles", "green", "large", "left", "of", "red",
    "right", "small", "square", "squares", "three", "triangle", "triangles", "two", "white",
    "yellow",
]


def colour_pixels(image, colour):
    return np.all(image == RGB[colour], axis=-1)


# ---------------------------------------------------------------------------------------------
# Vocabulary, prompts and splits
# ---------------------------------------------------------------------------------------------


def test_palette_is_the_documented_one():
    assert world.SHAPES == ("circle", "square", "triangle")
    assert world.SIZES == ("small", "large")
    assert set(world.PALETTE) == set(RGB)
    for name, rgb in RGB.items():
        assert world.PALETTE[name].dtype == np.uint8
        assert tuple(int(v) for v in world.PALETTE[name]) == rgb
    assert tuple(int(v) for v in world.BACKGROUND) == (0, 0, 0)


def test_word_vocabulary():
    assert world.word_vocabulary() == VOCABULARY


def test_all_prompts_finite_unique_sorted_and_in_the_vocabulary():
    prompts = world.all_prompts()
    # 3 counts × 3 size options × 5 colours × 3 shapes + 15 × 14 ordered pairs × 4 relations.
    assert len(prompts) == 135 + 840
    assert len(set(prompts)) == len(prompts)
    assert prompts == sorted(prompts)
    for p in ("a red circle", "two red circles", "three small white triangles",
              "a large blue square", "a blue square left of a yellow triangle",
              "a red circle above a red square"):
        assert p in prompts
    for p in ("a red circle left of a red circle", "one red circle", "a small red circle left "
              "of a blue square"):
        assert p not in prompts
    assert {w for p in prompts for w in p.split()} == set(VOCABULARY)
    assert max(len(p.split()) for p in prompts) == world.MAX_PROMPT_WORDS == 8


def test_every_prompt_round_trips_through_the_parser():
    for p in world.all_prompts():
        assert world.format_prompt(world.parse_prompt(p)) == p


def test_split_is_disjoint_complete_deterministic_and_covers_the_vocabulary():
    split = world.split_prompts(seed=0, held_out_fraction=0.2)
    assert list(split) == ["train", "held_out"]
    train, held = split["train"], split["held_out"]
    assert train == sorted(train) and held == sorted(held)
    assert train and held
    assert not set(train) & set(held)
    assert sorted(train + held) == world.all_prompts()
    assert len(train) == 780 and len(held) == 195  # 27 count + 84 relation pairs held out
    assert {w for p in train for w in p.split()} == set(VOCABULARY)
    # Both kinds of prompts are held out.
    assert any(" of " in p or "above" in p or "below" in p for p in held)
    assert any(p.split()[0] in ("two", "three") for p in held)
    assert world.split_prompts(seed=0, held_out_fraction=0.2) == split
    assert world.split_prompts(seed=1)["held_out"] != held


def test_split_keeps_mirrored_relations_together():
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    for seed in (0, 3):
        split = world.split_prompts(seed=seed)
        side = {p: name for name, ps in split.items() for p in ps}
        # "a red circle left of a blue square" means "a blue square right of a red circle".
        for p, name in side.items():
            for kind, inverse in mirror.items():
                if f" {kind} " in p:
                    a, b = p.split(f" {kind} ")
                    assert side[f"{b} {inverse} {a}"] == name


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.99])
def test_split_extreme_fractions(fraction):
    split = world.split_prompts(seed=2, held_out_fraction=fraction)
    assert split["train"] and split["held_out"]
    assert not set(split["train"]) & set(split["held_out"])
    assert {w for p in split["train"] for w in p.split()} == set(VOCABULARY)


def test_split_rejects_bad_fractions():
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="held_out_fraction"):
            world.split_prompts(held_out_fraction=fraction)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, expected", [
    ("a red circle", Constraints((ObjectSpec(1, "red", "circle", None),))),
    ("two red circles", Constraints((ObjectSpec(2, "red", "circle"),))),
    ("a large blue square", Constraints((ObjectSpec(1, "blue", "square", "large"),))),
    ("three small white triangles", Constraints((ObjectSpec(3, "white", "triangle", "small"),))),
    ("a blue square left of a yellow triangle",
     Constraints((ObjectSpec(1, "blue", "square"), ObjectSpec(1, "yellow", "triangle")),
                 Relation("left of", 0, 1))),
    ("a green circle below a green triangle",
     Constraints((ObjectSpec(1, "green", "circle"), ObjectSpec(1, "green", "triangle")),
                 Relation("below", 0, 1))),
    ("  A Red  circle RIGHT of a red square ",
     Constraints((ObjectSpec(1, "red", "circle"), ObjectSpec(1, "red", "square")),
                 Relation("right of", 0, 1))),
])
def test_parse_hand_written_prompts(prompt, expected):
    parsed = world.parse_prompt(prompt)
    assert parsed == expected
    assert parsed.num_objects == sum(s.count for s in expected.objects)


@pytest.mark.parametrize("prompt, word", [
    ("two purple circles", "purple"),
    ("a red hexagon", "hexagon"),
    ("one red circle", "one"),
    ("a red circle next to a blue square", "next"),
    ("a medium red square", "medium"),
])
def test_parse_unknown_word_names_it_and_the_vocabulary(prompt, word):
    with pytest.raises(ValueError) as info:
        world.parse_prompt(prompt)
    message = str(info.value)
    assert repr(word) in message
    assert "triangle" in message and "above" in message  # the vocabulary is listed


@pytest.mark.parametrize("prompt", [
    "", "red circle", "a red circles", "two red circle", "a circle red", "two red",
    "a red circle left of", "left of a blue square", "a red circle left of a red circle",
    "a small red circle left of a blue square", "two red circles left of a blue square",
    "a red circle above", "red a circle", "a red circle a blue square", "of", "a a red circle",
])
def test_parse_malformed_prompt_names_the_prompt(prompt):
    with pytest.raises(ValueError, match="Malformed prompt") as info:
        world.parse_prompt(prompt)
    assert repr(prompt) in str(info.value)


# ---------------------------------------------------------------------------------------------
# Scenes and rendering
# ---------------------------------------------------------------------------------------------


def test_shape_footprints_are_the_documented_ones():
    # Drawn by hand: a small (r = 3) triangle and circle.
    triangle = np.array([
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
    ], bool)
    circle = np.array([
        [0, 0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0, 0],
    ], bool)
    np.testing.assert_array_equal(world.shape_mask("triangle", 3), triangle)
    np.testing.assert_array_equal(world.shape_mask("circle", 3), circle)
    assert world.shape_mask("square", 3).all() and world.shape_mask("square", 3).shape == (7, 7)
    for (shape, size), area in AREA.items():
        assert world.shape_mask(shape, world.object_radius(size)).sum() == area


def test_render_uses_exact_palette_colours_and_stays_inside_the_margin():
    rng = np.random.default_rng(0)
    allowed = {(0, 0, 0), *RGB.values()}
    for prompt in world.all_prompts()[::7]:
        image = world.render_prompt(prompt, rng)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        assert {tuple(int(v) for v in px) for px in image.reshape(-1, 3)} <= allowed
        used = {c for c in RGB if colour_pixels(image, c).any()}
        assert used == {s.colour for s in world.parse_prompt(prompt).objects}
        border = np.ones((32, 32), bool)
        border[2:-2, 2:-2] = False
        assert not image[border].any()  # EDGE_MARGIN = 2 px of background all round


@pytest.mark.parametrize("prompt, colour, shape, n, size", [
    ("a red circle", "red", "circle", 1, None),
    ("two small red squares", "red", "square", 2, "small"),
    ("three large blue circles", "blue", "circle", 3, "large"),
    ("three small white triangles", "white", "triangle", 3, "small"),
    ("two large yellow triangles", "yellow", "triangle", 2, "large"),
    ("three green squares", "green", "square", 3, None),
    ("a large white square", "white", "square", 1, "large"),
])
def test_render_count_prompts_by_pixel_counts(prompt, colour, shape, n, size):
    rng = np.random.default_rng(1)
    for _ in range(20):
        image = world.render_prompt(prompt, rng)
        pixels = int(colour_pixels(image, colour).sum())
        possible = {k * AREA[shape, "small"] + (n - k) * AREA[shape, "large"]
                    for k in range(n + 1)} if size is None else {n * AREA[shape, size]}
        assert pixels in possible
        assert int(image.any(-1).sum()) == pixels  # nothing else drawn
        scene = world.sample_scene(prompt, rng)
        assert len(scene.objects) == n
        assert all(size is None or o.size == size for o in scene.objects)


def test_unsized_prompts_get_both_sizes():
    rng = np.random.default_rng(2)
    counts = {int(colour_pixels(world.render_prompt("a red square", rng), "red").sum())
              for _ in range(40)}
    assert counts == {49, 121}


def test_scene_objects_never_touch():
    rng = np.random.default_rng(3)
    for prompt in ("three large red squares", "three large white circles", "three blue squares"):
        for _ in range(30):
            scene = world.sample_scene(prompt, rng)
            assert len(scene.objects) == 3
            boxes = [o.box for o in scene.objects]
            for i in range(3):
                for j in range(i + 1, 3):
                    (t1, l1, b1, r1), (t2, l2, b2, r2) = boxes[i], boxes[j]
                    gap_x = max(l2 - r1, l1 - r2) - 1
                    gap_y = max(t2 - b1, t1 - b2) - 1
                    assert max(gap_x, gap_y) >= 2
            # Three same-coloured squares: exactly 3 × area red pixels, so no overlap.
            image = world.render(scene)
            colour = scene.objects[0].colour
            assert int(colour_pixels(image, colour).sum()) == sum(
                AREA[o.shape, o.size] for o in scene.objects)


def _pixel_box(mask):
    rows, cols = np.nonzero(mask)
    return rows.min(), cols.min(), rows.max(), cols.max()


@pytest.mark.parametrize("prompt", [
    "a blue square left of a yellow triangle", "a red circle right of a green square",
    "a white triangle above a blue circle", "a yellow square below a red triangle",
])
def test_relation_scenes_satisfy_the_relation_with_a_margin(prompt):
    subject_colour, object_colour = prompt.split()[1], prompt.split()[-2]
    rng = np.random.default_rng(4)
    for _ in range(50):
        image = world.render_prompt(prompt, rng)
        st, sl, sb, sr = _pixel_box(colour_pixels(image, subject_colour))
        ot, ol, ob, orr = _pixel_box(colour_pixels(image, object_colour))
        if "left of" in prompt:
            assert ol - sr - 1 >= 3
        elif "right of" in prompt:
            assert sl - orr - 1 >= 3
        elif "above" in prompt:
            assert ot - sb - 1 >= 3
        else:
            assert st - ob - 1 >= 3


def test_same_colour_relation_scene_geometry():
    rng = np.random.default_rng(5)
    for _ in range(30):
        scene = world.sample_scene("a red circle above a red square", rng)
        subject, obj = scene.objects
        assert (subject.shape, obj.shape) == ("circle", "square")
        assert obj.y - obj.radius - (subject.y + subject.radius) - 1 >= 3


def test_rendering_is_deterministic_given_the_seed():
    prompt = "a blue square left of a yellow triangle"
    a = [world.render_prompt(prompt, np.random.default_rng(7)) for _ in range(2)]
    np.testing.assert_array_equal(a[0], a[1])
    stream1, stream2 = np.random.default_rng(8), np.random.default_rng(8)
    for p in world.all_prompts()[:40]:
        np.testing.assert_array_equal(world.render_prompt(p, stream1),
                                      world.render_prompt(p, stream2))
    different = {world.render_prompt(prompt, np.random.default_rng(s)).tobytes()
                 for s in range(10)}
    assert len(different) > 5


def test_render_by_hand_scene():
    scene = world.Scene("a red square left of a blue circle", 32, (
        world.SceneObject("red", "square", "small", x=8, y=10, radius=3),
        world.SceneObject("blue", "circle", "small", x=20, y=10, radius=3),
    ))
    image = world.render(scene, size=32)
    expected = np.zeros((32, 32, 3), np.uint8)
    expected[7:14, 5:12] = RGB["red"]
    circle = (np.arange(-3, 4)[:, None] ** 2 + np.arange(-3, 4)[None, :] ** 2) <= 12
    expected[7:14, 17:24][circle] = RGB["blue"]
    np.testing.assert_array_equal(image, expected)
    with pytest.raises(ValueError, match="32 px"):
        world.render(scene, size=64)


def test_other_canvas_sizes():
    rng = np.random.default_rng(9)
    image = world.render_prompt("three large red squares", rng, size=64)
    assert image.shape == (64, 64, 3)
    # Large radius 10 at 64 px: 21² pixels per square.
    assert int(colour_pixels(image, "red").sum()) == 3 * 21 * 21
    with pytest.raises(ValueError, match="at least"):
        world.render_prompt("a red circle", rng, size=16)


def test_placement_grid_puts_every_box_on_the_lattice():
    """grid=4: every box's top-left corner is 2 + 4·j (the edge margin plus multiples of the
    pitch) on both axes; every prompt still places (and round-trips through the verifier, in
    tests/rewards), and the grid reaches more than one lattice position."""
    rng = np.random.default_rng(0)
    corners = set()
    for prompt in world.all_prompts()[::7]:
        for _ in range(2):
            scene = world.sample_scene(prompt, rng, grid=4)
            for obj in scene.objects:
                top, left, _, _ = obj.box
                assert (top - 2) % 4 == 0 and (left - 2) % 4 == 0, (prompt, obj)
                corners.add((top, left))
    assert len(corners) > 10
    # The same object at two lattice positions differs only by a whole-token shift: the pixels
    # of its 4×4 tokens are the same patterns.
    scene = world.sample_scene("a large red triangle", np.random.default_rng(1), grid=4)
    (obj,) = scene.objects
    image = world.render(scene)
    shifted = world.render(world.Scene(scene.prompt, 32, (world.SceneObject(
        obj.colour, obj.shape, obj.size, obj.x + 4 if obj.x + 4 + obj.radius < 30 else obj.x - 4,
        obj.y, obj.radius),)))
    tokens = lambda im: {im[r:r + 4, c:c + 4].tobytes() for r in range(0, 32, 4)
                         for c in range(0, 32, 4)}
    assert tokens(image) == tokens(shifted)


def test_placement_grid_must_be_positive():
    with pytest.raises(ValueError, match="grid must be at least 1"):
        world.sample_scene("a red circle", np.random.default_rng(0), grid=0)


@pytest.mark.parametrize("prompt, category", [
    ("a red circle", "colors"),
    ("a large blue square", "colors"),
    ("two red circles", "counting"),
    ("three small white triangles", "counting"),
    ("a blue square left of a yellow triangle", "position"),
    ("a red circle below a red square", "position"),
])
def test_prompts_fall_in_genevals_categories(prompt, category):
    assert world.category(prompt) == category
    assert category in world.GENEVAL_CATEGORIES


def test_every_prompt_has_one_of_three_categories():
    counts = {}
    for prompt in world.all_prompts():
        counts[world.category(prompt)] = counts.get(world.category(prompt), 0) + 1
    # 45 one-object and 90 two- or three-object count prompts, 840 relation prompts
    # (the module docstring's arithmetic).
    assert counts == {"colors": 45, "counting": 90, "position": 840}


# ---------------------------------------------------------------------------------------------
# Noisy captions
# ---------------------------------------------------------------------------------------------

ALL_NOISE = dict(colour=1.0, count=1.0, relation=1.0)


def test_no_noise_keeps_every_caption():
    rng = np.random.default_rng(0)
    for prompt in world.all_prompts():
        assert world.noisy_caption(prompt, rng, dict(colour=0.0, count=0.0, relation=0.0)) == prompt


def test_certain_noise_changes_each_named_word_and_nothing_else():
    rng = np.random.default_rng(0)
    for prompt in world.all_prompts()[::7]:
        old = world.parse_prompt(prompt)
        new = world.parse_prompt(world.noisy_caption(prompt, rng, ALL_NOISE))
        for a, b in zip(old.objects, new.objects):
            assert a.colour != b.colour and (a.shape, a.size) == (b.shape, b.size)
        if old.relation is None:
            assert old.objects[0].count != new.objects[0].count
        else:
            assert old.relation.kind != new.relation.kind
            assert (new.objects[0].colour, new.objects[0].shape) != (
                new.objects[1].colour, new.objects[1].shape)


def test_only_the_named_kinds_change():
    rng = np.random.default_rng(1)
    for _ in range(50):
        caption = world.noisy_caption("two red circles", rng, dict(count=1.0))
        assert caption in ("a red circle", "three red circles")
        caption = world.noisy_caption("a red circle above a blue square", rng, dict(relation=1.0))
        assert caption in ("a red circle below a blue square", "a red circle left of a blue square",
                           "a red circle right of a blue square")


def test_colour_noise_has_its_rate_and_picks_other_colours_uniformly():
    rng = np.random.default_rng(2)
    n = 4000
    captions = [world.noisy_caption("a red circle", rng, dict(colour=0.3)) for _ in range(n)]
    changed = [c for c in captions if c != "a red circle"]
    # Binomial(4000, 0.3): std 29, so ±4 std is ±116.
    assert abs(len(changed) - 0.3 * n) < 116
    counts = {c: changed.count(f"a {c} circle") for c in ("green", "blue", "yellow", "white")}
    assert sum(counts.values()) == len(changed)
    expected = len(changed) / 4
    assert all(abs(v - expected) < 4 * np.sqrt(expected) for v in counts.values()), counts


def test_noisy_captions_stay_in_the_allowed_set():
    splits = world.split_prompts()
    train = frozenset(splits["train"])
    rng = np.random.default_rng(3)
    for prompt in splits["train"][::5]:
        assert world.noisy_caption(prompt, rng, ALL_NOISE, train) in train
    # With only the prompt itself allowed, nothing can change.
    assert world.noisy_caption("two red circles", rng, ALL_NOISE,
                               {"two red circles"}) == "two red circles"


@pytest.mark.parametrize("rates, match", [(dict(shape=0.5), "Unknown caption noise kinds"),
                                          (dict(colour=1.5), "must lie in")])
def test_noisy_caption_rejects_bad_rates(rates, match):
    with pytest.raises(ValueError, match=match):
        world.noisy_caption("a red circle", np.random.default_rng(0), rates)
