"""Dynamic Resource Allocation (resource.k8s.io/v1): the DRA mode, a sibling of `plugin/`
over the same core.

`slices` builds the node's ResourceSlices and `publisher` keeps them in the API;
`registration` answers the kubelet's plugin watcher; `service` (the helper part) reads
each claim, parsed once into the typed values of `resourceclaim`, and answers the
kubelet, while `state` (the device state) prepares and unprepares it (per-claim CDI specs
planned by `claims` through `kubegpu.cdi`, edits from `kubegpu.allocation`) and
`checkpoint` keeps what was prepared across restarts; `driver` runs both servers, and
`front` (`DraFront`) assembles all of it as the daemon's front in DRA mode.
"""
