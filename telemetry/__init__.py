"""The telemetry contract (../shared/telemetry/SCHEMA.md) that agents and predictor share.

A package of its own, not a module of either side: both import it without pulling
in the other's servers, and the checkpoint engine imports none of it.
"""
