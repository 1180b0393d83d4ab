"""torchrun child for test_peer_multinode: every rank trains a model of its own (its own
initialisation and data: state that differs per rank, not a DDP replica), saving every
``--every`` steps with ``peers=1``, resuming from whatever ``restore()`` finds.

    peer_child.py ROOT MEMORY_DIR OUT_DIR STEPS EVERY STEP_TIME [URGENT_AT PEER_BYTES_PER_S HIDDEN]

Each rank writes ``OUT_DIR/rank-<r>.json`` (its final weights digest) at the end.
``URGENT_AT``: every rank also saves that step urgently (an alarm: evacuation) and
logs where it became durable; ``PEER_BYTES_PER_S`` caps replication (0: no cap);
``HIDDEN`` sizes the model. Environment: ``PEER_CHILD_OBJECT_STORE``, an object-store
tier at that URL; ``PEER_CHILD_AT_RISK=NODE@STEP``, from that step on every rank places
replicas as when the predictor reports NODE at risk (``loop.save_at_boundary`` agrees
on that set)."""
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ckpt import CheckpointManager
from ckpt.distributed import exit_rank, init_process_group

root, memory_dir, out_dir = sys.argv[1:4]
steps, every, step_time = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
extra = [int(a) for a in sys.argv[7:10]]
urgent_at, cap, hidden = extra + [0, 0, 256][len(extra):]
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK')} %(name)s %(message)s")
init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(1000 + rank)
model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 8))
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
state = {"model": model, "optim": optim, "note": f"rank {rank}"}
# keep_memory: the tests read the replicas each node holds after the job ended (the fixture
# removes both shared-memory directories)
mgr = CheckpointManager(root, memory_dir=memory_dir, keep_last=2, peers=1, state=state, chunk_bytes=64 << 10,
                        peer_bytes_per_s=cap or None, object_store=os.environ.get("PEER_CHILD_OBJECT_STORE"),
                        keep_memory=True)
start = mgr.restore(state) or 0
logging.info("rank %d starts at step %d", rank, start)
risky, _, risky_from = os.environ.get("PEER_CHILD_AT_RISK", "@0").partition("@")
for step in range(start, steps):
    if risky and step == int(risky_from):
        mgr.peering.avoid({risky})
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    dist.all_reduce(loss.detach().clone())  # the ranks advance together; a lost node is noticed here
    if (step + 1) % every == 0:
        handle = mgr.save(step + 1, state)
    if step + 1 == urgent_at:
        urgent = mgr.save(step + 1, state, urgent=True).wait()
        logging.info("rank %d: urgent step %d durable %s", rank, urgent.step, json.dumps(urgent.durable_s))
    time.sleep(step_time)
mgr.close()  # sends the last replica
logging.info("rank %d: step %d durable in the peer tier %.3f s after save()", rank, handle.step,
             handle.durable_s["peer"])
digest = hashlib.sha256()
for name, t in sorted(model.state_dict().items()):
    digest.update(name.encode() + t.numpy().tobytes())
Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"digest": digest.hexdigest(), "start": start}))
exit_rank()
