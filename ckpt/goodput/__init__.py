"""The goodput simulator behind ``ckpt simulate``: what a long run loses to saves,
lost work and restarts under each checkpointing strategy.

Apart from the runtime on purpose: nothing in the checkpoint engine imports this
package (``ckpt simulate`` loads it when it runs), and its default measurements are
dated data files (``data/``), not figures in code. ``ckpt.policy``, which the training
loop uses, stays in the engine; the model imports it, never the other way round.
"""
