"""Checks that every process of a multi-host job runs the same config.

Each worker of a pod parses its own command line; a worker started with an older checkout or
one flag more would compute something else and stall or corrupt the run much later. At start-up
every process publishes a hash of its config (without the `distributed` section, which differs
by design); when the hashes differ, process 0's config is broadcast and each process names the
fields where its own differs.
"""

from collections.abc import Mapping
import hashlib
import json

import jax
import numpy as np

# Sections that legitimately differ between processes.
PER_PROCESS = ("distributed",)


class ConfigMismatchError(ValueError):
    """The processes of one job were started with different configs."""


def config_json(config) -> str:
    """The config as canonical JSON (sorted keys), without the per-process sections."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    values = {k: v for k, v in values.items() if k not in PER_PROCESS}
    return json.dumps(values, sort_keys=True, default=repr)


def _flatten(values, prefix: str = "") -> dict:
    if not isinstance(values, Mapping):
        return {prefix: values}
    out = {}
    for key, value in values.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differing_fields(ours: str, reference: str) -> list[str]:
    """The dotted names of fields whose values differ between two `config_json` texts, with
    both values ("train.learning_rate: 1e-05 here, 2e-06 on process 0")."""
    mine, theirs = _flatten(json.loads(ours)), _flatten(json.loads(reference))
    missing = object()
    lines = []
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name, missing), theirs.get(name, missing)
        if a != b:
            shown = ["(absent)" if v is missing else json.dumps(v) for v in (a, b)]
            lines.append(f"{name}: {shown[0]} here, {shown[1]} on process 0")
    return lines


def _digest(text: str) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32).copy()


def check_same_config(config) -> None:
    """Raises ConfigMismatchError on every process if any process's config differs from
    process 0's (nothing with one process). The message names the processes and the fields.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = config_json(config)
    digests = np.asarray(multihost_utils.process_allgather(_digest(text)))   # [H, 8]
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if not differ:
        return
    encoded = np.frombuffer(text.encode(), np.uint8)
    length = int(np.max(multihost_utils.process_allgather(np.int64(len(encoded)))))
    padded = np.zeros(length, np.uint8)
    padded[:len(encoded)] = encoded
    reference = bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))).rstrip(b"\0")
    here = jax.process_index()
    fields = differing_fields(text, reference.decode()) if here in differ else []
    detail = ("; ".join(fields[:12]) + (f"; and {len(fields) - 12} more" if len(fields) > 12
                                         else "")) if fields else "see those processes' logs"
    raise ConfigMismatchError(
        f"The {jax.process_count()} processes of this job do not run the same config: "
        f"process(es) {differ} differ from process 0 ({detail}). Start every host with the "
        "same checkout and the same command line (launch/run.sh does); only the "
        "`distributed` section may differ.")
