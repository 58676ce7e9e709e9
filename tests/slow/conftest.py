"""Tests that run a real engine or tool, kept out of the rooms so `pytest tests/unit` stays
quick: the Helm chart (rendered by the real Helm engine, helm_python), the container image's
definition, the generated gRPC code against protoc, the release workflow with its linters,
and the install commands of the docs against the chart.
"""
