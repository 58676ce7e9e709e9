"""The DRA kubelet plugin: a sibling of `kubegpu.plugin` over the same core.

`registration` answers the kubelet's plugin watcher, `service` prepares and unprepares
claims (per-claim CDI specs through `kubegpu.cdi`, edits from `kubegpu.allocation`),
`checkpoint` keeps what was prepared across restarts, `driver` runs both servers.
"""
