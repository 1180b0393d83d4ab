"""Checkpoints to and from other tools: reading ours through DCP's ``dcp.load``, importing a
DCP directory without unpickling, exporting to safetensors or DCP."""
