"""The one exception type users see, and one-line warnings.

Anything a user can cause (a bad path, a bad config value, a corrupt file) is raised as
`AppoError` with a message that names the problem and, where possible, the fix. The CLI
prints it as one line; `--debug` shows the traceback.

A setting appo accepts but adjusts (a value clamped to a limit) is reported by `warn_once`:
one `warning: ...` line on stderr, once per process, however often the config is loaded.
"""

import logging

log = logging.getLogger("appo")
_warned: set[str] = set()


class AppoError(Exception):
    """A user-facing error: the message alone must tell what went wrong."""


class ToolFatalError(AppoError):
    """A tool cannot work at all for a reason outside the model's call (its cache file is
    corrupt, say). Raised through the tool executor and the rollout, which otherwise turn a
    tool's exception into an error text for the model: a run must stop here, not train on
    answers to a broken tool."""


def warn_once(message: str) -> None:
    """Log `warning: MESSAGE` once per process (stderr when logging is not configured)."""
    if message in _warned:
        return
    _warned.add(message)
    log.warning("warning: %s", message)
