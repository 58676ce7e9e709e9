"""The shared core under both fronts: the node-state store (`kubegpu.state`), the resources it
derives (`kubegpu.resources`), the supervisor, bounded file reads (`kubegpu.files`), the path
watch and the back-off (`kubegpu.watch`).
"""
