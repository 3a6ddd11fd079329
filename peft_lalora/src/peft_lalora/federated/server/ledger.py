"""Per-client privacy ledger for sample-level DP-SGD in federated training.

Every client runs DP-SGD on its own data with its own Opacus accountant, so its guarantee is about *its*
examples and depends only on the steps *it* ran: a client sampled in fewer rounds has spent less. The
ledger keeps each client's accountant history — Opacus's compressed list of
``(noise_multiplier, sample_rate, num_steps)`` — and recomputes ε at the ledger's δ with a fresh
accountant of the same kind, so the numbers are reproducible from data that can be sent over the wire
(the Flower runner does exactly that). This is record-level DP per client; it is *not* client-level DP
(Flower's ``DifferentialPrivacy*`` wrappers), and the two are never mixed here.

ε is never under-reported, whatever a client says:

* **reports accumulate.** A client reports its cumulative history each round. A report that extends what is
  recorded replaces it; one that does not (a reset accountant, a shorter or rewritten history) is *added* to
  it — the conservative reading — and the anomaly is kept in :meth:`PrivacyLedger.report`.
* **a report claims no more than the server asked for.** With ``max_steps`` (the server passes the steps it
  charged), a report with more steps, σ <= 0, a NaN/∞ or negative entry is refused *before* any accountant
  call (:class:`InadmissibleReport`, noted in ``anomalies``): a reply claiming 1e9 steps cannot make the PRV
  accountant allocate without bound, nor inflate ε to 1e11 with RDP.
* **the server's own count is a floor.** :meth:`PrivacyLedger.charge` records what the server asked for (the
  σ, q and number of steps of each train message it sent); a client's ε is the larger of the ε of its reports
  and the ε of its charges. A client that crashed mid-round, lost its reply or lied is charged all the same.
* **only a proof takes a charge back.** :meth:`PrivacyLedger.withdraw` removes a round's charge when the caller has
  proof that the client ran no DP step in it (the in-process runner sees the client's own accountant); a remote
  error reply is no proof and stays charged. ``withdrawn_steps`` in the report counts what was taken back.

ε is recomputed with an upper-bound accountant only (``"rdp"`` or ``"prv"``): ``"gdp"`` is refused
(:data:`GDP_REFUSED`). A negative ε from a numerical accountant (δ large for the steps) means (0, δ)-DP and is
reported as 0.0. δ must be below 1/N for every client's N records (:func:`check_delta`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACCOUNTANTS",
    "ClientPrivacy",
    "GDP_REFUSED",
    "InadmissibleReport",
    "PrivacyLedger",
    "check_accountant",
    "check_delta",
    "delta_problem",
    "epsilon_from_history",
    "extends",
    "normalize_history",
    "report_problem",
]

HistoryEntry = tuple[float, float, int]
#: the accountants whose ε is an upper bound (Opacus' PRV and RDP)
ACCOUNTANTS = ("rdp", "prv")
GDP_REFUSED = (
    "accountant='gdp' is refused: Opacus' GDP accountant is a central-limit approximation, not an upper bound on "
    "epsilon (calibrating epsilon=2 over 40 steps at q=0.01 it reports 2.0 where PRV gives 5.7 and RDP 7.1 for "
    "the same noise); use 'prv' or 'rdp'"
)


def check_accountant(accountant: str) -> str:
    """``accountant`` if it is one of :data:`ACCOUNTANTS`; ``ValueError`` saying why otherwise."""
    if accountant == "gdp":
        raise ValueError(GDP_REFUSED)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def delta_problem(delta: float, n: int) -> str | None:
    """Why ``delta`` is too large for a dataset of ``n`` records (the privacy unit is one record), or ``None``."""
    if delta * n < 1:
        return None
    return (
        f"delta={delta:g} >= 1/N for N = {n} records (the client's dataset; its privacy unit is one record): with "
        "delta >= 1/N, publishing one record outright is (0, delta)-DP; choose delta well below 1/N, e.g. 1e-5 or "
        f"1/N^1.1 = {n**-1.1:.3g}"
    )


def check_delta(delta: float, sizes: Sequence[int]) -> None:
    """``ValueError`` naming the first partition whose size ``N`` has ``delta >= 1/N``."""
    for p, n in enumerate(sizes):
        problem = delta_problem(delta, int(n))
        if problem is not None:
            raise ValueError(f"partition {p}: {problem}")


def normalize_history(history: Iterable[Sequence[float]]) -> list[HistoryEntry]:
    """Validate and merge consecutive equal ``(σ, q)`` entries, as Opacus's accountants store them."""
    out: list[HistoryEntry] = []
    for entry in history:
        if len(entry) != 3:
            raise ValueError(f"history entries are (noise_multiplier, sample_rate, num_steps), got {entry!r}")
        noise_multiplier, q, steps = float(entry[0]), float(entry[1]), entry[2]
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
        if not (0.0 < q <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}")
        if int(steps) != steps or int(steps) < 0:
            raise ValueError(f"num_steps must be a non-negative int, got {steps!r}")
        steps = int(steps)
        if steps == 0:
            continue
        if out and out[-1][0] == noise_multiplier and out[-1][1] == q:
            out[-1] = (noise_multiplier, q, out[-1][2] + steps)
        else:
            out.append((noise_multiplier, q, steps))
    return out


#: the smallest σ a client's report may hold (opacus_spectral's calibration range starts there): below it a report is
#: refused, not folded into the federation's largest ε (σ = 1e-300 made that ε infinite)
MIN_REPORTED_SIGMA = 0.1


class InadmissibleReport(ValueError):
    """A client's accountant report is out of bounds (refused before it reaches an accountant)."""


def report_problem(history: Iterable[Sequence[float]], max_steps: int) -> str | None:
    """Why a client-supplied history is inadmissible, or ``None``: malformed, NaN/∞/negative entries, σ <= 0
    (ε = ∞ — a federation never runs without noise), σ below :data:`MIN_REPORTED_SIGMA`, or more steps in all than
    ``max_steps`` (what was charged). Cheap: no accountant is called."""
    entries = list(history)
    if len(entries) > max_steps:  # every real entry holds >= 1 step
        return f"{len(entries)} history entries but the server charged only {max_steps} steps"
    try:
        hist = normalize_history(entries)
    except (ValueError, TypeError, OverflowError) as err:
        return f"malformed accountant history: {err}"
    if any(not s > 0 for s, _, _ in hist):
        return "noise_multiplier <= 0 in the reported history (a federated client always adds noise)"
    if any(s < MIN_REPORTED_SIGMA for s, _, _ in hist):
        return (
            f"noise_multiplier below {MIN_REPORTED_SIGMA} in the reported history (no calibrated DP client runs there; "
            "the server keeps what it charged)"
        )
    total = sum(n for _, _, n in hist)
    if total > max_steps:
        return f"reports {total} DP steps but the server charged only {max_steps}"
    return None


def epsilon_from_history(history: Iterable[Sequence[float]], delta: float, accountant: str = "prv") -> float:
    """ε at ``delta`` spent by ``history`` under Opacus' ``accountant`` (``"prv"``, the engine's default, or
    ``"rdp"``; ``"gdp"`` is refused: :data:`GDP_REFUSED`).

    With opacus-spectral installed this is its :func:`opacus_spectral.accounting.epsilon_from_history` (the entries
    and δ validated there); without it, a fresh Opacus accountant (:func:`_fresh_accountant_epsilon`). An empty
    history spends nothing (ε = 0); a negative ε (δ large for the steps: (0, δ)-DP) is 0.0.
    """
    check_accountant(accountant)
    try:
        from opacus_spectral.accounting import epsilon_from_history as library
    except ImportError:  # peft-lalora without opacus-spectral
        return _fresh_accountant_epsilon(history, delta, accountant)
    return library(history, delta, accountant)


def _fresh_accountant_epsilon(history: Iterable[Sequence[float]], delta: float, accountant: str) -> float:
    """The fallback of :func:`epsilon_from_history`: a fresh Opacus accountant fed the normalized ``history``."""
    from opacus.accountants import create_accountant

    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    hist = normalize_history(history)
    if not hist:
        return 0.0
    acc = create_accountant(mechanism=accountant)
    acc.history = list(hist)
    eps = float(acc.get_epsilon(delta=delta))
    return 0.0 if eps < 0 else eps  # NaN stays NaN: never hidden as 0


def extends(history: Sequence[HistoryEntry], prefix: Sequence[HistoryEntry]) -> bool:
    """Whether the (normalized) ``history`` continues ``prefix``: the same entries, the last one possibly with
    more steps, then any further entries."""
    if len(prefix) > len(history):
        return False
    for i, (old, new) in enumerate(zip(prefix, history, strict=False)):  # history may be longer than prefix
        last = i == len(prefix) - 1
        if old[:2] != new[:2] or (old[2] != new[2] and not (last and new[2] > old[2])):
            return False
    return True


@dataclass
class ClientPrivacy:
    """What the ledger knows about one client.

    ``history`` is what the client's reports add up to; ``charged`` is what the server asked of it;
    ``epsilon`` is the larger of the two ε; ``anomalies`` says when the two disagreed or a report regressed.
    """

    client: Any
    history: list[HistoryEntry] = field(default_factory=list)
    charged: list[HistoryEntry] = field(default_factory=list)
    rounds: int = 0
    epsilon: float = 0.0
    epsilon_reported: float = 0.0
    epsilon_charged: float = 0.0
    anomalies: list[str] = field(default_factory=list)
    #: charged steps taken back with proof that they never ran (:meth:`PrivacyLedger.withdraw`)
    withdrawn_steps: int = 0

    @property
    def steps(self) -> int:
        return sum(h[2] for h in self.history)

    @property
    def charged_steps(self) -> int:
        return sum(h[2] for h in self.charged)


def bounding_history(info: ClientPrivacy) -> list[HistoryEntry]:
    """The history behind a client's ε (the larger of what it reported and what it was charged): the one its
    privacy record keeps."""
    return info.charged if info.epsilon_charged > info.epsilon_reported else info.history


class PrivacyLedger:
    """ε of every client at one δ, from each client's own accountant history.

    Args:
        delta: the δ every ε is reported at (e.g. 1e-5, or below 1/n_i for client i).
        accountant: Opacus accountant kind used to recompute ε (``"rdp"`` or ``"prv"``; ``"gdp"``, an
            approximation, is refused); use the clients' kind so the ledger matches what they report.
    """

    def __init__(self, delta: float, accountant: str = "rdp") -> None:
        self.accountant = check_accountant(accountant)
        if not (0.0 < delta < 1.0):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        self.delta = float(delta)
        self._clients: dict[Any, ClientPrivacy] = {}

    def register(self, client: Any) -> None:
        """Make ``client`` appear in reports (with ε = 0) before it is ever sampled."""
        self._clients.setdefault(client, ClientPrivacy(client))

    def record(
        self,
        client: Any,
        history: Iterable[Sequence[float]],
        *,
        participated: bool = True,
        max_steps: int | None = None,
    ) -> float:
        """Take ``client``'s cumulative accountant history as it reports it now; return its ε.

        A report that extends the recorded history replaces it. Any other report is added to it (never
        lowering ε) and noted in ``anomalies``, with a ``RuntimeWarning``. With ``max_steps`` (a remote
        report), :func:`report_problem` is checked first: an inadmissible report is noted in ``anomalies`` and
        raises :class:`InadmissibleReport`, and nothing is recorded.
        """
        info = self._clients.setdefault(client, ClientPrivacy(client))
        if max_steps is not None:
            problem = report_problem(history, max_steps)
            if problem is not None:
                info.anomalies.append(f"report refused: {problem}")
                raise InadmissibleReport(problem)
        hist = normalize_history(history)
        if extends(hist, info.history):
            info.history = hist
        else:
            note = (
                f"reported history {hist} does not extend the recorded {info.history} (reset or rewritten "
                "accountant?); added to it"
            )
            info.anomalies.append(note)
            warnings.warn(f"privacy ledger: client {client!r}: {note}", RuntimeWarning, stacklevel=2)
            info.history = normalize_history([*info.history, *hist])
        info.rounds += int(participated)
        info.epsilon_reported = epsilon_from_history(info.history, self.delta, self.accountant)
        return self._update(info)

    def charge(self, client: Any, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """Record that the server asked ``client`` for ``steps`` DP steps at (σ, q); return its ε."""
        info = self._clients.setdefault(client, ClientPrivacy(client))
        info.charged = normalize_history([*info.charged, (noise_multiplier, sample_rate, steps)])
        info.epsilon_charged = epsilon_from_history(info.charged, self.delta, self.accountant)
        return self._update(info)

    def withdraw(self, client: Any, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """Take back the last ``steps`` charged to ``client`` at (σ, q), only with proof that they never ran (the
        caller saw the client's own accountant); ``ValueError`` if that is more than its last charge. Returns ε."""
        info = self._clients[client]
        last = info.charged[-1] if info.charged else None
        if last is None or last[:2] != (float(noise_multiplier), float(sample_rate)) or last[2] < steps:
            raise ValueError(
                f"client {client!r}: cannot withdraw {steps} steps at (σ={noise_multiplier}, q={sample_rate}): more "
                f"than was charged last ({last})"
            )
        rest = last[2] - int(steps)
        info.charged = [*info.charged[:-1], *([(last[0], last[1], rest)] if rest else [])]
        info.withdrawn_steps += int(steps)
        info.epsilon_charged = epsilon_from_history(info.charged, self.delta, self.accountant)
        return self._update(info)

    def _update(self, info: ClientPrivacy) -> float:
        info.epsilon = max(info.epsilon_reported, info.epsilon_charged)
        return info.epsilon

    def epsilon(self, client: Any) -> float:
        return self._clients[client].epsilon

    @property
    def epsilons(self) -> dict[Any, float]:
        return {c: info.epsilon for c, info in self._clients.items()}

    @property
    def max_epsilon(self) -> float:
        """Largest per-client ε (0 when nothing was recorded)."""
        return max((info.epsilon for info in self._clients.values()), default=0.0)

    @property
    def clients(self) -> Mapping[Any, ClientPrivacy]:
        return dict(self._clients)

    def report(self) -> dict[str, Any]:
        """JSON-ready summary: δ, accountant, max ε, and per client ε / steps / rounds / the distinct noise
        multipliers σ and sample rates q its history holds."""
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "max_epsilon": self.max_epsilon,
            "clients": {
                str(c): {
                    "epsilon": info.epsilon,
                    "epsilon_reported": info.epsilon_reported,
                    "epsilon_charged": info.epsilon_charged,
                    "steps": info.steps,
                    "charged_steps": info.charged_steps,
                    "withdrawn_steps": info.withdrawn_steps,
                    "rounds": info.rounds,
                    "anomalies": list(info.anomalies),
                    "noise_multipliers": sorted({h[0] for h in info.history}),
                    "sample_rates": sorted({h[1] for h in info.history}),
                    "history": [list(h) for h in bounding_history(info)],
                }
                for c, info in sorted(self._clients.items(), key=lambda kv: str(kv[0]))
            },
        }
