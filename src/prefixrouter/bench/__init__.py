"""``prefixrouter bench``: our gateway against the real peer routers, live, on one fleet.

Modules, one job each:

* :mod:`~prefixrouter.bench.workload`: simulator scenarios turned into text chat
  requests (shared segments become shared text) and the engines' time scale;
* :mod:`~prefixrouter.bench.routers`: the routers compared (our gateway, sglang-router,
  vllm-router), where their virtual environments are and how each is started;
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
