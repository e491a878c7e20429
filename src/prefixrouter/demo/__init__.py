"""``prefixrouter demo``: a preset of the live bench, two routers on the demo's own workload.

* :mod:`~prefixrouter.demo.workload`: the built-in traffic (doc-QA and
  system-prompt chats, seeded);
* :mod:`~prefixrouter.demo.run`: the preset (:func:`prefixrouter.bench.live.run_scenario`
  with ``round_robin`` and ``prefixrouter``) and the gateway ``--serve`` keeps;
* :mod:`~prefixrouter.demo.cli`: the command.
"""
