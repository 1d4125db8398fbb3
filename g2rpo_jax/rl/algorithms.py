"""Algorithms as data: G²RPO and the baselines are settings of one rollout/update machinery.

An `Algorithm` says which steps are stochastic, which are trained, which SDE step is used,
whether the group shares its start, and how advantages are formed. The train loop reads these
fields and never branches on an algorithm's name.

  rollout="singular"   (G²RPO) one shared ODE anchor per prompt; one SDE step at each k in
                       `branch_steps`; every branch finished at every granularity in Λ.
  rollout="trajectory" (DanceGRPO, Flow-GRPO, MixGRPO) every member runs its own trajectory,
                       SDE at every step or inside a sliding window, ODE elsewhere; the
                       trajectory's final reward is the advantage of each trained step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

ROLLOUTS = ("singular", "trajectory")


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One algorithm's settings (see the module docstring). Fields are static under jit."""

    rollout: str = "singular"
    sde_step: str = "flow_grpo"          # "flow_grpo" or "dance_grpo"
    eta: float = 0.7
    group_size: int = 12
    # singular:
    branch_steps: tuple[int, ...] = tuple(range(8))
    # Λ: the paper's {1, 2, 3} (the reference scripts use {1, 2}).
    granularities: tuple[int, ...] = (1, 2, 3)
    granularity_weights: tuple[float, ...] = (1.0, 1.0, 1.0)
    end_at_zero: bool = True              # False: the reference's x̂0 decode when λ misses 0
    packing: str = "pack"                 # continuation lanes: "pack" or "pad"
    max_lanes: int = 0                    # 0 = no bound
    antithetic: bool = False              # branch noise in ± pairs (variance reduction)
    # trajectory:
    shared_initial_noise: bool = True     # one x_T per group (DanceGRPO, MixGRPO)
    sde_window: int = 0                   # 0 = SDE at every step; > 0: MixGRPO's window size
    window_start: int = 0
    window_stride: int = 1                # steps the window moves per shift
    window_shift_every: int = 25          # iterations between shifts
    train_fraction: float = 1.0           # of the stochastic steps, trained each iteration
    # update:
    clip_range: float = 1e-4
    advantage_clip: float = 5.0
    advantage_std: bool = True            # divide by the group's std (GRPO) or only centre
    kl_beta: float = 0.0                  # Flow-GRPO's optional KL to the initial policy
    log_prob_reduce: str = "mean"         # "mean" (reference code) or "sum" (the density)

    def __post_init__(self):
        for name in ("branch_steps", "granularities", "granularity_weights"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"Unknown rollout {self.rollout!r}; use one of {ROLLOUTS}.")
        if self.group_size < 2:
            raise ValueError(f"group_size must be ≥ 2 for group-normalised advantages, got "
                             f"{self.group_size}.")
        if len(self.granularity_weights) != len(self.granularities):
            raise ValueError(f"granularity_weights {self.granularity_weights} must match "
                             f"granularities {self.granularities} one to one.")
        if not 0 < self.train_fraction <= 1:
            raise ValueError(f"train_fraction must be in (0, 1], got {self.train_fraction}.")
        if self.rollout == "singular" and not self.branch_steps:
            raise ValueError("A singular rollout needs at least one branch step.")
        if self.antithetic and (self.rollout != "singular" or self.group_size % 2):
            raise ValueError(f"antithetic=True needs a singular rollout and an even group_size; "
                             f"got rollout={self.rollout!r}, group_size={self.group_size}.")

    @classmethod
    def from_config(cls, config) -> "Algorithm":
        values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - names - {"name"}
        if unknown:
            raise ValueError(f"Unknown algorithm fields {sorted(unknown)}; known: {sorted(names)}.")
        return cls(**{k: v for k, v in values.items() if k in names})

    def validate(self, num_steps: int) -> None:
        """Checks the step sets against the schedule length T."""
        if self.rollout == "singular":
            bad = [k for k in self.branch_steps if not 0 <= k < num_steps - 1]
            if bad:
                raise ValueError(f"branch_steps {bad} outside [0, {num_steps - 2}] for "
                                 f"{num_steps} steps (a branch needs a step after it).")
        if self.sde_window > num_steps:
            raise ValueError(f"sde_window {self.sde_window} exceeds the {num_steps} steps.")

    # --- which steps ---------------------------------------------------------------------

    def num_stochastic_steps(self, num_steps: int) -> int:
        return self.sde_window if self.sde_window > 0 else num_steps

    def num_trained_steps(self, num_steps: int) -> int:
        """K: trained steps per iteration (static, so the update compiles once)."""
        if self.rollout == "singular":
            return len(self.branch_steps)
        return max(1, round(self.train_fraction * self.num_stochastic_steps(num_steps)))

    def window_start_at(self, iteration, num_steps: int):
        """MixGRPO's window start at an iteration (traced-friendly), clamped to fit."""
        shifts = jnp.asarray(iteration) // self.window_shift_every
        return jnp.minimum(self.window_start + shifts * self.window_stride,
                           num_steps - self.sde_window)

    def sde_mask(self, iteration, num_steps: int) -> jax.Array:
        """[T] bool: which steps of a trajectory rollout are stochastic at this iteration."""
        steps = jnp.arange(num_steps)
        if self.sde_window <= 0:
            return jnp.ones((num_steps,), bool)
        start = self.window_start_at(iteration, num_steps)
        return (steps >= start) & (steps < start + self.sde_window)

    def trained_steps(self, key: jax.Array, iteration, num_steps: int) -> jax.Array:
        """[K] int32 step indices trained this iteration (a random subset of the SDE steps)."""
        if self.rollout == "singular":
            return jnp.asarray(self.branch_steps, jnp.int32)
        count = self.num_stochastic_steps(num_steps)
        start = 0 if self.sde_window <= 0 else self.window_start_at(iteration, num_steps)
        order = jax.random.permutation(key, count)[:self.num_trained_steps(num_steps)]
        return (jnp.sort(order) + start).astype(jnp.int32)

    # --- cost ----------------------------------------------------------------------------

    def rollout_forward_passes(self, num_steps: int, plan=None) -> dict:
        """Transformer forward passes per prompt for one rollout, counted from the schedule.

        For "singular", `plan` is the ContinuationPlan; "useful" counts the calls the method
        needs, "computed" those the packed scan makes (idle lanes included).
        """
        if self.rollout == "trajectory":
            count = num_steps * self.group_size
            return {"useful": count, "computed": count}
        return {"useful": num_steps + self.group_size * plan.useful_steps,
                "computed": num_steps + self.group_size * plan.computed_steps}

    def update_forward_passes(self, num_steps: int) -> int:
        """Forward(+backward) passes per prompt for the update's log-probs (×2 with a KL ref)."""
        shared = 1 if self.rollout == "singular" else self.group_size
        return self.num_trained_steps(num_steps) * shared * (2 if self.kl_beta > 0 else 1)


# Presets (configs are data; config files pick one by name: `--config=file.py:dance_grpo`).

def _preset(**fields) -> ml_collections.ConfigDict:
    defaults = dataclasses.asdict(Algorithm())
    defaults.update(fields)
    return ml_collections.ConfigDict(defaults)


PRESETS = {
    # The paper's G²RPO is Algorithm's defaults.
    "g2rpo": dict(name="g2rpo", rollout="singular"),
    "g2rpo_no_mgai": dict(name="g2rpo_no_mgai", rollout="singular", granularities=(1,),
                          granularity_weights=(1.0,)),
    "dance_grpo": dict(name="dance_grpo", rollout="trajectory", sde_step="dance_grpo", eta=0.3,
                       shared_initial_noise=True, train_fraction=0.6),
    "flow_grpo": dict(name="flow_grpo", rollout="trajectory", sde_step="flow_grpo", eta=0.7,
                      shared_initial_noise=False, train_fraction=1.0, kl_beta=0.04),
    "mix_grpo": dict(name="mix_grpo", rollout="trajectory", sde_step="flow_grpo", eta=0.7,
                     shared_initial_noise=True, sde_window=4, window_stride=1,
                     window_shift_every=25, train_fraction=1.0),
}


def preset(name: str, **overrides) -> ml_collections.ConfigDict:
    """The config section of a named algorithm, with overrides."""
    if name not in PRESETS:
        raise ValueError(f"Unknown algorithm {name!r}; choose one of {sorted(PRESETS)}.")
    config = _preset(**PRESETS[name])
    config.update(overrides)
    return config


__all__ = ["Algorithm", "PRESETS", "preset"]
