"""The learned judge: the shipped file loads and tells matching from mismatched prompts on fresh
images of held-out prompts, its jit reward equals the eager one, files round-trip."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.data import world
from g2rpo_jax.models.weights import CheckpointMismatchError
from g2rpo_jax.rewards import judge as judge_lib
from g2rpo_jax.rewards import verifier


@pytest.fixture(scope="module")
def shipped():
    return judge_lib.load_judge()


def sims(judge, tokenizer, images, prompts):
    ids, mask = tokenizer.encode(prompts)
    return np.asarray(judge_lib.similarity(judge, jnp.asarray(images), ids, mask))


def test_shipped_judge_loads_with_its_evaluation(shipped):
    judge, tokenizer = shipped
    assert isinstance(judge, judge_lib.Judge)
    assert tokenizer.vocabulary[1:] == world.word_vocabulary()
    assert tokenizer.max_length == world.MAX_PROMPT_WORDS
    config = judge_lib.state_io.read_config(judge_lib.DEFAULT_JUDGE_PATH)
    assert judge_lib.JudgeConfig.from_dict(config["judge"]) == judge.cfg
    assert config["eval"]["clean"]["top1"] > 0.5
    assert "scripts/train_judge.py" in config["train"]["command"]


def test_matching_prompt_beats_a_mismatched_one_on_held_out_prompts(shipped):
    judge, tokenizer = shipped
    rng = np.random.default_rng(2024)
    held_out = world.split_prompts()["held_out"]
    everything = world.all_prompts()
    prompts = list(rng.choice(held_out, 50, replace=False))
    images = np.stack([world.render_prompt(p, rng) for p in prompts])
    others = []
    for image in images:  # a random prompt the image does not satisfy
        while verifier.score(image, other := str(rng.choice(everything))) == 1.0:
            pass
        others.append(other)
    own, other = sims(judge, tokenizer, images, prompts), sims(judge, tokenizer, images, others)
    assert np.mean(own > other) >= 0.9, np.mean(own > other)
    assert own.mean() > other.mean() + 0.3, (own.mean(), other.mean())


def test_word_order_matters(shipped):
    judge, tokenizer = shipped
    rng = np.random.default_rng(7)
    pairs = [("a red circle left of a blue square", "a blue square left of a red circle"),
             ("a green triangle above a yellow circle", "a yellow circle above a green triangle"),
             ("a white square below a red square", "a red square below a white square")]
    ids, mask = tokenizer.encode([p for pair in pairs for p in pair])
    text = np.asarray(judge.encode_text(ids, mask))
    for k in range(len(pairs)):
        assert text[2 * k] @ text[2 * k + 1] < 0.95
    wins = []
    for prompt, swapped in pairs:
        images = np.stack([world.render_prompt(prompt, rng) for _ in range(8)])
        wins.append(sims(judge, tokenizer, images, [prompt] * 8)
                    > sims(judge, tokenizer, images, [swapped] * 8))
    assert np.mean(wins) >= 0.75, np.mean(wins)


def test_blank_image_scores_below_hand_drawn_three_red_squares(shipped):
    judge, tokenizer = shipped
    drawn = np.zeros((32, 32, 3), np.uint8)
    for top, left in ((4, 4), (4, 20), (20, 12)):  # three 7×7 red squares, apart
        drawn[top:top + 7, left:left + 7] = (255, 0, 0)
    assert verifier.score(drawn, "three red squares") == 1.0
    blank = np.zeros_like(drawn)
    reward = judge_lib.score_prompts(judge, tokenizer, np.stack([blank, drawn]),
                                     ["three red squares"] * 2)
    assert 0.0 <= reward.min() and reward.max() <= 1.0
    assert reward[1] > reward[0] + 0.3, reward
    # and the drawing matches its own prompt better than a changed count or colour
    others = judge_lib.score_prompts(judge, tokenizer, np.stack([drawn] * 2),
                                     ["a red square", "three blue squares"])
    assert (reward[1] > others).all(), (reward[1], others)


def test_jax_judge_fn_under_jit_and_vmap_matches_eager(shipped):
    judge, tokenizer = shipped
    rng = np.random.default_rng(3)
    prompts = world.split_prompts()["held_out"][:12]
    pid = rng.integers(len(prompts), size=(2, 3))
    images = np.stack([world.render_prompt(prompts[i], rng) for i in pid.reshape(-1)])
    images = (images.astype(np.float32) / 255.0).reshape(2, 3, 32, 32, 3)
    fn = judge_lib.jax_judge_fn(judge, tokenizer, prompts)
    got = jax.jit(fn)(images, pid)
    assert got.shape == (2, 3) and got.dtype == jnp.float32
    ids, mask = tokenizer.encode([prompts[i] for i in pid.reshape(-1)])
    want = judge_lib.score(judge, images.reshape(-1, 32, 32, 3), ids, mask)
    np.testing.assert_allclose(np.asarray(got).reshape(-1), np.asarray(want), atol=1e-5)
    np.testing.assert_allclose(jax.vmap(fn)(images, pid), got, atol=1e-5)
    # uint8 images read as /255; ids outside the table give NaN
    np.testing.assert_allclose(fn(np.round(images * 255).astype(np.uint8), pid), got, atol=1e-5)
    bad = np.asarray(fn(images[:1], np.array([[0, -1, len(prompts)]])))
    assert np.isfinite(bad[0, 0]) and np.isnan(bad[0, 1:]).all()


def test_save_load_round_trip_is_exact(tmp_path):
    cfg = judge_lib.JudgeConfig(conv_channels=(8, 16), head_width=16, text_width=16,
                                text_depth=1, text_heads=2, embed_dim=8)
    judge = judge_lib.Judge(cfg, rngs=nnx.Rngs(5))
    path = tmp_path / "judge.safetensors"
    judge_lib.save_judge(path, judge, {"eval": {"top1": 0.5}})
    loaded, tokenizer = judge_lib.load_judge(path)
    assert loaded.cfg == cfg and tokenizer.vocab_size == len(world.word_vocabulary()) + 1
    want = dict(nnx.to_flat_state(nnx.state(judge, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k].get_value()),
                                      np.asarray(want[k].get_value()))
    assert judge_lib.state_io.read_config(path)["eval"] == {"top1": 0.5}
    # a file for another config is named as a mismatch
    other = judge_lib.JudgeConfig(conv_channels=(8, 16), head_width=32, text_width=16,
                                  text_depth=1, text_heads=2, embed_dim=8)
    judge_lib.save_judge(tmp_path / "other.safetensors", judge_lib.Judge(other, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: judge_lib.Judge(cfg, rngs=nnx.Rngs(0))))
    with pytest.raises(CheckpointMismatchError, match="head_width|image_hidden"):
        judge_lib.state_io.load(tmp_path / "other.safetensors", abstract, "judge")


def test_missing_file_names_the_training_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/train_judge.py"):
        judge_lib.load_judge(tmp_path / "nowhere.safetensors")


def test_unknown_word_is_an_error(shipped):
    judge, tokenizer = shipped
    with pytest.raises(ValueError, match="purple"):
        judge_lib.jax_judge_fn(judge, tokenizer, ["a red circle", "a purple circle"])
    with pytest.raises(ValueError, match="purple"):
        judge_lib.score_prompts(judge, tokenizer, np.zeros((1, 32, 32, 3)), ["a purple circle"])


def test_config_dict_round_trip_and_checks():
    cfg = judge_lib.JudgeConfig()
    assert judge_lib.JudgeConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="Unknown JudgeConfig"):
        judge_lib.JudgeConfig.from_dict({"widht": 3})
    with pytest.raises(ValueError, match="divisible"):
        judge_lib.JudgeConfig(text_width=30, text_heads=4)
