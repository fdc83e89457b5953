"""Admission order: longest cached prefix first, no request passed over forever."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_prefix.engine.requests.scheduler import pick_next


@dataclass
class Job:
    name: str
    reuse: int
    passovers: int = 0


def drain(waiting: list[Job], max_passovers: int) -> list[str]:
    order = []
    while waiting:
        job = pick_next(waiting, lambda j: j.reuse, max_passovers)
        waiting.remove(job)
        order.append(job.name)
    return order


def test_longest_cached_prefix_first_ties_by_arrival():
    jobs = [Job("cold", 0), Job("warm", 500), Job("hot", 900), Job("hot-later", 900)]
    assert drain(jobs, max_passovers=10) == ["hot", "hot-later", "warm", "cold"]


def test_a_request_is_passed_over_at_most_max_passovers_times():
    cold = Job("cold", 0)
    waiting = [cold]
    started = []
    for i in range(10):  # a stream of well-cached requests keeps arriving
        waiting.append(Job(f"hot{i}", 1000))
        job = pick_next(waiting, lambda j: j.reuse, max_passovers=3)
        waiting.remove(job)
        started.append(job.name)
    assert started.index("cold") == 3  # overtaken three times, then it goes
    assert cold.passovers == 3
