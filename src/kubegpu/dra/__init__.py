"""Dynamic Resource Allocation (resource.k8s.io/v1): the DRA mode, a sibling of `plugin/`
over the same core.

`slices` builds the node's ResourceSlices and `publisher` keeps them in the API;
`registration` answers the kubelet's plugin watcher, `service` prepares and unprepares
claims (per-claim CDI specs through `kubegpu.cdi`, edits from `kubegpu.allocation`),
`checkpoint` keeps what was prepared across restarts, `driver` runs both servers, and
`front` (`DraFront`) assembles all of it as the daemon's front in DRA mode.
"""
