"""The errors an action raises: a sentence for the operator, no traceback."""


class ActionError(RuntimeError):
    """The scheduler refused or could not be reached; the message says which and why."""


class NotOneNode(ActionError):
    """The name is not exactly one real node (unknown, a nodeset, ``ALL``): refused, nothing asked."""
