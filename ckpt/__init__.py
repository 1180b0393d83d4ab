"""ckpt."""
