"""scale_bench's components outside the job's store, each at a tiny N through the functions
the benchmark runs (``--one`` calls the same): they run, count and clean up; no timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import scale_bench, scale_listing, scale_predictor
from ckpt.format.manifest import ShardManifest
from tests.ckpt_helpers import REPO


def test_the_patched_manifests_are_what_the_real_class_writes_for_each_rank() -> None:
    shards = scale_listing.Shards(16)
    assert len(scale_listing.llama70b_shapes()) == 723
    for rank in (0, 1, 9, 15):
        assert ShardManifest.from_bytes(shards.raw(rank)) == scale_listing.shard_manifest(rank, 16)


@pytest.mark.parametrize("component", [c for c in scale_listing.COMPONENTS if c.endswith("_disk")])
def test_listing_components_on_disk(component: str) -> None:
    row = scale_bench.run_one(component, 16, clients=1)
    assert row["component"] == component and row["ranks"] == 16 and row["store_ops"] == 0
    assert row["shard_manifest_bytes"] > 200_000 and row["peak_rss_mb"] > 0


@pytest.mark.parametrize("component", [c for c in scale_listing.COMPONENTS if c.endswith("_s3")])
def test_listing_components_in_the_s3_test_server_count_requests(component: str, s3_server) -> None:
    row = scale_listing.run_one(component, 8, s3_server)
    # ls: a listing, the commit record, rank 0's manifest; verify: every shard's manifest, a listing for sizes
    assert row["store_ops"] >= (3 if component.startswith("ckpt_ls") else 8 + 1), row
    assert "AWS_ENDPOINT_URL_S3" not in os.environ


def test_predictor_scores_every_gpu_of_n_over_8_nodes() -> None:
    row = scale_predictor.run_one(16)
    assert row["gpus"] == 16 and row["seconds"] > 0


def _one(component: str, sizes: str) -> list[dict]:
    """``scale_bench.py --one``: in its own process, as the benchmark runs it (the store components
    put stand-ins and a clock into ckpt.inprocess, which this process's other tests must not see)."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_bench.py"), "--one", component, sizes],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_one_path_prints_a_row_per_size() -> None:
    assert [row["ranks"] for row in _one("predictor_score", "8,16")] == [8, 16]


def test_steady_step_with_a_connection_per_rank_counts_what_the_shared_clients_count() -> None:
    real, = _one("steady_step_clients", "16")
    shared, = _one("steady_step", "16")
    assert real["clients"] == 16 + 1 + 1  # every worker, node 1's launcher, the job launcher's store
    assert (real["store_ops"], real["store_keys"]) == (shared["store_ops"], shared["store_keys"])


def test_commit_costs_each_rank_the_same_store_operations_whatever_n_and_leaves_no_key() -> None:
    """Every rank with a connection of its own (``scale_commit.py``): a count, not a time."""
    small, large = _one("commit", "16,64")
    assert small["clients"] == 16 and large["keys_left"] == small["keys_left"] == 0
    # most ranks 7 operations, each leader (one a node of 8) 5 more, a few once a step
    assert 7 <= large["ops_per_rank"] <= small["ops_per_rank"] <= 8, (small, large)
