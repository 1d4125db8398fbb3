"""The execution fields the ports share: dtype names, remat policies, stacked layers."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.models import execution


def test_dtype_names():
    assert execution.to_dtype("bfloat16") == jnp.bfloat16
    assert execution.to_dtype(jnp.float16) == jnp.float16  # dtypes pass through
    with pytest.raises(ValueError, match=r"Unknown dtype 'float8'.*'bfloat16'"):
        execution.to_dtype("float8")


def test_remat_policy_names():
    for name in execution.REMAT_POLICIES:
        execution.check_remat_policy(name)
    with pytest.raises(ValueError, match=r"Unknown remat_policy 'sometimes'.*'dots'"):
        execution.check_remat_policy("sometimes")


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs, kernel_metadata={"logical_axes": ("a", "b")})

    def __call__(self, x, y, scale):
        return jnp.tanh(self.linear(x)) * scale + y, y


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_scanned_and_unrolled_layers_agree(remat_policy):
    stack = execution.stacked(_Block, 3, nnx.Rngs(0))
    assert stack.linear.kernel.shape == (3, 4, 4)
    assert stack.linear.kernel.get_metadata()["logical_axes"] == ("layers", "a", "b")
    x, y = jnp.ones((2, 4)), jnp.full((2, 4), 0.5)

    def loss(stack, scan):
        out, _ = execution.run_stacked(stack, (x, y), (2.0,), 3, scan, remat_policy)
        return jnp.sum(out ** 2)

    scanned = jax.value_and_grad(loss)(stack, True)
    unrolled = jax.value_and_grad(loss)(stack, False)
    np.testing.assert_allclose(scanned[0], unrolled[0], rtol=1e-6)
    np.testing.assert_allclose(scanned[1].linear.kernel[...], unrolled[1].linear.kernel[...],
                               rtol=1e-5, atol=1e-6)
