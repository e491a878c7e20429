"""The harness: live fleets on loopback and the client that replays traffic through them.

Everything that starts real servers and measures them shares this package:
``prefixrouter demo`` and ``prefixrouter bench``, the real-vLLM fleet
(:mod:`prefixrouter.real_engines.vllm_fleet`), ``benchmarks/``, ``scripts/``
and the tests' clusters. One module per job:

* :mod:`~prefixrouter.harness.ports`: free loopback ports, picked below the
  kernel's ephemeral range (why: in the module);
* :mod:`~prefixrouter.harness.processes`: server subprocesses, stop by PID
  (bounded terminate-then-kill, process groups included) and the
  :class:`~prefixrouter.harness.processes.Fleet` that never leaves one behind;
* :mod:`~prefixrouter.harness.health`: waits for ``/health`` and for a first
  request through a router;
* :mod:`~prefixrouter.harness.engines`: emptying engines' prefix caches between
  runs (drain, reset, announce), for the simulated engine and vLLM alike;
* :mod:`~prefixrouter.harness.replay`: the open-loop streaming OpenAI client that
  measures TTFT, end-to-end latency and cached tokens;
* :mod:`~prefixrouter.harness.texts`: seeded text for workloads.

Layer: above ``core``, ``prompt`` and the tokenizer, below the simulator, the
engines, the gateway, the bench and the demo; it knows servers only by their
HTTP API and command lines, never by importing them. The figures it helps
produce are reported with :mod:`prefixrouter.stats`'s one percentile
definition; engine pages are read with :mod:`prefixrouter.prometheus`.
"""
