"""Preemption notices (SIGTERM: TPU maintenance events, spot / preemptible VMs) seen at
iteration boundaries, with every process agreeing on the iteration to stop at.

  watcher = Watcher()
  for iteration in ...:
      ...
      if watcher.reached(iteration):    # call it at every iteration, on every process
          save and stop
  watcher.close()

With `jax.distributed` initialised, jax's preemption sync point decides: jax's notifier
catches SIGTERM on any host, and all hosts return True at the same iteration (the next one
every host can still reach). In a single process a SIGTERM handler sets a flag.
"""

import logging
import signal
import threading

import jax
import numpy as np

logger = logging.getLogger(__name__)


class Watcher:
    def __init__(self):
        self.signalled = False
        self._previous = None
        self.synced = jax.distributed.is_initialized() and bool(
            jax.config.jax_enable_preemption_service)
        if self.synced:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("The training loop runs outside the main thread: SIGTERM cannot be "
                           "caught there, so a preemption will not save a checkpoint.")
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self.signalled = True

    def reached(self, step: int) -> bool:
        """True once a preemption notice has arrived, at the same `step` on every process."""
        if self.synced:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self.signalled

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def agree(flag: bool) -> bool:
    """Process 0's value of `flag` on every process (e.g. a decision taken from its clock)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))
