"""Several env factories in one run: heterogeneous or multi-task env sets, one policy over all of them.

The seed collector takes a list of env-making functions; here an
:class:`EnvSet` stands where one factory stands. Env ids are given out in
entry order (entry 0's ``count`` envs first), each env is built by its
entry's factory and seeded with its entry's ``seed_offset`` added, and
:meth:`EnvSet.task_of` says which task every env id belongs to, so episode
statistics can be kept per task. Every entry must make envs of the same
spaces: one policy serves them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class EnvSetEntry:
    """``count`` envs from ``factory``, named ``task`` in the metrics, seeds shifted by ``seed_offset``."""

    factory: Callable[[], Any]
    count: int
    task: str
    seed_offset: int = 0


class EnvSet:
    """Env ids ``0 .. num_envs - 1`` over the entries, in order (picklable when its factories are).

    Examples:
        >>> envs = EnvSet([EnvSetEntry(int, 2, "a"), EnvSetEntry(float, 1, "b", seed_offset=100)])
        >>> envs.num_envs, envs.task_of().tolist(), envs.seed_of(2, 7)
        (3, [0, 0, 1], 107)
        >>> type(envs.for_env(2)()).__name__, [type(f()).__name__ for f in envs.cycle(3)]
        ('float', ['int', 'float', 'int'])
    """

    def __init__(self, entries: Sequence[EnvSetEntry]) -> None:
        if not entries:
            raise ValueError("an env set needs at least one entry")
        names = [e.task for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must differ, got {names}")
        if any(e.count < 1 for e in entries):
            raise ValueError("every entry needs count >= 1")
        self.entries = tuple(entries)
        self.tasks = tuple(names)
        self._entry = np.repeat(np.arange(len(entries)), [e.count for e in entries])

    @property
    def num_envs(self) -> int:
        return int(len(self._entry))

    def task_of(self) -> np.ndarray:
        """Per env id, the index of its task in :attr:`tasks`."""
        return self._entry.copy()

    def for_env(self, env_id: int) -> Callable[[], Any]:
        return self.entries[int(self._entry[env_id])].factory

    def seed_of(self, env_id: int, seed: int) -> int:
        return int(seed) + self.entries[int(self._entry[env_id])].seed_offset

    def cycle(self, n: int) -> list[Callable[[], Any]]:
        """``n`` factories taking the tasks in turn (evaluation envs: every task is evaluated)."""
        return [self.entries[i % len(self.entries)].factory for i in range(n)]

    def slice(self, first: int, count: int) -> EnvSet:
        """Env ids ``first .. first + count - 1`` as a set of their own, numbered from 0 (one Ray host's envs).

        Each env keeps its factory, task name and seed offset; entries with no env in the range drop out.

        Examples:
            >>> envs = EnvSet([EnvSetEntry(int, 3, "a"), EnvSetEntry(float, 2, "b", seed_offset=100)])
            >>> part = envs.slice(2, 2)
            >>> part.tasks, part.task_of().tolist(), part.seed_of(1, 7)
            (('a', 'b'), [0, 1], 107)
        """
        if first < 0 or count < 1 or first + count > self.num_envs:
            raise ValueError(f"env ids {first}..{first + count - 1} are not all in this set of {self.num_envs}")
        ids = self._entry[first:first + count]
        return EnvSet([dataclasses.replace(self.entries[i], count=int((ids == i).sum())) for i in np.unique(ids)])

    def __call__(self) -> Any:
        """One env of the first entry (what a spec probe builds)."""
        return self.entries[0].factory()
