"""The failure model: features (no look-ahead), labels, ramps, rules for critical XIDs, the one
scorer (batch and live alike), trace replay, training, the safe model file, evaluation."""
