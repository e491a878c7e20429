"""Active-active gateway replicas: routing facts shared over NATS JetStream.

Several gateway replicas behind one load balancer each route a share of the
traffic. Each replica's :class:`~prefixrouter.core.dispatch.Dispatcher`
records a fact for every change its peers must mirror
(:mod:`prefixrouter.core.facts`: a routing with its block hashes, a first
token, a settlement with the engine's cached tokens, a worker down or
restarted); this package carries them between replicas and applies them
through the same dispatcher calls as a replica's own requests, so every
replica's index knows what all of them placed where.

Modules, one job each:

* :mod:`~prefixrouter.cluster.codec`: facts <-> compact binary batches;
* :mod:`~prefixrouter.cluster.envelope`: the header of every message
  (replica id, epoch, configuration fingerprint, send time);
* :mod:`~prefixrouter.cluster.fingerprint`: what must agree for block hashes
  to agree, digested;
* :mod:`~prefixrouter.cluster.registry`: live peers, epochs, TTL (pure);
* :mod:`~prefixrouter.cluster.transport`: the NATS JetStream link;
* :mod:`~prefixrouter.cluster.node`: a replica's membership (publish, apply,
  heartbeats, readiness, refusal of an incompatible configuration).

**Cost** (``benchmarks/cluster_sync.py``, four replicas side by side with
the previous code, on a shared 2-core machine): sync as the node counts it,
per request of the whole cluster and per replica, 0.23 ms at 8 requests/s,
0.28 ms at 50 and 0.23 ms at 200, against the 0.05 ms target; 70-75 % of it
is applying peers' facts (the core's index, policy and ledger work for a
peer's request, each call on caches other processes evicted), and nats-py's
receive path costs about as much again outside the node's count.
Propagation lag p50 1-3 ms, p99 6-20 ms with the machine's load.
``benchmarks/replicas_live_results.md`` has the tables.

Layer: with ``sim``, ``real_engines`` and the other engines' drivers, below
``gateway`` (which wires it in) and above ``core`` and ``harness``.

**Consistency model.** Eventually consistent, no coordination on the request
path: a replica routes on its own view at once and publishes what it did;
its peers apply it one propagation lag later (no batch window after a quiet
spell, 2-4 ms in a busy one, plus NATS;
``prefixrouter_cluster_propagation_lag_seconds`` measures both, from the
recording of a message's first fact).
Each fact is applied once per origin, in the origin's order: live messages
come over core NATS, the stream's over a catch-up consumer, and each
origin's messages are numbered, so where the two overlap nothing is applied
twice (:mod:`~prefixrouter.cluster.transport`). What can go wrong within the
lag:

A live message is held on arrival and applied just before the replica next
routes or reads its routing state (at most ``apply_within_s`` later), so no
decision misses a fact heard before it and one pass applies several messages
(:meth:`~prefixrouter.core.dispatch.Dispatcher.hold_peer_facts`).

* two replicas that see a *new* prefix within one lag of each other both
  find it cold and may send it to two different workers: the prefix is
  prefilled twice and then lives on both (later requests go to either: the
  index knows both copies once the facts arrive). One lag is milliseconds;
  a prefix's second request usually comes later than that;
* in-flight counts (queue depth per worker) lag by the same amount, so two
  replicas can each pick the least-loaded worker for a burst; each replica
  therefore learns how many peers' routings its own do not see (from the
  time each routing was made) and routes behind its share of them
  (:mod:`~prefixrouter.core.unseen`), which spreads a burst as one router
  would, in expectation;
* a worker one replica saw go down is still routed to by the others for one
  lag (their own health checks or the fact catch up).

A peer's routing is speculative until the peer's completion confirms it,
exactly like one's own. A SIGKILLed peer's in-flight routings are settled
without feedback after ``peer_ttl_s`` of silence; a restarted peer has a new
epoch, which ends the old life at once. While NATS is unreachable each
replica routes on its own view (``prefixrouter_cluster_connected`` is 0);
when it returns, the replica reads the stream from shortly before the loss
(holding live messages meanwhile) and so catches up on what it missed, minus
what aged out of the stream; a gap in a peer's numbering that the stream
could not fill is counted (``prefixrouter_cluster_messages_missed_total``).
Facts are not a consensus log: nothing is retried or acknowledged per
message. A fact lost to a full reconnect buffer makes a peer learn that
placement from its own traffic, and the replica that lost it starts a new
epoch, so no peer keeps one of its routings in flight for a settlement that
will never come. A message lost inside a NATS server that died before
storing it is counted as missed by its peers once a later one of its origin
arrives, but not recovered; a routing its lost settlement leaves open at a
peer is settled once it has been open longer than any request may run at its
origin (``proxy.request_timeout_s`` plus ``peer_ttl_s``).
"""
