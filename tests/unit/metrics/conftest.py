"""The metrics (`kubegpu.metrics`) as Prometheus scrapes them, and the probe/metrics endpoint
(`kubegpu.httpserver`) over a real socket.
"""
