"""Where the local tier's copies go, and which copy a restore reads: pure functions.

:func:`replica_ring` orders the processes so that each one's replicas sit on
other hosts; :func:`plan_restore` picks, from what every process reports it
holds, the newest step every process can get and where each gets it from. No
I/O, no collectives: :mod:`orbax_flax.tiers.local` gathers the inputs and acts.
"""

from __future__ import annotations

import dataclasses
import json

@dataclasses.dataclass
class Holdings:
  """What one process holds in its local directory."""
  own: list[int]
  replicas: dict[int, list[int]]  # process -> steps of its blob held here
  process_count: int

  def to_json(self) -> str:
    return json.dumps({"own": self.own, "replicas": {str(k): v for k, v in self.replicas.items()},
                       "n": self.process_count})

  @classmethod
  def from_json(cls, text: str) -> "Holdings":
    d = json.loads(text)
    return cls(d["own"], {int(k): v for k, v in d["replicas"].items()}, d["n"])


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where each process gets step ``step`` from: its own copy or a replica holder."""
  step: int
  source: tuple[int, ...]  # source[p]: the process whose local directory holds p's blob


def plan_restore(holdings: list[Holdings], newer_than: int | None) -> RestorePlan | None:
  """The newest step every process can get, if newer than ``newer_than``; pure.

  Example:
    >>> h = [Holdings([10, 20], {1: [20]}, 2), Holdings([10], {0: [10, 20]}, 2)]
    >>> plan_restore(h, None)       # process 1 lost step 20; process 0 holds its replica
    RestorePlan(step=20, source=(0, 0))
    >>> plan_restore(h, 20) is None
    True
  """
  n = len(holdings)
  if any(h.process_count != n for h in holdings):
    return None
  candidates = sorted({s for h in holdings for s in h.own} |
                      {s for h in holdings for v in h.replicas.values() for s in v}, reverse=True)
  for step in candidates:
    if newer_than is not None and step <= newer_than:
      return None
    source = []
    for p in range(n):
      if step in holdings[p].own:
        source.append(p)
        continue
      holder = next((r for r in range(n) if step in holdings[r].replicas.get(p, [])), None)
      if holder is None:
        break
      source.append(holder)
    if len(source) == n:
      return RestorePlan(step, tuple(source))
  return None


HOST_ENV = "ORBAX_FLAX_HOST"  # overrides the host name a process reports (see LocalTier)


def replica_ring(hosts: list[str], replicas: int) -> tuple[tuple[int, ...], str]:
  """The ring of processes replicas travel along, and a warning ("" if none is due).

  Process ``ring[i]`` keeps the replicas of ``ring[i - 1]``, ..., ``ring[i -
  replicas]``. The ring interleaves hosts so that every ``replicas + 1``
  consecutive processes are on distinct hosts: then each process's copies are
  on ``replicas`` hosts other than its own, and losing any ``replicas`` hosts
  loses no local step. Where ``hosts`` allow no such ring (one host, fewer
  hosts than ``replicas + 1``, or too many processes on one host), the warning
  says so.

  Example:
    >>> replica_ring(["a", "a", "b", "b"], 1)   # process 0's replica goes to host b
    ((0, 2, 1, 3), '')
    >>> replica_ring(["a", "a"], 1)[1][:40]
    'replicas=1 needs processes on 2 hosts; a'
  """
  n = len(hosts)
  if n < 2 or not replicas:
    return tuple(range(n)), ""
  groups: dict[str, list[int]] = {}
  for p, h in enumerate(hosts):
    groups.setdefault(h, []).append(p)
  ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
  flat = [p for g in ordered for p in g]
  robin = [g[i] for i in range(len(ordered[0])) for g in ordered if i < len(g)]
  stride = [None] * n
  slots = [j for r in range(replicas + 1) for j in range(r, n, replicas + 1)]
  for j, p in zip(slots, flat):
    stride[j] = p
  def safe(ring):
    return all(len({hosts[ring[(i + k) % n]] for k in range(replicas + 1)}) == replicas + 1
               for i in range(n))
  for ring in (robin, stride):
    if safe(ring):
      return tuple(ring), ""
  if len(groups) < replicas + 1:
    why = (f"replicas={replicas} needs processes on {replicas + 1} hosts; all {n} processes are"
           f" on {len(groups)} ({', '.join(sorted(groups))})")
  else:
    why = (f"the {n} processes are spread over hosts {dict((h, len(g)) for h, g in groups.items())}"
           f" too unevenly for each one's {replicas} replica(s) to sit on other hosts")
  return tuple(robin), (why + ": a local step survives losing a process's local directory, not"
                        " necessarily a whole host")


