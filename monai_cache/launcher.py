"""What the launcher says about this process: its rank, local rank, ranks on its machine, world size and node.

torchrun sets ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE`` and ``GROUP_RANK`` for every rank.
Slurm's ``srun`` starting the ranks itself sets none of them, and neither does Lightning's ``SLURMEnvironment``
(it exports only ``MASTER_ADDR`` / ``MASTER_PORT``): each task has Slurm's own variables instead.
:func:`launch_view` reads torchrun's first and fills what they leave out from Slurm's (the first one set):

* ``rank``: ``RANK``, else ``SLURM_PROCID``;
* ``local_rank``: ``LOCAL_RANK``, else ``SLURM_LOCALID``;
* ``local_world_size`` (ranks on this machine): ``LOCAL_WORLD_SIZE``, else this node's count in
  ``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE`` (e.g. ``4,2(x3)``, found by ``SLURM_NODEID``) or
  ``SLURM_NTASKS_PER_NODE``;
* ``world_size``: ``WORLD_SIZE``, else ``SLURM_STEP_NUM_TASKS``, ``SLURM_NTASKS``;
* ``node`` (the node's index): ``GROUP_RANK``, else ``SLURM_NODEID``.

The step's own variables come first: ``srun`` sets them for every step, while ``srun --preserve-env`` leaves
``SLURM_NTASKS`` and ``SLURM_TASKS_PER_NODE`` at the job's values (Slurm's ``env_array_for_step``).

Slurm's variables fill a field only where they describe this process: in a Slurm task (``SLURM_PROCID`` set; an
allocation's shell, ``salloc``'s, has only the job's variables), and where every torchrun variable that is set
agrees with its Slurm counterpart. A process that something inside a Slurm task started (torchrun inside ``srun``,
``mp.spawn``, Lightning's own launcher in an interactive allocation) sets its own ``RANK`` or ``WORLD_SIZE``, which
then differ from its task's, and Slurm's are not used at all.

A value that cannot be read (not a plain non-negative integer; a ``SLURM_TASKS_PER_NODE`` that is not Slurm's
``count[(xN)],...``; a node index beyond it) leaves its field unknown and says why in ``problems``; an empty value
counts as not set. Nothing here raises: each caller decides (the switch's log line and the early warnings treat an
unknown rank as rank 0; the sampler raises the problem of the field it needs). The parsers themselves
(:func:`parse_tasks_per_node`, :func:`tasks_on_node`) raise :class:`ValueError` naming the variable.

Pure functions of an environ mapping that import nothing but ``typing``: the switch (started in every Python
process under ``monai-cache run``) and the command line use them without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["FIELDS", "LAUNCHER_VARIABLES", "Launch", "launch_view", "parse_tasks_per_node", "tasks_on_node"]

FIELDS = ("rank", "local_rank", "local_world_size", "world_size", "node")
TORCHRUN = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "world_size": "WORLD_SIZE",
    "node": "GROUP_RANK",
}
SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
SLURM = {
    "rank": ("SLURM_PROCID",),
    "local_rank": ("SLURM_LOCALID",),
    "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "node": ("SLURM_NODEID",),
}
#: every variable :func:`launch_view` reads (tests that play a launcher clear them all first)
LAUNCHER_VARIABLES = (*TORCHRUN.values(), *(v for names in SLURM.values() for v in names), *SLURM_TASKS_PER_NODE)


class Launch(NamedTuple):
    """The launcher's view of this process; a field is ``None`` where no variable gives it."""

    rank: int | None
    local_rank: int | None
    local_world_size: int | None
    world_size: int | None
    node: int | None
    #: field -> the variable it was read from (for messages)
    source: Mapping[str, str]
    #: field -> why the variable that should give it could not be read (the field is then ``None``)
    problems: Mapping[str, str]

    @property
    def node_lead(self) -> bool:
        """Whether this is the machine's first rank (local rank 0, else rank 0 where only that is known, and any
        process outside a launcher): the one process per machine that logs and warns."""
        first = self.local_rank if self.local_rank is not None else self.rank
        return first is None or first == 0

    @property
    def from_slurm(self) -> bool:
        """Whether some field came from Slurm's variables."""
        return any(name.startswith("SLURM_") for name in self.source.values())


def _integer(name: str, value: str) -> int:
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{name}={value!r} is not a non-negative integer")
    return int(text)


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[tuple[int, int]]:
    """Slurm's tasks per node, as ``(count, nodes)`` runs: ``"4,2(x2)"`` -> ``[(4, 1), (2, 2)]``.

    The format of ``SLURM_TASKS_PER_NODE`` (and ``SLURM_STEP_TASKS_PER_NODE``): comma-separated counts in the order
    of the nodes, each optionally followed by ``(xN)``, N nodes in a row with that count. Counts and N are positive
    integers; nothing else is accepted.

    Raises:
        ValueError: ``value`` is not in that format (the message names ``name`` and the value).
    """
    runs = []
    for part in value.strip().split(","):
        count, times = part, "1"
        if part.endswith(")") and "(x" in part:
            count, _, times = part[:-1].partition("(x")
        if not (count.isascii() and count.isdigit() and times.isascii() and times.isdigit()):
            raise ValueError(
                f"{name}={value!r} is not Slurm's tasks per node (comma-separated counts, each optionally followed "
                f"by '(xN)', e.g. '4,2(x3)'): cannot read {part!r}"
            )
        if int(count) < 1 or int(times) < 1:
            raise ValueError(f"{name}={value!r} has a count or repeat of 0 in {part!r}")
        runs.append((int(count), int(times)))
    return runs


def tasks_on_node(value: str, node: int | None, name: str = "SLURM_TASKS_PER_NODE") -> int:
    """How many tasks Slurm's tasks per node ``value`` puts on node ``node`` (``SLURM_NODEID``, from 0).

    ``node`` may be ``None`` where every node has the same count.

    Raises:
        ValueError: ``value`` is malformed, or ``node`` is needed and missing, or beyond the nodes it lists.
    """
    runs = parse_tasks_per_node(value, name)
    total = sum(times for _count, times in runs)
    if node is None:
        if len({count for count, _times in runs}) == 1:
            return runs[0][0]
        raise ValueError(f"{name}={value!r} differs between nodes, and which node this is (SLURM_NODEID) is unknown")
    left = node
    for count, times in runs:
        if left < times:
            return count
        left -= times
    raise ValueError(f"SLURM_NODEID={node} is beyond the {total} node(s) of {name}={value!r}")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if environ.get(n, "").strip()), None)


def _read_slurm(environ: Mapping[str, str]) -> tuple[dict[str, int | None], dict[str, str], dict[str, str]]:
    """Slurm's values of the fields, the variable each came from, and the problems."""
    values: dict[str, int | None] = dict.fromkeys(FIELDS)
    source: dict[str, str] = {}
    problems: dict[str, str] = {}
    for field, names in SLURM.items():
        name = _first(environ, names)
        if name is not None:
            source[field] = name
            try:
                values[field] = _integer(name, environ[name])
            except ValueError as e:
                problems[field] = str(e)
    name = _first(environ, SLURM_TASKS_PER_NODE)
    if name is not None:
        source["local_world_size"] = name
        try:
            values["local_world_size"] = tasks_on_node(environ[name], values["node"], name)
        except ValueError as e:
            problems["local_world_size"] = str(e)
    return values, source, problems


def launch_view(environ: Mapping[str, str]) -> Launch:
    """What the launcher says about the process whose environment is ``environ`` (``os.environ``).

    torchrun's variables first; Slurm's where torchrun's are not set and the ones that are set agree with Slurm's
    (see the module's docstring). Never raises: a variable that cannot be read leaves its field ``None``, with the
    reason in ``problems``.
    """
    values: dict[str, int | None] = dict.fromkeys(FIELDS)
    source: dict[str, str] = {}
    problems: dict[str, str] = {}
    for field, name in TORCHRUN.items():
        if environ.get(name, "").strip():
            source[field] = name
            try:
                values[field] = _integer(name, environ[name])
            except ValueError as e:
                problems[field] = str(e)
    missing = [f for f in FIELDS if f not in source]
    if missing and environ.get("SLURM_PROCID", "").strip():
        slurm, slurm_source, slurm_problems = _read_slurm(environ)
        agree = all(slurm[f] is None or values[f] is None or slurm[f] == values[f] for f in FIELDS)
        if agree:
            for field in missing:
                if field in slurm_source:
                    values[field] = slurm[field]
                    source[field] = slurm_source[field]
                    if field in slurm_problems:
                        problems[field] = slurm_problems[field]
    return Launch(
        values["rank"], values["local_rank"], values["local_world_size"], values["world_size"], values["node"],
        source, problems,
    )
