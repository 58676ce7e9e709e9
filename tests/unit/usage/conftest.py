"""Who uses what on the GPUs (`kubegpu.usage`): a process's pod from its cgroup, attribution to
containers with each allocation's limit, the per-container metrics end to end.
"""
