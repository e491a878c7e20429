"""prefixrouter as the endpoint picker (EPP) of the Gateway API Inference Extension.

A gateway (Envoy, kgateway, Istio, Envoy Gateway, GKE) asks the picker over
Envoy's ext_proc gRPC protocol which model server should take each request;
the picker answers with ``x-gateway-destination-endpoint: IP:PORT`` and the
gateway sends the request there. The picker runs the gateway's own parts on
the gateway's own state (:class:`~prefixrouter.gateway.state.GatewayState`):
the dispatcher and router, the body parse and tenancy rules, the usage
feedback, the decision log and the Prometheus metrics
(:class:`~prefixrouter.gateway.flow.RequestFlow` holds what the two front ends share).

Modules:

* :mod:`.protocol`: the protocol's header and metadata names, the messages built and read;
* :mod:`.exchange`: one HTTP request's ext_proc stream, message by message;
* :mod:`.server`: the gRPC server (ext_proc and health) and the HTTP observability port;
* :mod:`.envoy`: the shipped Envoy bootstrap (``deploy/envoy/envoy.yaml``), rendered
  for given ports, and Envoy started as a process;
* :mod:`.cli`: ``prefixrouter epp``.
"""
