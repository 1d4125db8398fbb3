"""One process of the two-process preemption test (test_preemption.py): joins a 2-process
jax.distributed job on this machine, runs `steps` iterations through preemption.Watcher, and
prints the iteration it stopped at ("stopped N") or "finished". It writes READY_FILE once it
is past iteration 5, so the test knows when to send SIGTERM."""

import os
import sys
import time

import jax

process_id, port, ready_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_num_cpu_devices", 1)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=process_id)

from g2rpo_jax.run import preemption  # noqa: E402

watcher = preemption.Watcher()
assert watcher.synced
for step in range(1, 2001):
    time.sleep(0.02 * (1 + process_id))   # the processes run at different speeds
    if step == 5:
        open(ready_file + f".{process_id}", "w").close()
    if watcher.reached(step):
        print(f"stopped {step}", flush=True)
        break
else:
    print("finished", flush=True)
watcher.close()
jax.distributed.shutdown()
os._exit(0)
