"""``prefixrouter demo``: a live fleet on loopback, the same traffic through two routers."""
