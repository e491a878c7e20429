"""Real inference engines: vLLM's KV-event feed, and starting real vLLM CPU engines.

* :mod:`.kv_events`: the KV-event wire format and its translation to the
  router's block hashes (pure);
* :mod:`.kv_subscriber`: the gateway's ZMQ subscriber (one bound SUB socket
  for every engine, one topic per engine), sequence gaps and replay;
* :mod:`.vllm_fleet`: start and stop real vLLM CPU engines on loopback.
"""
