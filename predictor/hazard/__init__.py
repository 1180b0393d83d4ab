"""Fleet hazard: which GPUs will fail in the coming months, from a fleet's service history.

history (read and clean the record) -> features (as of a time) -> models (Cox, Weibull AFT,
landmark boosting) -> store (skops, no pickle) -> cli (`predictor hazard ...`), drain (the
ops list), paper (the SC20 findings as a check).
"""
