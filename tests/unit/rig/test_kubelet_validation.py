"""The kubelet's name, endpoint and device ID checks, as pure functions (kubegpu.kubelet).

The emulator refuses a registration with these; the rules are the kubelet's
(`IsExtendedResourceName`, `IsQualifiedName`, the 63-character ID limit), so a name the
emulator accepts is one a real node accepts.
"""

from __future__ import annotations

import pytest

from kubegpu.api import VERSION
from kubegpu.kubelet import (
    device_id_error,
    is_extended_resource_name,
    register_request_error,
    resource_name_errors,
)

ACCEPTED = [
    "nvidia.com/gpu",
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/gpu.shared",
    "amd.com/gpu",
    "example.com/" + "g" * 63,  # the longest name part
    "a/b",
    "x.y-z.example/a_b.c-d",
]

#: name -> a fragment of the reason it is refused
REFUSED = {
    "gpu": "must contain '/'",
    "kubernetes.io/gpu": "kubernetes.io namespace",
    "gpu.kubernetes.io/gpu": "kubernetes.io namespace",
    "requests.example.com/gpu": "must not start with 'requests.'",
    "/gpu": "lowercase RFC 1123 subdomain",  # checked as "requests./gpu"
    "example.com/": "name part must be non-empty",
    "Example.com/gpu": "lowercase RFC 1123 subdomain",
    "-example.com/gpu": "lowercase RFC 1123 subdomain",
    ("e" * 250) + ".com/gpu": "prefix part must be no more than 253 characters",
    "example.com/" + "g" * 64: "name part must be no more than 63 characters",
    "example.com/-gpu": "must start and end with an alphanumeric character",
    "example.com/gpu!": "must start and end with an alphanumeric character",
    "example.com/a/b": "an optional prefix, a '/' and a name",
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_extended_resource_names_are_accepted(name: str) -> None:
    assert is_extended_resource_name(name)
    assert resource_name_errors(name) == []


@pytest.mark.parametrize(("name", "reason"), REFUSED.items(), ids=list(REFUSED))
def test_other_names_are_refused_with_the_reason(name: str, reason: str) -> None:
    assert not is_extended_resource_name(name)
    errors = resource_name_errors(name)
    assert len(errors) == 1, errors
    assert reason in errors[0]


@pytest.mark.parametrize(
    ("version", "name", "endpoint", "fragment"),
    [
        ("v1alpha1", "nvidia.com/gpu", "kubegpu.sock", 'Supported versions are ["v1beta1"]'),
        (VERSION, "gpu", "kubegpu.sock", 'the ResourceName "gpu" is invalid'),
        (VERSION, "nvidia.com/gpu", "..", "invalid endpoint '..'"),
        (VERSION, "nvidia.com/gpu", "a\x00b", "must be a socket file name"),
    ],
)
def test_register_request_refusals_read_like_the_kubelets(
    version: str, name: str, endpoint: str, fragment: str
) -> None:
    error = register_request_error(version, name, endpoint)
    assert error is not None and fragment in error


def test_a_valid_register_request_has_no_error() -> None:
    assert register_request_error(VERSION, "nvidia.com/gpu", "kubegpu-nvidia.com-gpu.sock") is None


@pytest.mark.parametrize(
    ("device_id", "fragment"),
    [("", "must be non-empty"), ("G" * 64, "is 64 characters long; the limit is 63")],
)
def test_device_ids_must_be_1_to_63_characters(device_id: str, fragment: str) -> None:
    error = device_id_error(device_id)
    assert error is not None and fragment in error


@pytest.mark.parametrize("device_id", ["G", "GPU-" + "0" * 59, "GPU-1::3"])
def test_device_ids_within_the_limit_pass(device_id: str) -> None:
    assert device_id_error(device_id) is None
