"""The children that live as long as the job (the per-role Services, the rendezvous
ConfigMap, the workers' ServiceAccount and RBAC): each missing one is created.
"""

from __future__ import annotations

from refit_operator.core.decision import Create
from refit_operator.core.draft import Draft
from refit_operator.core.round_input import RoundInput
from refit_operator.render import children


def create_missing(inp: RoundInput, draft: Draft) -> None:
    for obj in children.render_static(inp.job.ref, inp.spec):
        if (obj["kind"], obj["metadata"]["name"]) not in inp.observed.others:
            draft.actions.append(Create(obj))
