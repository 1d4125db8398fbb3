"""tasks/held_out.py's per-category scores (Evaluation.by_category, category_table), by hand."""

import numpy as np

from g2rpo_jax.data import world
from g2rpo_jax.tasks import held_out


def _evaluation():
    # 3 prompts × 2 samples; prompts 0 and 2 are "position", prompt 1 "colors".
    per_image = {"in_domain": np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]], np.float32),
                 "quality": np.array([[1.0, 1.0], [0.8, 0.6], [1.0, 0.6]], np.float32)}
    return held_out.Evaluation(per_image, np.zeros((1, 2, 4, 4, 3)), {},
                               ("position", "colors", "position"),
                               ("single_object", "colors", "position"))


def test_by_category_averages_each_categorys_prompts_in_the_given_order():
    by_category = _evaluation().by_category()
    assert list(by_category) == ["single_object", "colors", "position"]
    assert by_category["single_object"] is None   # no prompt of it
    assert by_category["colors"]["in_domain"] == 0.5
    assert np.isclose(by_category["colors"]["quality"], 0.7)
    assert by_category["position"]["in_domain"] == 0.25     # (1 + 0 + 0 + 0) / 4
    assert np.isclose(by_category["position"]["quality"], 0.9)   # (1 + 1 + 1 + 0.6) / 4


def test_by_category_is_empty_without_categories():
    evaluation = held_out.Evaluation({"in_domain": np.ones((2, 1))}, np.zeros((1, 1, 4, 4, 3)))
    assert evaluation.by_category() == {}


def test_category_table_is_genevals_layout():
    evaluation = _evaluation()
    lines = held_out.category_table([("base", evaluation.means(), evaluation.by_category())])
    assert lines[0] == "| held-out score | overall | single_object | colors | position |"
    assert lines[2] == "| in_domain (base) | 0.3333 | — | 0.5000 | 0.2500 |"
    assert lines[3] == "| quality (base) | 0.8333 | — | 0.7000 | 0.9000 |"


def test_score_images_applies_the_strict_verifier_rule():
    one = np.zeros((32, 32, 3), np.uint8)
    one[2:9, 2:9][world.shape_mask("circle", 3)] = (255, 0, 0)
    two = one.copy()
    two[20:27, 20:27][world.shape_mask("circle", 3)] = (255, 0, 0)
    images = np.stack([one, two])[None]                               # [P = 1, M = 2, H, W, 3]
    lenient = held_out.score_images(images, ["a red circle"], ["in_domain"])["in_domain"]
    strict = held_out.score_images(images, ["a red circle"], ["in_domain"],
                                   strict=True)["in_domain"]
    # Two red circles for "a red circle": colour 1/2, shape 1/2; strictly the second is extra.
    np.testing.assert_allclose(lenient, [[1.0, 0.5]])
    np.testing.assert_allclose(strict, [[1.0, 0.25]])
