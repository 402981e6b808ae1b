"""A write to the API that the apiserver refused, as the reconcile reads it.

The controller turns every refused create, delete or patch of a child into a
:class:`WriteError`; ``reconcile.after_writes`` decides what the job's status, conditions
and Events say about it.  ``400 BadRequest`` and ``422 Invalid`` on a create are
*permanent*: the same object would be refused again (a pod the template makes invalid, a
policy that denies it), so the job fails with the apiserver's words until its spec
changes.  Anything else (403 Forbidden from a quota or RBAC, a webhook that is down, 5xx)
is retried with a back-off, and shown while it lasts.

Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

#: HTTP codes after which the same create cannot succeed.
PERMANENT = frozenset({400, 422})


@dataclass(frozen=True)
class WriteError:
    verb: str  # "create", "delete", "patch"
    kind: str
    name: str
    status: int
    #: The apiserver's ``Status.reason`` (Forbidden, Invalid, ...); '' when it gave none.
    reason: str
    message: str

    @property
    def permanent(self) -> bool:
        return self.verb == "create" and self.status in PERMANENT

    @property
    def condition_reason(self) -> str:
        """A CamelCase reason for a condition: the apiserver's, else from the code."""
        if self.reason.isalnum() and self.reason[:1].isalpha():
            return self.reason
        return f"HTTP{self.status}"

    @property
    def event_reason(self) -> str:
        return f"Failed{self.verb.title()}"

    def text(self) -> str:
        return f"{self.verb} {self.kind} {self.name}: HTTP {self.status}: {self.message}"
