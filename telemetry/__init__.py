"""The telemetry contract (../shared/telemetry/SCHEMA.md) that agents and predictor share.

A package of its own, not a module of either side: both import it without pulling
in the other's servers. The checkpoint engine imports none of it but ``faults`` (a fleet's
fault history and node rankings, stdlib only: the goodput simulator replays the history,
the predictor ranks nodes from it, the quarantine reads the ranking) and ``cli_group``
(every command reports errors one way).
"""
