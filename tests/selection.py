"""What a pytest run selected, for a fixture that forks one run serving several tests of its file."""

from __future__ import annotations


def selected_values(request, key: str, every) -> tuple:
    """The values of parameter `key` taken by this run's selected tests of the requesting test's file, in the order of
    `every`; all of `every` when one of those tests does not take `key` (it reads every value). A forked fixture steps
    only these, so a test run alone (as a mutation's run takes it) steps only its own."""
    wanted = set()
    for item in request.session.items:
        if item.path == request.path:
            callspec = getattr(item, "callspec", None)
            if callspec is None or key not in callspec.params:
                return tuple(every)
            wanted.add(callspec.params[key])
    return tuple(v for v in every if v in wanted)
