"""partition.Nodes: the two-ended reachability search against a plain walk of the dependencies, on
random graphs grown and merged the way partition grows regions."""
import random

import pytest

from jaxstitch.graph.partition import Nodes


def _walk(nodes: Nodes, starts, target) -> bool:
    """The reference: every dependency of the starts, transitively, themselves included."""
    target = nodes.find(target)
    stack, seen = [nodes.find(s) for s in starts], set()
    while stack:
        n = stack.pop()
        if n == target:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(nodes.find(d) for d in nodes.deps[n])
    return False


@pytest.mark.parametrize("seed", range(20))
def test_reaches_agrees_with_a_plain_walk(seed):
    rng = random.Random(seed)
    nodes, made = Nodes(), []
    for i in range(80):
        nodes.add(i)
        roots = sorted({nodes.find(m) for m in made})
        producers = set(rng.sample(roots, min(len(roots), rng.randint(0, 3))))
        if producers and rng.random() < 0.3:  # a producer's region takes the op in
            joined = rng.choice(sorted(producers))
            nodes.depend(i, producers - {joined})
            nodes.union(joined, i)
        else:
            nodes.depend(i, producers)
        made.append(i)
        if rng.random() < 0.1 and len(made) > 2:  # siblings merged later, stale names left behind
            a, b = rng.sample(made, 2)
            nodes.union(a, b)
    for _ in range(200):
        starts = rng.sample(made, rng.randint(0, 3))
        target = rng.choice(made)
        assert nodes.reaches(starts, target) == _walk(nodes, starts, target), (seed, starts, target)
