"""The DRA wing's pure and in-memory parts (`kubegpu.dra`): claims to devices, sizing by memory,
the checkpoint, ResourceSlice bodies and their publisher, stale device-plugin resources. Over
real sockets: tests/integration/dra/.
"""
