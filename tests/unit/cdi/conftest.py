"""CDI specs (`kubegpu.cdi`): valid per the CDI schema, NVIDIA's names, files under the driver
root, kept in step with the store.
"""
