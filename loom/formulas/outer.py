"""What data parallelism across replicas costs on the link, per inner step: synchronous gradient
all-reduce against the outer loops of ``loom.parallel.outer`` (DiLoCo, streaming DiLoCo, NoLoCo,
CO2), for the planner to price cross-site training and pick a mode and H.

Pure arithmetic, no torch. The link is the alpha-beta model: a message of M bytes between two
replicas takes ``latency + M / bandwidth``. With R replicas and a message of M bytes (the
gradients for sync, the fp32 pseudo-gradients for the outer loops: 4 bytes per local parameter):

========  =====================================  ===========================================
mode      one synchronisation                    when
========  =====================================  ===========================================
sync      ring all-reduce: sends 2 (R-1)/R M,    every step, blocking
          takes 2 (R-1) latency + 2 (R-1)/R M/B
diloco    the same all-reduce                    every H steps, blocking
streaming the all-reduce of M / F                F times per H steps, blocking
noloco    send M to one peer while receiving M   every H steps; waits for one peer only
          (full duplex): latency + M / B
co2       the same all-reduce as diloco          every H steps, overlapped with the next H
                                                 steps: only what H steps of compute do not
                                                 cover is exposed
========  =====================================  ===========================================

"Bytes" are the wire bytes one replica sends, the quantity ``loom.parallel.comm``'s ledger counts
(``wire_bytes``), so a measured run and this formula can be compared number for number. Under
NoLoCo with an odd R one replica sits each exchange out; the cost given is that of a paired one.
The ring's latency term is ``2 (R-1)`` hops (each of the 2 (R-1) ring steps pays it once).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES: tuple[str, ...] = ("sync", "diloco", "noloco", "co2")


@dataclass(frozen=True)
class ReplicaLinkCost:
    """Per inner step, averaged over the H steps of an outer window."""

    mode: str
    bytes_per_step: float  # wire bytes one replica sends
    comm_time_per_step_s: float  # time the link is busy
    exposed_time_per_step_s: float  # of which the inner steps wait for (not overlapped)
    bytes_per_sync: float  # wire bytes one replica sends at one synchronisation (peak message)
    syncs_per_step: float  # synchronisations per inner step (1/H; F/H for streaming)


def ring_all_reduce_time_s(message_bytes: float, replicas: int, bandwidth_bytes_per_s: float,
                           latency_s: float) -> float:
    """Ring all-reduce of ``message_bytes`` over ``replicas``: 2 (R-1) steps, each one latency
    plus 1/R of the message (reduce-scatter, then all-gather)."""
    steps = 2 * (replicas - 1)
    return steps * latency_s + steps / replicas * message_bytes / bandwidth_bytes_per_s


def replica_link_cost(mode: str, *, message_bytes: float, replicas: int,
                      bandwidth_bytes_per_s: float, latency_s: float, outer_steps: int = 1,
                      fragments: int = 1, compute_time_per_step_s: float = 0.0
                      ) -> ReplicaLinkCost:
    """Bytes and link time per inner step of ``mode`` (see the module docstring).

    ``message_bytes``: what one replica synchronises (sync: its gradients; the outer loops: its
    fp32 pseudo-gradients, 4 bytes per parameter). ``outer_steps`` (H) and ``fragments`` (F,
    streaming DiLoCo) apply to the outer modes; sync ignores them. ``compute_time_per_step_s``:
    one inner step's compute, which CO2's communication hides behind.
    """
    _check(mode, message_bytes, replicas, bandwidth_bytes_per_s, latency_s, outer_steps,
           fragments, compute_time_per_step_s)
    wire_all_reduce = 2 * (replicas - 1) / replicas * message_bytes
    if mode == "sync":
        time = ring_all_reduce_time_s(message_bytes, replicas, bandwidth_bytes_per_s, latency_s)
        return ReplicaLinkCost(mode, wire_all_reduce, time, time, wire_all_reduce, 1.0)
    window = outer_steps  # H inner steps per outer step
    if mode == "noloco":
        time = latency_s + message_bytes / bandwidth_bytes_per_s
        return ReplicaLinkCost(mode, message_bytes / window, time / window, time / window,
                               message_bytes, 1 / window)
    if mode == "diloco":
        fragment_bytes = message_bytes / fragments
        time = fragments * ring_all_reduce_time_s(fragment_bytes, replicas, bandwidth_bytes_per_s,
                                                  latency_s)
        return ReplicaLinkCost(mode, wire_all_reduce / window, time / window, time / window,
                               wire_all_reduce / fragments, fragments / window)
    time = ring_all_reduce_time_s(message_bytes, replicas, bandwidth_bytes_per_s, latency_s)
    exposed = max(0.0, time - window * compute_time_per_step_s)  # co2: hidden behind H steps
    return ReplicaLinkCost(mode, wire_all_reduce / window, time / window, exposed / window,
                           wire_all_reduce, 1 / window)


def _check(mode: str, message_bytes: float, replicas: int, bandwidth_bytes_per_s: float,
           latency_s: float, outer_steps: int, fragments: int,
           compute_time_per_step_s: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not message_bytes > 0:
        raise ValueError(f"message_bytes must be > 0, got {message_bytes!r}")
    if not isinstance(replicas, int) or replicas < 2:
        raise ValueError(f"replicas must be an integer >= 2 (one replica communicates nothing), "
                         f"got {replicas!r}")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
    if not isinstance(outer_steps, int) or outer_steps < 1:
        raise ValueError(f"outer_steps must be an integer >= 1, got {outer_steps!r}")
    if not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
    if fragments > 1 and mode != "diloco":
        raise ValueError(f"fragments (streaming) applies to mode diloco only, got {mode!r}")
    if fragments > outer_steps:
        raise ValueError(f"fragments must be <= outer_steps, got fragments={fragments}, "
                         f"outer_steps={outer_steps}")
    if not compute_time_per_step_s >= 0:
        raise ValueError(f"compute_time_per_step_s must be >= 0, got "
                         f"{compute_time_per_step_s!r}")
