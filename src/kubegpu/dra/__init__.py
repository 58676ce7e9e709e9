"""Dynamic Resource Allocation (resource.k8s.io/v1): the DRA mode, a sibling of `plugin/`."""
