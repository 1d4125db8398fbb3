"""Learning happens: a short RL run from the shipped base overfits one fixed batch of the embedded
world (8 training prompts, the same noise every iteration, 8 updates; `testing.learning`), for
G²RPO and DanceGRPO.

The margins come from `python benchmarks/learning/learning_signal.py` (results in
benchmarks/results/learning_signal.json and docs/results.md, "Does it learn?"): over 5 seeds the
gain is well above each margin, while the flipped objective (what a flipped gradient sign does)
lowers the reward and zeroed advantages leave the parameters, and so the reward, unchanged.
"""

import pytest

from g2rpo_jax import parallel
from g2rpo_jax.testing import learning

# Training-reward gain after 8 updates that a run must exceed (see the module docstring).
MARGIN = {"g2rpo": 0.07, "dance_grpo": 0.025}


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["g2rpo", "dance_grpo"])
def test_rl_raises_the_training_reward_of_a_fixed_batch(mesh, algorithm):
    rewards = learning.fixed_prompt_run(algorithm, mesh, seed=0)
    gain = rewards[-1] - rewards[0]
    print(f"{algorithm}: training reward {' → '.join(f'{r:.3f}' for r in rewards)}")
    assert gain > MARGIN[algorithm], (algorithm, rewards)


@pytest.mark.slow
def test_a_flipped_objective_lowers_the_training_reward(mesh):
    """The control: the same run minimising the reward must fail the margin above."""
    rewards = learning.fixed_prompt_run("g2rpo", mesh, seed=0, reward_scale=-1.0)
    assert rewards[-1] - rewards[0] < -MARGIN["g2rpo"], rewards
