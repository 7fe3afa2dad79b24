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
  """What one process holds in its local directory.

  ``ids[step]`` is the save id of that step here (its record's, shared by the
  own copy and the replicas in the step's directory): a step is one save only
  where every copy read carries the same id. Two runs that each died between
  their commits can leave one step number committed by different saves on
  different processes.
  """
  own: list[int]
  replicas: dict[int, list[int]]  # process -> steps of its blob held here
  process_count: int
  ids: dict[int, str] = dataclasses.field(default_factory=dict)  # step -> save id ("": none)

  def to_json(self) -> str:
    return json.dumps({"own": self.own, "replicas": {str(k): v for k, v in self.replicas.items()},
                       "n": self.process_count, "ids": {str(k): v for k, v in self.ids.items()}})

  @classmethod
  def from_json(cls, text: str) -> "Holdings":
    d = json.loads(text)
    return cls(d["own"], {int(k): v for k, v in d["replicas"].items()}, d["n"],
               {int(k): v for k, v in d["ids"].items()})


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where each process gets step ``step`` from: its own copy or a replica holder; every
  copy read is of the save ``save_id``."""
  step: int
  source: tuple[int, ...]  # source[p]: the process whose local directory holds p's blob
  save_id: str = ""


def plan_restore(holdings: list[Holdings], newer_than: int | None) -> RestorePlan | None:
  """The newest step every process can get from one save, if newer than ``newer_than``; pure.

  Only copies of one save id count together: a step whose copies come from
  different saves (two runs that each died after some processes committed it)
  is not a step, and an older one is planned.

  Example:
    >>> h = [Holdings([10, 20], {1: [20]}, 2), Holdings([10], {0: [10, 20]}, 2)]
    >>> plan_restore(h, None)       # process 1 lost step 20; process 0 holds its replica
    RestorePlan(step=20, source=(0, 0), save_id='')
    >>> plan_restore(h, 20) is None
    True
    >>> h = [Holdings([4, 6], {}, 2, {4: "a", 6: "b"}), Holdings([4, 6], {}, 2, {4: "a", 6: "c"})]
    >>> plan_restore(h, None)       # step 6 of two saves: step 4
    RestorePlan(step=4, source=(0, 1), save_id='a')
  """
  n = len(holdings)
  if any(h.process_count != n for h in holdings):
    return None
  candidates = sorted({s for h in holdings for s in h.own} |
                      {s for h in holdings for v in h.replicas.values() for s in v}, reverse=True)
  for step in candidates:
    if newer_than is not None and step <= newer_than:
      return None
    for save_id in sorted({h.ids.get(step, "") for h in holdings
                           if step in h.own or any(step in v for v in h.replicas.values())}):
      source = _sources(holdings, step, save_id)
      if source is not None:
        return RestorePlan(step, source, save_id)
  return None


def _sources(holdings: list[Holdings], step: int, save_id: str) -> tuple[int, ...] | None:
  """Where each process gets its blob of ``step`` from among the copies of save ``save_id``
  (its own first), or None if some process can get none."""
  n = len(holdings)
  ours = [h.ids.get(step, "") == save_id for h in holdings]
  source = []
  for p in range(n):
    if ours[p] and step in holdings[p].own:
      source.append(p)
      continue
    holder = next((r for r in range(n)
                   if ours[r] and step in holdings[r].replicas.get(p, [])), None)
    if holder is None:
      return None
    source.append(holder)
  return tuple(source)


def mixed_steps(holdings: list[Holdings], plan: RestorePlan | None) -> list[int]:
  """The steps newer than ``plan``'s whose copies carry more than one save id; pure.

  Example:
    >>> h = [Holdings([4, 6], {}, 2, {6: "b"}), Holdings([4, 6], {}, 2, {6: "c"})]
    >>> mixed_steps(h, plan_restore(h, None))
    [6]
  """
  ids: dict[int, set[str]] = {}
  for h in holdings:
    for s in {*h.own, *(s for v in h.replicas.values() for s in v)}:
      ids.setdefault(s, set()).add(h.ids.get(s, ""))
  return sorted(s for s, v in ids.items() if len(v) > 1 and (plan is None or s > plan.step))


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


