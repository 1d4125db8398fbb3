"""Rewards: the embedded world's verifier and judge, and the CLIP-based preference models.

`get(name, path, **kw) -> reward_fn(images [B, H, W, 3] in [0, 1], prompts) -> [B]` is the
registry (`rewards.registry`: hps, clip_score, pickscore, aesthetic, remote, and what
`register` adds); it is imported lazily so that the verifier does not pull in CLIP.
"""


def get(name: str, path=None, **kw):
    from g2rpo_jax.rewards import registry

    return registry.get(name, path, **kw)
