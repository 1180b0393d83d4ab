"""Restoring: planning (which saved shards, from which tiers, at which world size) apart from
executing it (``execute.restore_agreed``, the one restore path), resharding, and loading into
live objects all or nothing."""
