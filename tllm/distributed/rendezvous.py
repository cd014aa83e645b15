"""Where rank 0 and its workers meet: rank 0's TCP store, at which every worker checks in
before the process group forms (so rank 0 can tell a worker that died from a slow one)."""
from __future__ import annotations

import datetime

RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=600)


def ready_key(rank: int) -> str:
    return f"tllm/ready/{rank}"
