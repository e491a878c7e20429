"""``prefixrouter bench``: our gateway against the real peer routers, live, on one fleet.

Modules, one job each:

* :mod:`~prefixrouter.bench.workload`: simulator scenarios turned into text chat
  requests (shared segments become shared text) and the engines' time scale;
* :mod:`~prefixrouter.bench.pressure`: the ``cache-pressure`` scenario, sized from the
  engines' KV (more documents than one engine holds, fewer than the fleet does);
* :mod:`~prefixrouter.bench.routers`: the routers compared (our gateway, sglang-router,
  vllm-router, the oracle), where their virtual environments are and how each is started;
* :mod:`~prefixrouter.bench.oracle`: the oracle router (each document pinned to one
  engine in advance, from the workload) and its proxy;
* :mod:`~prefixrouter.bench.ratios`: our mean TTFT over the oracle's and the best peer's;
* :mod:`~prefixrouter.bench.engine_metrics`: the engines' Prometheus counters
  (prefix-cache hits and queries, finished requests per engine);
* :mod:`~prefixrouter.bench.live`: one scenario through every router on one fleet;
* :mod:`~prefixrouter.bench.instant`, :mod:`~prefixrouter.bench.loadgen` and
  :mod:`~prefixrouter.bench.overhead`: what each router adds over a direct call to
  engines that answer at once;
* :mod:`~prefixrouter.bench.report`: tables, JSON, Markdown and the PNG;
* :mod:`~prefixrouter.bench.runner`: every scenario, then the overhead comparison;
* :mod:`~prefixrouter.bench.cli`: the command.

Processes, health waits, cache resets, the replay client and workload text
come from :mod:`prefixrouter.harness`; ``prefixrouter demo`` is a preset of
this bench (:mod:`prefixrouter.demo`).
"""
