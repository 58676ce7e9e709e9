"""The `kubegpu` command (`kubegpu.cli`): one-line errors, the shared option machinery (flag > env
> file), `kubegpu check`, `kubegpu labels`' flags, and `--log-format`.
"""
