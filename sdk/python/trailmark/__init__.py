"""trailmark SDK: write trailmark workflow steps in Python, served over `trailmark-step/1`.

Declare a `Workflow`, decorate its step handlers, and serve them with `App` (an ASGI app); a
trailmark worker reads the manifest and calls a step once per attempt, while the step's model
calls and writes go back to the worker as callbacks through `StepContext`.
"""

from .app import App
from .context import Answer, StepContext, assistant, system, user
from .errors import AttemptRefused, Auth, Conflict, StepError, Temporary, Unknown
from .outcome import Children, Outcome
from .workflow import PROTOCOL, LocalTable, Workflow

__all__ = [
    "PROTOCOL",
    "Answer",
    "App",
    "AttemptRefused",
    "Auth",
    "Children",
    "Conflict",
    "LocalTable",
    "Outcome",
    "StepContext",
    "StepError",
    "Temporary",
    "Unknown",
    "Workflow",
    "assistant",
    "system",
    "user",
]
