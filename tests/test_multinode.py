"""The several-machines path, on one machine: two torchrun agents (``--nnodes 2
--nproc-per-node 1``) started separately, as on machines A and B, meet through c10d
rendezvous on 127.0.0.1 and train one model; rank 0 writes the shared run directory
named by ``KILN_RUN_DIR``, and the weights match a one-process run of the same config."""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from kiln.commands import main
from kiln.launch.testing import free_port
from kiln.train import load_checkpoint

pytestmark = pytest.mark.distributed  # processes on gloo: the full suite runs them, the fast tier does not

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "configs" / "digits_mlp.yaml")
# fp64 and random Gaussian images: the 2-rank gradient average equals the 1-rank full-batch
# gradient to the last bits, and no always-zero pixel lets Adam magnify rounding.
COMMON = ["train.max_steps=10", "optim.lr=1e-3", "data.name=synthetic_images", "train.precision=fp64",
          "train.log_every=10", "train.eval_every=0", "train.threads=1", "parallel.timeout_s=60"]
TIMEOUT_S = 90


def _agent(port: int, rdzv_id: str, run_dir: Path, log: Path) -> subprocess.Popen:
    """One machine's ``torchrun`` agent: one worker, rendezvous at 127.0.0.1:port."""
    env = {**os.environ, "KILN_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
           "--local-addr", "127.0.0.1",  # the address the other node reaches rank 0's store on
           "-m", "kiln", "train", MLP, *COMMON, f"train.output_dir={run_dir.parent / 'unused'}"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def test_two_torchrun_agents_meet_by_rendezvous_and_train_the_same_model_as_one_process(tmp_path):
    run_dir = tmp_path / "shared-run"
    (run_dir / "checkpoints").mkdir(parents=True)  # as `kiln train --nproc` creates it (RunDir.create)
    port, rdzv_id = free_port(), f"kiln-test-{uuid.uuid4().hex[:8]}"
    logs = [tmp_path / "agent-a.log", tmp_path / "agent-b.log"]
    agents = [_agent(port, rdzv_id, run_dir, log) for log in logs]
    # the one-process reference trains here while the agents start (kiln train in this process)
    one = main(["train", MLP, *COMMON, f"train.output_dir={tmp_path / 'one'}"])
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    outs = [log.read_text()[-3000:] for log in logs]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert one == 0

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["processes"] == 2 and summary["steps"] == 10
    assert not (tmp_path / "unused").exists()  # KILN_RUN_DIR, not train.output_dir, named the run

    (single,) = (tmp_path / "one").iterdir()
    a = load_checkpoint(single / "checkpoints" / "final")["model"]
    b = load_checkpoint(run_dir / "checkpoints" / "final")["model"]
    assert a.keys() == b.keys()
    assert all(t.dtype == torch.float64 for t in b.values())
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-10, diff
