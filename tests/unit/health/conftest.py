"""Device health (`kubegpu.health`): the Xid policy, the monitor on a simulated node and on the
fake pynvml, and every device a failed GPU backs going unhealthy together.
"""
