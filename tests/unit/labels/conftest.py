"""Node labels (`kubegpu.labels`, `kubegpu.labeller`): GFD-compatible labels from inventories, the
labelling loop, and the sinks that deliver them.
"""
