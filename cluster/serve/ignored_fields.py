"""Unknown request fields, ignored as vLLM ignores them (`http.strict: false`, the default) and said in the log at
WARNING, rate-limited: a new set of names is said at once (a client that starts sending a field is seen), a set
already said at most once a minute, with the count of requests that sent it since; the sets remembered are bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

EVERY_S = 60.0  # the most often one set of ignored names is said again
_REMEMBERED = 256  # sets of names remembered (the oldest forgotten first)


class IgnoredFields:
    """One per ingress replica: `note(route, names, rid)` for each request that sent unknown fields."""

    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._said: dict[tuple[str, tuple[str, ...]], tuple[float, int]] = {}  # -> (when last said, since then)

    def note(self, route: str, names: Sequence[str], rid: str | None = None) -> bool:
        """Say (or count) a request's ignored fields; True when it was said."""
        if not names:
            return False
        key = (route, tuple(dict.fromkeys(names)))
        now = self.clock()
        said = self._said.get(key)
        if said is not None and now - said[0] < self.every_s:
            self._said[key] = (said[0], said[1] + 1)
            return False
        since = f" ({said[1]} more requests sent them since it was last said)" if said and said[1] else ""
        log.warning("%s request %s: ignored unknown fields %s, which specserve does not take (http.strict: true "
                    "refuses them with 400)%s", route, (rid or "-")[:128], ", ".join(key[1]), since)  # fmt: skip
        self._said.pop(key, None)
        self._said[key] = (now, 0)
        while len(self._said) > _REMEMBERED:
            del self._said[next(iter(self._said))]
        return True
