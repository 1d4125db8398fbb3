"""The optimizer built from a config's `optimizer` section (config_lib.optimizer_config)."""

import numpy as np
import pytest

from g2rpo_jax import config_lib
from g2rpo_jax import optimizer as optimizer_lib


@pytest.mark.parametrize("schedule, steps, expected", [
    ("constant", (0, 5, 50), (1e-3, 1e-3, 1e-3)),
    ("warmup_constant", (0, 5, 50), (0.0, 5e-4, 1e-3)),
    ("warmup_cosine", (0, 10, 110), (0.0, 1e-3, 0.0)),
])
def test_learning_rate_schedules(schedule, steps, expected):
    config = config_lib.optimizer_config(learning_rate=1e-3, schedule=schedule,
                                         warmup_steps=10, decay_steps=110)
    lr = optimizer_lib.learning_rate_schedule(config)
    np.testing.assert_allclose([float(lr(s)) for s in steps], expected, atol=1e-9)


def test_optimizer_errors():
    with pytest.raises(ValueError, match="Unknown learning-rate schedule"):
        optimizer_lib.make_optimizer(config_lib.optimizer_config(schedule="magic"))
    with pytest.raises(ValueError, match="must exceed optimizer.warmup_steps"):
        optimizer_lib.make_optimizer(config_lib.optimizer_config(
            schedule="warmup_cosine", warmup_steps=10, decay_steps=10))
    with pytest.raises(ValueError, match="Unknown optimizer fields"):
        config_lib.optimizer_config(lr=1e-3)
