"""Where an agent's samples come from: NVML, the fleet simulator, a recorded trace."""
from agents.sources.base import Source

__all__ = ["Source"]
