"""Outside strings: Kubernetes' own name rules, UIDs as the API server issues them, and the
one escaping helper."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubegpu.untrusted import (
    escape,
    is_dns_label,
    is_dns_subdomain,
    is_uid,
    object_problem,
)


@pytest.mark.parametrize(
    "name", ["a", "default", "kube-system", "gpu-operator-resources", "0", "a" * 63]
)
def test_namespaces_kubernetes_allows(name: str) -> None:
    assert is_dns_label(name)


@pytest.mark.parametrize(
    "name",
    ["", "-a", "a-", "A", "a.b", "a_b", "a" * 64, "..", "../x", "a/b", "a\n", "é", "a b", "a\x00"],
)
def test_namespaces_kubernetes_refuses(name: str) -> None:
    assert not is_dns_label(name)


@pytest.mark.parametrize(
    "name",
    ["a", "pod-gpu-x7k2q", "my.claim", "1.2.3", "a" * 253, ".".join(["a" * 63] * 4)[:253]],
)
def test_object_names_kubernetes_allows(name: str) -> None:
    assert is_dns_subdomain(name)


@pytest.mark.parametrize(
    "name", ["", ".", "a..b", ".a", "a.", "A", "a" * 254, "../etc", "a/b", "a\nb", "a\u2028b"]
)
def test_object_names_kubernetes_refuses(name: str) -> None:
    assert not is_dns_subdomain(name)


@given(st.uuids())
def test_every_uid_the_api_server_issues_is_taken(value: uuid.UUID) -> None:
    # The API server writes uuid.NewUUID() as Go's uuid.String(): lowercase, dashed.
    assert is_uid(str(value))
    assert is_uid(str(value).upper())


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "u-1",
        "../../etc/passwd",
        "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c0",  # one digit short
        "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c011",
        "3d9d1a525cf04a2b9a4e2f1d8b1e0c01",
        "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c0\n",
        "3d9d1a52-5cf0-4a2b-9a4e-2f1d8b1e0c0g",
    ],
)
def test_anything_else_is_not_a_uid(uid: str) -> None:
    assert not is_uid(uid)


def test_the_problem_names_the_field_escaped_and_bounded() -> None:
    assert object_problem("ns", "c", str(uuid.uuid4())) is None
    assert object_problem("ns", "c") is None
    forged = object_problem("ns\nkubegpu: FORGED" + "x" * 100_000, "c")
    assert forged is not None and forged.startswith("namespace 'ns\\nkubegpu: FORGED")
    assert "\n" not in forged and len(forged) < 400
    name = object_problem("ns", "\x1b[31mred")
    assert name is not None and name.startswith("name '\\x1b[31mred'")
    uid = object_problem("ns", "c", "u\r1")
    assert uid is not None and uid.startswith("UID 'u\\r1'")


@given(st.text())
def test_escape_is_one_printable_bounded_line(text: str) -> None:
    line = escape(text)
    assert line.isprintable()
    # 80 characters kept, each at most \U0010ffff (10) once escaped, and "...".
    assert len(line) <= 80 * 10 + 3
