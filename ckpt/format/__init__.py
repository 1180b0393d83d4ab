"""What a checkpoint is, apart from where it is kept: versioned manifests (untrusted input),
DTensor layouts, a state flattened into tensors plus a JSON tree and decoded back, tensor
byte I/O with chunk checksums, and bounded JSON. Imports nothing else of the engine."""
