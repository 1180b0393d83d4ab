"""The one error an action raises: a sentence for the operator, no traceback."""


class ActionError(RuntimeError):
    """The scheduler refused or could not be reached; the message says which and why."""
