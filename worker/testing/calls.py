"""How the calls the kit saw (:mod:`worker.testing.effects`) are compared between two runs:
every call of an ordinary handler counts, a side effect's calls count once per
idempotency key; by target, by host or by kind, whichever two runs applying once agree on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.registry import Runs
from worker.testing.effects import Effect
from worker.testing.probe import Trace

_DIFFER = "differs between two runs that apply each message once"
_LEVELS = {"host": "by host (their paths differ)", "kind": "by kind only (their targets differ)"}


@dataclass(slots=True)
class Calls:
    """How the calls the kit saw are compared: by target, by host, or by kind, whichever
    two runs applying once agree on; ``notes`` says what was left out."""

    level: str = "target"  # "target", "host", "kind" or "none"
    notes: list[str] = field(default_factory=list)

    @classmethod
    def between(cls, first: Sequence[Trace], second: Sequence[Trace]) -> Calls:
        for level in ("target", "host", "kind"):
            calls = cls(level)
            if calls.counts(first) == calls.counts(second):
                if level != "target":
                    calls.notes = [f"effects compared {_LEVELS[level]}: {_DIFFER}"]
                return calls
        return cls("none", [f"effects not compared: their number {_DIFFER}"])

    def _key(self, effect: Effect) -> str:
        if self.level == "host":
            return effect.host
        if self.level == "kind":
            return effect.kind
        return f"{effect.kind} {effect.target}"

    def counts(self, traces: Sequence[Trace]) -> Counter[tuple[str, str, str]]:
        """(consumer, how, what) -> how many: every call of a transaction handler counts,
        a claim's calls once per idempotency key (what a provider that honours keys sees)."""
        found: Counter[tuple[str, str, str]] = Counter()
        keys: dict[tuple[str, str, str], set[str]] = {}
        if self.level == "none":
            return found
        for trace in traces:
            for effect in trace.effects:
                if effect.kind == "read":
                    continue  # a safe request changes nothing at the provider
                what = self._key(effect)
                if trace.runs is Runs.CLAIM and effect.key is not None:
                    keys.setdefault((trace.consumer, "claim", what), set()).add(effect.key)
                else:
                    how = "claim" if trace.runs is Runs.CLAIM else "transaction"
                    found[(trace.consumer, how, what)] += 1
        for key, seen in keys.items():
            found[key] += len(seen)
        return found

    def compare(self, base: Sequence[Trace], run: Sequence[Trace]) -> list[str]:
        want, got = self.counts(base), self.counts(run)
        lines = []
        for key in sorted(set(want) | set(got)):
            if want[key] != got[key]:
                consumer, how, what = key
                unit = "calls with distinct idempotency keys" if how == "claim" else "calls"
                lines.append(f"effects: {got[key]} {unit} {what} by {consumer} (once: {want[key]})")
        return lines

    def more(self, base: Sequence[Trace], run: Sequence[Trace]) -> str | None:
        """Which kind of handler made more calls than applying once ("transaction",
        "claim"), or None."""
        want, got = self.counts(base), self.counts(run)
        for key in sorted(got):
            if got[key] > want[key]:
                return key[1]
        return None
