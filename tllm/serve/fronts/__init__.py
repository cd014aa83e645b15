"""Servers in front of other servers: the router, the disaggregated front, the proxy they share."""
