"""The config (`kubegpu.config`): the v1 schema and its one-line errors, the bounded loader, the
live source with reloads and named configs, the effective config shown, the JSON Schema.
"""
