"""The documented command ``python -m ckpt.quarantine list|check|clear`` and its exit code
``EXIT_QUARANTINED`` (the code is in ``ckpt.recovery.quarantine``)."""
import sys

from .recovery.quarantine import EXIT_QUARANTINED, main

__all__ = ["EXIT_QUARANTINED", "main"]

if __name__ == "__main__":
    sys.exit(main())
