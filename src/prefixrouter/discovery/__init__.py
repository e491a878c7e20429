"""Endpoint discovery: the engines a Kubernetes cluster runs, as they come and go.

* :mod:`~prefixrouter.discovery.targets`: EndpointSlices, pods and an
  ``InferencePool`` -> :class:`~prefixrouter.discovery.targets.Target` (pure);
* :mod:`~prefixrouter.discovery.kubernetes`: the list-and-watch loop
  (kubernetes-asyncio), relisting after a 410 Gone (with backoff while it
  repeats) and every resync, reading the kubeconfig again after a 401, and
  reading an ``InferencePool`` again every ``pool_check_s``.

Layer: with ``cluster`` and the engines' drivers, below ``gateway``, which
turns targets into workers (:mod:`prefixrouter.gateway.discovery_link`), so the
gateway and the endpoint picker, both built from one ``GatewayConfig``, get it.
"""
