"""The failure modes of the contract (SCHEMA.md's failures.parquet ``mode``), apart from the
Arrow schemas: the agents' CLI parses ``--fail NODE/gpuN/MODE@+OFFSET`` without pyarrow."""
from __future__ import annotations

FAILURE_MODES = ("hbm", "thermal", "pcie", "nvlink", "sudden")
